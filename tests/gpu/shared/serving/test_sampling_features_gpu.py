"""The issue-23 sampling features on the GPU (float32, TRITON attention, CUDA graphs,
V2's UVA token table): the built-ins and the example custom processors give V1's tokens
on V2 over churn scenarios, synchronous and async (GPU machine only)."""

from __future__ import annotations

import pytest

from shared.harness.diff import build_engine
from shared.harness.scenario_run import run_scenario
from shared.harness.scenarios import build_scenario
from tests.shared.serving.test_builtin_processors_engine import _with_builtins
from tests.shared.serving.test_logits_processors_engine import _examples, _with_extra_args

pytestmark = pytest.mark.gpu
SCENARIOS = ("out_of_order_finish", "chunked_prefill", "preemption")


def _tokens(setup, runner, scenario, **kw):
    run = run_scenario(build_engine(setup, runner, {**scenario.engine_kwargs(), **kw}), scenario)
    assert run.num_free_blocks == run.num_total_blocks
    return {label: rec.token_ids for label, rec in run.requests.items()}


@pytest.mark.parametrize("name", SCENARIOS)
def test_builtins_v1_equals_v2_cuda(setup, name):
    base = build_scenario(name, 0, 512)
    plain = _tokens(setup, "v1", base)
    scenario = _with_builtins(base, "combined", plain)
    v1 = _tokens(setup, "v1", scenario)
    assert v1 != plain
    for runner in ("v2", "v1-async", "v2-async"):
        assert _tokens(setup, runner, scenario) == v1, runner


@pytest.mark.parametrize("name", SCENARIOS)
def test_example_processors_v1_equals_v2_cuda(setup, name):
    scenario = _with_extra_args(build_scenario(name, 0, 512))
    v1 = _tokens(setup, "v1", scenario, logits_processors=_examples("v1"))
    assert _tokens(setup, "v2", scenario, logits_processors=_examples("v2")) == v1
    assert _tokens(setup, "v2-async", scenario, logits_processors=_examples("v2")) == v1
