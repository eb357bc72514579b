"""The two-engine run of the tensor-parallel scenario tests (test_tp_engine*.py): a
scenario through one rank and through two, and the comparison of their records."""

from __future__ import annotations

from shared.harness.diff import DiffSetup, build_engine
from shared.harness.scenario_run import run_scenario
from shared.harness.scenarios import build_scenario
from tests.shared.harness.record_checks import assert_same_records
from tests.shared.serving.tp_fakes import live_children

SEED = 0
VOCAB = 512  # the tiny presets
LOGPROB_TOL = 1e-9  # float64, the same model on one rank and on two


def _children() -> set[int]:
    return {p.pid for p in live_children()}


def run_both(model_path: str, model: str, scenario_name: str, runner: str):
    scenario = build_scenario(scenario_name, SEED, VOCAB)
    setup = DiffSetup(model, model_path, "float64", "cpu", SEED, [runner, f"{runner}-tp2"])
    one = run_scenario(build_engine(setup, runner, scenario.engine_kwargs()), scenario)
    before = _children()
    engine = build_engine(setup, f"{runner}-tp2", scenario.engine_kwargs())
    try:
        assert engine.runner.worker_pids, "the TP engine runs no worker"
        two = run_scenario(engine, scenario)
        leaked = engine.num_total_kv_blocks() - engine.num_free_kv_blocks()
    finally:
        engine.shutdown()
    assert _children() <= before, "a tensor-parallel worker outlived its engine"
    return scenario, one, two, leaked


def check_tp2_equals_tp1(model: str, scenario_name: str, runner: str) -> None:
    """The scenario on two ranks: the one-rank engine's records, its hard case reached,
    and every KV block back."""
    scenario, one, two, leaked = run_both(model, model, scenario_name, runner)
    assert not two.missing_events(scenario.expects), "the scenario missed its hard case"
    assert_same_records(one.requests, two.requests, LOGPROB_TOL)
    assert leaked == 0
