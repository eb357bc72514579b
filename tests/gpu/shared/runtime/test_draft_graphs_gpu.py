"""The draft model's FULL CUDA graphs on the GPU (shared/runtime/draft_graphs.py), both
runners, float32, TRITON: the same tokens as the draft's piecewise graphs
(KernelOptions.draft_full_graphs=False) and as an engine without any graphs, with the
draft's mode counters showing FULL replays, of the single-token drafts and of a uniform
catch-up (GPU machine only; tests/runner_v1/spec_decode/test_draft_full_graphs.py and its
V2 twin run the same logic on CPU with eager stand-ins)."""

from __future__ import annotations

import gc

import pytest
import torch

from policy import EngineArgs
from shared.contract.sampling_params import SamplingParams
from shared.serving.engine import LLMEngine
from tests.shared.runtime.draft_graph_run import record_full_replays

pytestmark = pytest.mark.gpu

K = 3
CONFIGS = {  # the draft "tiny-llama" is the target's own weights: its drafts are accepted
    "v1-self": ("v1", "tiny-llama", False),
    "v1-weak": ("v1", "tiny-llama-draft", False),
    "v2-self": ("v2", "tiny-llama", False),
    "v2-weak": ("v2", "tiny-llama-draft", False),
    "v1-async-weak": ("v1", "tiny-llama-draft", True),
    "v2-async-self": ("v2", "tiny-llama", True),
}
# different prompt lengths and lives: prefill steps (non-uniform catch-ups), 5 requests
# decoding together (the graphs of 8, padded), then fewer (stale rows), then one
PROMPTS = [[5 + i, 6, 7, 8, 9][: 2 + i % 4] for i in range(5)]
MAX_TOKENS = [24, 9, 40, 17, 5]


def _engine(runner: str, draft: str, async_scheduling: bool, **kw) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(
        model="tiny-llama", dtype="float32", device="cuda", seed=0, model_runner=runner,
        attention_backend="TRITON", max_model_len=128, max_num_seqs=8,
        num_gpu_blocks_override=256,  # several engines in one process
        async_scheduling=async_scheduling, enable_prefix_caching=False,
        speculative_config={"method": "draft_model", "model": draft,
                            "num_speculative_tokens": K}, **kw))


def _generate(engine: LLMEngine) -> dict[str, list[int]]:
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                           ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    return tokens


def _draft_forward(engine: LLMEngine):
    spec = engine.runner.speculator
    return spec.draft.draft_forward if engine.runner_name == "v1" else spec.proposer.draft_forward


def _run(runner, draft, async_scheduling, **kw) -> tuple[dict, dict]:
    engine = _engine(runner, draft, async_scheduling, **kw)
    try:
        return _generate(engine), dict(_draft_forward(engine).counts)
    finally:
        del engine
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("config", list(CONFIGS))
def test_full_draft_graphs_give_the_tokens_of_piecewise_and_eager_drafts(config, monkeypatch):
    runner, draft, async_scheduling = CONFIGS[config]
    replays = record_full_replays(monkeypatch)
    full_tokens, full_counts = _run(runner, draft, async_scheduling)
    piecewise_tokens, piecewise_counts = _run(
        runner, draft, async_scheduling, kernel_options={"draft_full_graphs": False})
    eager_tokens, eager_counts = _run(runner, draft, async_scheduling, enforce_eager=True)
    assert full_tokens == piecewise_tokens == eager_tokens
    assert full_counts["full"] == len(replays) > 0, full_counts
    assert any(q == 1 for q, _ in replays) and any(q > 1 for q, _ in replays), replays
    assert piecewise_counts["full"] == 0 < piecewise_counts["piecewise"], piecewise_counts
    assert eager_counts["full"] == eager_counts["piecewise"] == 0, eager_counts
