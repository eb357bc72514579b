"""The built-in processors (logit_bias, allowed_token_ids, bad words) end to end: V1
(PyTorch over the dense batch) and V2 (per-slot device state, Triton) give the same
tokens, token for token, alone and combined, on the churn scenarios (out-of-order
finishes and condense, chunked prefill and reordering, abort + resubmit, preemption,
penalties and min_tokens), float64 on CPU; and each built-in changes tokens there."""

from __future__ import annotations

import dataclasses

import pytest

from shared.harness.diff import DiffSetup, build_engine
from shared.harness.hf_reference import materialize_checkpoint
from shared.harness.scenario_run import run_scenario
from shared.harness.scenarios import Add, build_scenario, label_of

SEED = 0
VOCAB = 512
CHURN = ("out_of_order_finish", "abort_resubmit", "preemption", "chunked_prefill",
         "penalties_preemption", "seeded_preemption")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> DiffSetup:
    path = materialize_checkpoint("tiny-llama", SEED, str(tmp_path_factory.mktemp("tiny-llama")))
    return DiffSetup("tiny-llama", path, "float64", "cpu", SEED, ["v1", "v2"])


def _run(setup, runner, scenario):
    run = run_scenario(build_engine(setup, runner, scenario.engine_kwargs()), scenario)
    assert run.missing_events(scenario.expects) == []
    assert run.num_free_blocks == run.num_total_blocks
    return {label: rec.token_ids for label, rec in run.requests.items()}


def _builtins(kind: str, i: int, plain: list[int]) -> dict:
    """Request i's built-ins; `plain` is its tokens without them (to ban what it said)."""
    bias = {"logit_bias": {(13 * i + 5) % VOCAB: 9.0, (29 * i + 1) % VOCAB: -4.0}}
    allowed = {"allowed_token_ids": [(50 * i + j) % VOCAB for j in range(40)]}
    words = [[plain[0]]] if plain else []
    if len(plain) >= 3:
        words.append([plain[1], plain[2]])  # a two-token word, the prefix from the output
    bad = {"bad_words_token_ids": words or None}
    return {"logit_bias": bias, "allowed": allowed, "bad_words": bad,
            "combined": {**bias, **allowed, **bad}}[kind]


def _with_builtins(scenario, kind: str, plain: dict[str, list[int]]):
    actions, seen = [], {}
    for i, action in enumerate(scenario.actions):
        if isinstance(action, Add):
            seen[action.request_id] = seen.get(action.request_id, 0) + 1
            label = label_of(action.request_id, seen[action.request_id])
            params = dataclasses.replace(action.params,
                                         **_builtins(kind, i, plain.get(label, [])))
            action = Add(action.request_id, action.prompt_token_ids, params)
        actions.append(action)
    return dataclasses.replace(scenario, actions=actions)


@pytest.fixture(scope="module")
def plain_runs(setup):
    return {name: _run(setup, "v1", build_scenario(name, SEED, VOCAB)) for name in CHURN}


@pytest.mark.parametrize("kind", ["logit_bias", "allowed", "bad_words", "combined"])
@pytest.mark.parametrize("name", CHURN)
def test_v1_equals_v2_with_builtins_under_churn(setup, plain_runs, name, kind):
    scenario = _with_builtins(build_scenario(name, SEED, VOCAB), kind, plain_runs[name])
    v1 = _run(setup, "v1", scenario)
    assert v1 == _run(setup, "v2", scenario)
    assert v1 != plain_runs[name]  # the built-in changed tokens


@pytest.mark.parametrize("name", ["out_of_order_finish", "preemption"])
def test_async_scheduling_with_builtins(setup, plain_runs, name):
    scenario = _with_builtins(build_scenario(name, SEED, VOCAB), "combined", plain_runs[name])
    v1 = _run(setup, "v1", scenario)
    assert _run(setup, "v1-async", scenario) == v1
    assert _run(setup, "v2-async", scenario) == v1


def test_bad_words_never_appear(setup, plain_runs):
    """The banned words do not occur in the outputs (plain-Python check)."""
    name = "out_of_order_finish"
    scenario = _with_builtins(build_scenario(name, SEED, VOCAB), "bad_words", plain_runs[name])
    words = {label: add.params.bad_words_token_ids or []
             for label, add in scenario.labelled_adds().items()}
    for runner in ("v1", "v2"):
        for label, tokens in _run(setup, runner, scenario).items():
            for w in words[label]:
                assert not any(tokens[j:j + len(w)] == w for j in range(len(tokens))), (label, w)
