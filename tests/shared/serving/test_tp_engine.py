"""Tensor parallelism end to end (issue 25): an engine on 2 gloo ranks gives the tokens,
finish reasons and logprobs (within 1e-9, float64) of the same engine on one rank, for
both runners, over the differential scenarios (preemption, abort + resubmit, chunked
prefill, prefix hits, seeded sampling, ...), on tiny Llama, Qwen3 and Mixtral.

The oracle is the one-rank engine, itself checked against transformers and against solo
runs by tests/shared/harness/test_differential.py. The assertions are written here.
Every TP engine is shut down in the test, and no worker process outlives it.
"""

from __future__ import annotations

import pytest

from shared.harness.scenarios import SCENARIOS
from tests.shared.serving.tp_scenarios import check_tp2_equals_tp1

# tiny-llama runs every scenario here; the other architectures one of each hard kind, in
# test_tp_engine_archs.py (a file per half, so that two test workers share the work)
CASES = [("tiny-llama", s) for s in SCENARIOS]


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("model, scenario_name", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_tp2_equals_tp1(model, scenario_name, runner):
    check_tp2_equals_tp1(model, scenario_name, runner)
