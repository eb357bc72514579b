"""Speculative decoding on the GPU: both runners with CUDA graphs (FULL graphs of uniform
verifies, piecewise graphs of the draft model, TRITON attention) against the plain V1
engine, greedy, float32, over the spec-decode scenarios of the CPU tests; and V1 == V2
seeded (GPU machine only)."""

from __future__ import annotations

import pytest

from shared.harness.diff import build_engine
from shared.harness.scenario_run import run_scenario
from tests.shared.serving.test_spec_decode_engine import assert_same_as_plain, scenario_named

pytestmark = pytest.mark.gpu

CONFIGS = {
    "v1-ngram-k3": ("v1", {"method": "ngram", "num_speculative_tokens": 3,
                           "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    "v1-self-k3": ("v1", {"method": "draft_model", "model": "SELF", "num_speculative_tokens": 3}),
    "v2-self-k3": ("v2", {"method": "draft_model", "model": "SELF", "num_speculative_tokens": 3}),
    "v1-async-weak-k2": ("v1-async", {"method": "draft_model", "model": "tiny-llama-draft",
                                      "num_speculative_tokens": 2}),
    "v2-async-weak-k2": ("v2-async", {"method": "draft_model", "model": "tiny-llama-draft",
                                      "num_speculative_tokens": 2}),
}


# the hard cases for graphs and drafts (the CPU tests run the whole library)
GREEDY = ["out_of_order_finish", "abort_resubmit", "chunked_prefill", "prefix_cache",
          "padded_batch", "spec_preemption", "repetitive"]


@pytest.fixture(scope="module")
def plain_runs(setup) -> dict:
    return {name: run_scenario(build_engine(setup, "v1", scenario_named(name).engine_kwargs()),
                               scenario_named(name)) for name in GREEDY}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", GREEDY)
def test_spec_decode_with_graphs_equals_plain(setup, llama_dir, plain_runs, config, name):
    runner, spec = CONFIGS[config]
    if spec.get("model") == "SELF":
        spec = {**spec, "model": llama_dir}
    scenario = scenario_named(name)
    engine = build_engine(setup, runner, {**scenario.engine_kwargs(), "speculative_config": spec,
                                          "attention_backend": "TRITON"})
    modes = []
    step = engine.step

    def recording_step():
        out = step()
        modes.append(engine.runner.step_stats.cudagraph_mode)
        return out

    engine.step = recording_step
    run = run_scenario(engine, scenario)
    assert_same_as_plain(plain_runs[name], run)
    assert "FULL" in modes or "PIECEWISE" in modes  # graphs really ran


def test_full_graphs_of_uniform_verifies_are_replayed(setup, llama_dir):
    """A batch where every request carries k drafts runs the FULL verify graph."""
    from shared.contract.sampling_params import SamplingParams

    for runner in ("v1", "v2"):
        engine = build_engine(setup, runner, {
            "speculative_config": {"method": "draft_model", "model": llama_dir,
                                   "num_speculative_tokens": 3},
            "attention_backend": "TRITON", "max_model_len": 128,
            "num_gpu_blocks_override": 256})  # two engines in one process
        for i in range(3):
            engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], SamplingParams(
                max_tokens=40, temperature=0.0, ignore_eos=True))
        modes = []
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.runner.step_stats
            modes.append((stats.cudagraph_mode, stats.num_tokens, stats.num_reqs))
        assert ("FULL", 12, 3) in modes, (runner, modes)
