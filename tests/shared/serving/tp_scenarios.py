"""The two-engine run of the tensor-parallel scenario tests (test_tp_engine*.py): a
scenario through one rank and through two, and the comparison of their records."""

from __future__ import annotations

from shared.harness.diff import DiffSetup, build_engine
from shared.harness.scenario_run import RequestRecord, run_scenario
from shared.harness.scenarios import build_scenario
from tests.shared.serving.tp_fakes import live_children

SEED = 0
VOCAB = 512  # the tiny presets
LOGPROB_TOL = 1e-9


def assert_same_records(a: dict[str, RequestRecord], b: dict[str, RequestRecord]) -> None:
    assert a.keys() == b.keys()
    for label in a:
        ra, rb = a[label], b[label]
        assert ra.token_ids == rb.token_ids, label
        assert ra.finish_reason == rb.finish_reason, label
        assert (ra.logprobs is None) == (rb.logprobs is None), label
        for pos, (da, db) in enumerate(zip(ra.logprobs or [], rb.logprobs or [])):
            assert da.keys() == db.keys(), (label, pos)
            for token in da:
                assert abs(da[token] - db[token]) <= LOGPROB_TOL, (label, pos, token)


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
