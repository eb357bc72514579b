"""FULL graphs of uniform speculative verifies (1 + k tokens per request), both runners,
on CPU: the graphs a CUDA machine captures for a spec-decode configuration, recorded with
the eager stand-in (tests/shared/runtime/eager_graphs.py), give the tokens of the eager
spec engine, and a batch where every request carries k drafts runs the verify graph of
its padded request count. (The GPU test tests/gpu/shared/serving/test_spec_decode_gpu.py
replays real graphs.)"""

from __future__ import annotations

import pytest

from policy import EngineArgs
from policy import config as config_module
from shared.contract.sampling_params import SamplingParams
from shared.serving.engine import LLMEngine
from tests.policy.test_features import _install_graphs
from tests.shared.runtime.eager_graphs import use_eager_graphs

K = 2
# TRITON (interpreted): the backend that runs inside FULL graphs; the target's own
# checkpoint as the draft, so every draft is accepted and the verifies stay uniform
SPEC = {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": K}
RUN = dict(model="tiny-llama", dtype="float32", attention_backend="TRITON", seed=0,
           max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
           num_gpu_blocks_override=64, enable_prefix_caching=False, speculative_config=SPEC)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]


def _generate(engine) -> tuple[dict, list]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=9, temperature=0.0,
                                                           ignore_eos=True))
    tokens, steps = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        s = engine.runner.step_stats
        steps.append((s.cudagraph_mode, s.num_reqs, s.num_tokens))
    return tokens, steps


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_uniform_verifies_replay_the_verify_graphs(runner, monkeypatch):
    eager, _ = _generate(LLMEngine.from_engine_args(EngineArgs(device="cpu", model_runner=runner,
                                                               **RUN)))
    with monkeypatch.context() as m:  # the configuration a CUDA machine gets
        m.setattr(config_module, "cuda_available", lambda: True)
        cuda_config = EngineArgs(device="cuda", model_runner=runner,
                                 cudagraph_mode="FULL_AND_PIECEWISE", **RUN).create_engine_config()
    engine = LLMEngine.from_engine_args(EngineArgs(device="cpu", model_runner=runner, **RUN))
    use_eager_graphs(monkeypatch, _install_graphs(engine, cuda_config))
    engine.runner.capture_model()
    tokens, steps = _generate(engine)
    assert tokens == eager
    # three requests with two drafts each: the verify graph of 4 requests (padded)
    assert ("FULL", 3, 3 * (1 + K)) in steps, steps
