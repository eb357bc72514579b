"""SamplingParams.n > 1 (both runners, float64 on CPU): sample i equals the same request
run alone with derive_sample_seed(seed, i); the samples share the prompt's KV blocks
through the prefix cache; one RequestOutput per parent; abort by the parent's id."""

from __future__ import annotations

import pytest

from policy import EngineArgs
from shared.contract.sampling_params import SamplingParams, derive_sample_seed
from shared.serving.engine import EngineInputError, LLMEngine

PROMPT = [(7 * j + 3) % 500 + 1 for j in range(13)]  # 3 full blocks of 4, and 1 token
ENGINE = dict(model="tiny-llama", dtype="float64", device="cpu", seed=0, max_model_len=64,
              block_size=4, num_gpu_blocks_override=64, enable_prefix_caching=True)
N = 3


def _engine(runner: str) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model_runner=runner, **ENGINE))


def _drain(engine: LLMEngine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    return outs


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_each_sample_is_the_request_alone_with_its_derived_seed(runner):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=N, ignore_eos=True,
                            logprobs=0)
    engine = _engine(runner)
    engine.add_request("p", PROMPT, params)
    (out,) = _drain(engine).values()
    assert out.request_id == "p" and out.finished
    assert [c.index for c in out.outputs] == list(range(N))
    samples = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in samples}) > 1  # the samples differ
    for i, completion in enumerate(out.outputs):
        alone = _engine(runner)
        alone.add_request("x", PROMPT, SamplingParams(
            max_tokens=6, temperature=1.0, seed=derive_sample_seed(5, i), ignore_eos=True,
            logprobs=0))
        (ref,) = _drain(alone).values()
        assert completion.token_ids == ref.outputs[0].token_ids, i
        assert completion.cumulative_logprob == pytest.approx(
            sum(next(iter(d.values())).logprob for d in ref.outputs[0].logprobs), abs=1e-12)
    assert derive_sample_seed(5, 0) == 5  # sample 0 is the request itself


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_samples_share_the_prompt_blocks(runner):
    engine = _engine(runner)
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=3, n=N, seed=1))
    engine.step()
    blocks = [engine.scheduler.requests[f"{i}_p"].block_ids for i in range(N)]
    full = len(PROMPT) // 4
    assert all(b[:full] == blocks[0][:full] for b in blocks)  # the full blocks: shared
    assert len({x for b in blocks for x in b}) == full + N  # plus one own block each
    assert engine.num_total_kv_blocks() - engine.num_free_kv_blocks() == full + N


def test_streaming_outputs_and_abort_by_parent_id():
    engine = _engine("v2")
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=20, n=N, seed=1, ignore_eos=True))
    with pytest.raises(EngineInputError, match="already in use"):
        engine.add_request("p", PROMPT, SamplingParams())
    with pytest.raises(EngineInputError, match="already in use"):
        engine.add_request("1_p", PROMPT, SamplingParams())  # a sample's own id
    (out,) = engine.step()
    assert out.request_id == "p" and not out.finished and len(out.outputs) == N
    engine.abort_request("p")
    outs = _drain(engine)
    assert outs["p"].finished
    assert [c.finish_reason for c in outs["p"].outputs] == ["abort"] * N
    assert engine.num_free_kv_blocks() == engine.num_total_kv_blocks()
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=2))  # the id is free again
    assert _drain(engine)["p"].outputs[0].finish_reason == "length"
