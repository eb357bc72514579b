"""BatchUpdateBuilder records and their replay on a plain list."""

import pytest

from runner_v1.batch_update import (
    BatchUpdateBuilder,
    MoveDirectionality,
    replay_batch_update,
)
from shared.contract.sampling_params import SamplingParams

SP = SamplingParams()
UNI, SWAP = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP


def test_nothing_recorded_gives_none():
    assert BatchUpdateBuilder().get_and_reset(3) is None


def test_refilled_hole_is_added_not_removed():
    b = BatchUpdateBuilder()
    b.removed(2)
    b.removed(0)
    out = []
    b.added(0, "x", SP, out)
    update = b.get_and_reset(3)
    assert update.removed == (2,)
    assert [(a.row, a.req_id) for a in update.added] == [(0, "x")]
    assert update.added[0].output_token_ids is out  # a live reference
    assert b.get_and_reset(3) is None  # reset


def test_added_then_removed_in_one_step_leaves_only_the_removal():
    b = BatchUpdateBuilder()
    b.added(3, "y", SP, [])
    b.removed(3)
    update = b.get_and_reset(3)
    assert update.added == () and update.removed == (3,)


def test_replay_condense_and_swap():
    b = BatchUpdateBuilder()
    b.removed(1)
    b.added(4, "e", SP, [])
    b.moved(4, 1, UNI)  # condense: the last row fills the hole
    b.moved(0, 2, SWAP)
    update = b.get_and_reset(4)
    assert replay_batch_update(["a", "b", "c", "d"], update) == ["c", "e", "a", "d"]


@pytest.mark.parametrize("late", ["removed", "added"])
def test_changes_after_a_move_are_refused(late):
    b = BatchUpdateBuilder()
    b.moved(0, 1, SWAP)
    with pytest.raises(RuntimeError, match="moved"):
        if late == "removed":
            b.removed(0)
        else:
            b.added(2, "z", SP, [])
