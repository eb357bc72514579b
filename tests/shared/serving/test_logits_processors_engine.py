"""Custom logits processors end to end: the V1-interface examples on V1 and their
V2-interface twins on V2 give the same tokens, token for token, on the churn scenarios
(out-of-order finishes and condense, reordering swaps under chunked prefill, abort +
resubmit, preemption), float64 on CPU; a V1 processor that ignores moves breaks it."""

from __future__ import annotations

import dataclasses

import pytest

from runner_v1.batch_update import BatchUpdate, MoveDirectionality
from runner_v1.example_logits_processors import TargetTokenBoost
from shared.harness.diff import DiffSetup, build_engine
from shared.harness.hf_reference import materialize_checkpoint
from shared.harness.scenario_run import run_scenario
from shared.harness.scenarios import Add, build_scenario

SEED = 0
VOCAB = 512
CHURN = ("out_of_order_finish", "abort_resubmit", "preemption", "chunked_prefill",
         "seeded_preemption")
EXAMPLES = ("TargetTokenBoost", "NoRepeatNGram")


class IgnoresMoves(TargetTokenBoost):
    """Deliberately broken: replays adds and removes, drops every move."""

    moves_seen: list[MoveDirectionality] = []  # what it was told, for the test

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            IgnoresMoves.moves_seen.extend(m.directionality for m in batch_update.moved)
            batch_update = dataclasses.replace(batch_update, moved=())
        super().update_state(batch_update)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> DiffSetup:
    path = materialize_checkpoint("tiny-llama", SEED, str(tmp_path_factory.mktemp("tiny-llama")))
    return DiffSetup("tiny-llama", path, "float64", "cpu", SEED, ["v1", "v2"])


def _with_extra_args(scenario):
    """Every request boosts its own token (so a row mix-up changes tokens) and every
    other one bans repeated bigrams."""
    actions = []
    for i, action in enumerate(scenario.actions):
        if isinstance(action, Add):
            extra = {"boost_token_ids": [(37 * i + 11) % VOCAB], "boost": 6.0}
            if i % 2 == 0:
                extra["no_repeat_ngram_size"] = 2
            action = Add(action.request_id, action.prompt_token_ids,
                         dataclasses.replace(action.params, extra_args=extra))
        actions.append(action)
    return dataclasses.replace(scenario, actions=actions)


def _tokens(setup, runner, scenario, processors):
    engine = build_engine(setup, runner, {**scenario.engine_kwargs(),
                                          "logits_processors": processors})
    run = run_scenario(engine, scenario)
    assert run.missing_events(scenario.expects) == []
    assert run.num_free_blocks == run.num_total_blocks
    return {label: rec.token_ids for label, rec in run.requests.items()}


def _examples(runner):
    return [f"runner_{runner}.example_logits_processors:{name}" for name in EXAMPLES]


@pytest.mark.parametrize("name", CHURN)
def test_v1_interface_on_v1_equals_v2_interface_on_v2(setup, name):
    scenario = _with_extra_args(build_scenario(name, SEED, VOCAB))
    v1 = _tokens(setup, "v1", scenario, _examples("v1"))
    v2 = _tokens(setup, "v2", scenario, _examples("v2"))
    assert v1 == v2
    assert v1 != _tokens(setup, "v1", scenario, [])  # the processors changed tokens


def test_a_processor_that_ignores_moves_breaks_the_equality(setup):
    IgnoresMoves.moves_seen.clear()
    name = f"{__name__}:IgnoresMoves"
    mismatched = []
    for scenario_name in ("out_of_order_finish", "chunked_prefill"):
        scenario = _with_extra_args(build_scenario(scenario_name, SEED, VOCAB))
        v2 = _tokens(setup, "v2", scenario,
                     ["runner_v2.example_logits_processors:TargetTokenBoost"])
        try:
            broken = _tokens(setup, "v1", scenario, [name])
        except IndexError:  # its stale state named a row past the batch
            broken = None
        mismatched.append(broken != v2)
    # condense moved rows one way and reordering swapped them, and both mattered
    assert set(IgnoresMoves.moves_seen) == {MoveDirectionality.UNIDIRECTIONAL,
                                            MoveDirectionality.SWAP}
    assert all(mismatched)
