"""Tensor parallelism with the features beside it: async scheduling, speculative decoding
(draft model in both runners, ngram in V1, V2's drafts kept on the device under async
scheduling) and pooling. Oracle: the same engine on one rank (float64, CPU, gloo)."""

from __future__ import annotations

import pytest
import torch

from policy import EngineArgs
from shared.contract.sampling_params import SamplingParams
from shared.serving.engine import LLMEngine
from shared.serving.llm import LLM
from tests.shared.serving.tp_fakes import live_children

RUN = dict(model="tiny-llama", dtype="float64", device="cpu", seed=0, max_model_len=64,
           max_num_seqs=8, max_num_batched_tokens=32, num_gpu_blocks_override=64,
           enable_prefix_caching=False)
DRAFT = {"method": "draft_model", "model": "tiny-llama-draft", "num_speculative_tokens": 2}
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


def _generate(**kw) -> dict[str, list[int]]:
    engine = LLMEngine.from_engine_args(EngineArgs(**RUN, **kw))
    try:
        for i, n in enumerate([3, 17, 5, 9]):
            prompt = [(i * 31 + j * 7) % 200 + 1 for j in range(n)] * (2 if i == 2 else 1)
            engine.add_request(f"r{i}", prompt, SamplingParams(
                max_tokens=6, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True))
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            out |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        return out
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name, kw", [
    ("v1-async", dict(model_runner="v1", async_scheduling=True)),
    ("v2-async", dict(model_runner="v2", async_scheduling=True)),
    ("v1-draft", dict(model_runner="v1", speculative_config=DRAFT)),
    ("v2-draft-async", dict(model_runner="v2", speculative_config=DRAFT, async_scheduling=True)),
    ("v1-ngram", dict(model_runner="v1", speculative_config=NGRAM)),
])
def test_tp2_with_the_feature_equals_tp1(name, kw):
    before = {p.pid for p in live_children()}
    assert _generate(tensor_parallel_size=2, **kw) == _generate(**kw)
    assert {p.pid for p in live_children()} <= before


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_tp2_embeddings_equal_tp1(runner):
    prompts = [[1, 2, 3, 4], [9, 8, 7], list(range(20, 40))]
    got = []
    for tp in (1, 2):
        llm = LLM("tiny-llama", dtype="float64", device="cpu", seed=0, model_runner=runner,
                  pooling_task="embed", tensor_parallel_size=tp)
        try:
            got.append([o.outputs.data for o in llm.embed(prompts, use_tqdm=False)])
        finally:
            llm.engine.shutdown()
    for a, b in zip(*got):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-12)
