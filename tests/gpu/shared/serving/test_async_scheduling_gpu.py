"""Async scheduling on the GPU: V1 and V2 with async_scheduling (step N+1 launched before
step N's tokens are read back; TRITON attention, CUDA graphs, V1's device-side scatter
of the previous tokens, V2's UVA token table) against V1 with the synchronous engine,
float32, every scenario of the library (GPU machine only)."""

from __future__ import annotations

import pytest

from shared.harness.diff import build_engine
from shared.harness.scenario_run import run_scenario
from shared.harness.scenarios import SCENARIOS, build_scenario
from tests.shared.serving.test_async_scheduling import assert_async_matches_sync

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_async_equals_sync_v1_float32_cuda(setup, name, runner):
    scenario = build_scenario(name, 0, 512)
    sync = run_scenario(build_engine(setup, "v1", scenario.engine_kwargs()), scenario)
    engine = build_engine(setup, runner, {**scenario.engine_kwargs(), "async_scheduling": True})
    run = run_scenario(engine, scenario)
    assert_async_matches_sync(sync, run, 1e-4)
    assert run.num_free_blocks == run.num_total_blocks
