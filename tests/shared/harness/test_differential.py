"""Differential tests (DESIGN.md §9): every scenario of shared/harness/scenarios.py through
V1 and V2 on the same materialised tiny-llama checkpoint (float64, CPU).

Oracles, each independent of the runners under test:
- the other runner: identical token ids and finish reasons, logprob dicts with the same
  ids and values within 1e-9;
- Hugging Face transformers greedy search on the same safetensors (greedy scenarios);
- the same request alone in a roomy engine (solo), seeded sampling included: the noise
  is a function of (seed, position, vocab id), never of the batch.
Plus: each scenario really exercised its hard case (preemption happened, a prefix was
hit, a zero-token step carried finishes, ...), and every KV block is free at the end.

The assertions are written here, not taken from shared/harness/compare.py, so a bug in the
harness's comparison cannot hide a runner bug.
"""

from __future__ import annotations

import pytest

from shared.harness.diff import DiffSetup, build_engine, run_hf
from shared.harness.hf_reference import HFGreedy, hf_comparable, materialize_checkpoint
from shared.harness.scenario_run import ScenarioRun, run_scenario, run_solo
from shared.harness.scenarios import SCENARIOS, Scenario, build_scenario
from tests.shared.harness.record_checks import assert_same_records

SEED = 0
VOCAB = 512  # the tiny presets
LOGPROB_TOL = 1e-9  # float64, the same model and attention backend in both runners
HF_LOGPROB_TOL = 1e-5  # transformers keeps RMSNorm / RoPE in float32 in a float64 model

GREEDY = [n for n in SCENARIOS if build_scenario(n, SEED, VOCAB).greedy]
WITH_SOLO = [n for n in SCENARIOS if build_scenario(n, SEED, VOCAB).solo]


def _setup(model_dir: str) -> DiffSetup:
    return DiffSetup("tiny-llama", model_dir, "float64", "cpu", SEED, ["v1", "v2"])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return materialize_checkpoint("tiny-llama", SEED, str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def runs(llama_dir):
    """name -> {"v1"|"v2"|"solo": ScenarioRun}, each scenario run once, lazily."""
    cache: dict[str, tuple[Scenario, dict[str, ScenarioRun]]] = {}

    def get(name: str) -> tuple[Scenario, dict[str, ScenarioRun]]:
        if name not in cache:
            scenario = build_scenario(name, SEED, VOCAB)
            setup = _setup(llama_dir)
            out = {r: run_scenario(build_engine(setup, r, scenario.engine_kwargs()), scenario)
                   for r in ("v1", "v2")}
            if scenario.solo:
                engine = build_engine(setup, "v1", scenario.solo_engine_kwargs())
                out["solo"] = run_solo(engine, scenario)
            cache[name] = (scenario, out)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def hf_llama(llama_dir) -> HFGreedy:
    return HFGreedy(llama_dir, "float64", "cpu")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_v1_and_v2_agree(runs, name):
    scenario, out = runs(name)
    assert_same_records(out["v1"].requests, out["v2"].requests, LOGPROB_TOL)
    # every submission produced a record, and requests that asked for logprobs got one
    # dict per token
    adds = scenario.labelled_adds()
    assert out["v1"].requests.keys() == adds.keys()
    for label, add in adds.items():
        rec = out["v1"].requests[label]
        assert rec.finish_reason is not None, label
        if add.params.logprobs is not None:
            assert rec.logprobs is not None and len(rec.logprobs) == len(rec.token_ids)
            assert all(len(d) >= 1 for d in rec.logprobs)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_exercises_its_hard_case(runs, name):
    scenario, out = runs(name)
    for runner in ("v1", "v2"):
        assert out[runner].missing_events(scenario.expects) == [], runner


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_all_kv_blocks_free_at_the_end(runs, name):
    _, out = runs(name)
    for engine, run in out.items():
        assert run.num_free_blocks == run.num_total_blocks, engine


@pytest.mark.parametrize("name", WITH_SOLO)
def test_batch_tokens_equal_solo_run(runs, name):
    scenario, out = runs(name)
    solo = out["solo"].requests
    for label, rec in out["v1"].requests.items():
        ref = solo[label]
        if rec.finish_reason == "abort":  # the solo run went on: compare the prefix
            assert ref.token_ids[: len(rec.token_ids)] == rec.token_ids, label
            continue
        assert ref.token_ids == rec.token_ids and ref.finish_reason == rec.finish_reason, label
        for da, db in zip(rec.logprobs or [], ref.logprobs or []):
            assert da.keys() == db.keys()
            assert max(abs(da[t] - db[t]) for t in da) <= LOGPROB_TOL, label


@pytest.mark.parametrize("name", GREEDY)
def test_greedy_scenario_equals_transformers(runs, hf_llama, name):
    scenario, out = runs(name)
    hf = run_hf(hf_llama, scenario, out["v1"])
    expected = [
        label for label, add in scenario.labelled_adds().items()
        if hf_comparable(add.params) and out["v1"].requests[label].token_ids
    ]
    assert sorted(hf.requests) == sorted(expected) and expected
    for label in expected:
        hf_tokens = hf.requests[label].token_ids
        for runner in ("v1", "v2"):
            rec = out[runner].requests[label]
            assert rec.token_ids == hf_tokens, (runner, label)
            for pos, d in enumerate(rec.logprobs or []):
                (hf_lp,) = hf.requests[label].logprobs[pos].values()
                assert abs(d[hf_tokens[pos]] - hf_lp) <= HF_LOGPROB_TOL, (runner, label, pos)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-mixtral", "tiny-qwen2-moe"])
def test_other_architectures_greedy_equal_transformers(tmp_path, preset):
    model_dir = materialize_checkpoint(preset, SEED, str(tmp_path / preset))
    scenario = build_scenario("greedy_logprobs", SEED, VOCAB)
    setup = _setup(model_dir)
    out = {r: run_scenario(build_engine(setup, r, scenario.engine_kwargs()), scenario)
           for r in ("v1", "v2")}
    assert_same_records(out["v1"].requests, out["v2"].requests, LOGPROB_TOL)
    hf = run_hf(HFGreedy(model_dir, "float64", "cpu"), scenario, out["v1"])
    assert hf.requests.keys() == out["v1"].requests.keys()
    for label, ref in hf.requests.items():
        assert out["v1"].requests[label].token_ids == ref.token_ids, label
