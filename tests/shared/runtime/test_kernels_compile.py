"""Every Triton launch of the differential scenarios (V1, V2, V2 async, the TRITON
attention backend, batch-invariant mode, speculative decoding) compiles for an sm_90 GPU:
recorded under the interpreter, compiled on the CPU (tests/kernel_compile.py says why the
interpreter alone is not enough)."""

from __future__ import annotations

import pytest

from shared.harness.diff import DiffSetup, build_engine
from shared.harness.hf_reference import materialize_checkpoint
from shared.harness.scenario_run import run_scenario
from shared.harness.scenarios import SCENARIOS, build_scenario
from shared.runtime.triton_utils import INTERPRET
from tests.kernel_compile import LaunchRecorder, compile_for_sm90
from tests.shared.serving.test_spec_decode_engine import spec_compatible

SEED, VOCAB = 0, 512


@pytest.mark.skipif(not INTERPRET, reason="records interpreted launches; on a GPU every "
                    "launch compiles for real (tests/gpu)")
def test_every_recorded_launch_compiles_for_sm90(tmp_path) -> None:
    model = materialize_checkpoint("tiny-llama", SEED, str(tmp_path / "tiny-llama"))
    setup = DiffSetup("tiny-llama", model, "float32", "cpu", SEED, ["v1", "v2"])
    with LaunchRecorder() as recorder:
        for name in SCENARIOS:
            scenario = build_scenario(name, SEED, VOCAB)
            for runner in ("v1", "v2", "v2-async"):
                run_scenario(build_engine(setup, runner, scenario.engine_kwargs()), scenario)
        # the TRITON attention backend's kernels (prefill chunks, prefix hits, decode), and
        # the batch-invariant mode's kernels (matmul, norms) with it
        for name, extra in (("chunked_prefill", {}), ("prefix_cache", {}),
                            ("greedy_logprobs", {"batch_invariant": True})):
            scenario = build_scenario(name, SEED, VOCAB)
            for runner in ("v1", "v2"):
                kwargs = {**scenario.engine_kwargs(), "attention_backend": "TRITON", **extra}
                run_scenario(build_engine(setup, runner, kwargs), scenario)
        scenario = spec_compatible(build_scenario("seeded_sampling", SEED, VOCAB))
        for runner in ("v1", "v2-async"):
            for method in ("standard", "synthetic"):
                spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 2,
                        "rejection_sample_method": method}
                if method == "synthetic":
                    spec["synthetic_acceptance_rates"] = [0.8, 0.5]
                engine = build_engine(setup, runner, {**scenario.engine_kwargs(),
                                                      "speculative_config": spec})
                run_scenario(engine, scenario)
    kernels = {e["kernel"] for e in recorder.launches.values()}
    assert len(kernels) >= 20, sorted(kernels)  # the run reached the kernels it should
    failures = compile_for_sm90(list(recorder.launches.values()), tmp_path)
    assert not failures, "\n".join(failures)
    assert not recorder.unrecorded, sorted(recorder.unrecorded)
