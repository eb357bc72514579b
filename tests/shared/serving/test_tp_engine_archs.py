"""Tensor parallelism end to end on tiny Qwen3 and Mixtral (one scenario of each hard kind,
both runners) and through a sharded safetensors checkpoint: the other half of
test_tp_engine.py, whose helpers and oracle (the one-rank engine) it shares."""

from __future__ import annotations

import pytest

from shared.harness.hf_reference import materialize_checkpoint
from tests.shared.harness.record_checks import assert_same_records
from tests.shared.serving.tp_scenarios import LOGPROB_TOL, SEED, check_tp2_equals_tp1, run_both

HARD_CASES = ("seeded_preemption", "chunked_prefill", "prefix_cache")
CASES = [(m, s) for m in ("tiny-qwen3", "tiny-mixtral") for s in HARD_CASES]


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("model, scenario_name", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_tp2_equals_tp1(model, scenario_name, runner):
    check_tp2_equals_tp1(model, scenario_name, runner)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_tp2_loads_a_sharded_safetensors_checkpoint(runner, tmp_path):
    # the same through weights read from disk and sharded at load (not the dummy init)
    path = materialize_checkpoint("tiny-llama", SEED, str(tmp_path / "tiny-llama"))
    _, one, two, _ = run_both(path, "tiny-llama", "greedy_logprobs", runner)
    assert_same_records(one.requests, two.requests, LOGPROB_TOL)
