"""V1's processor interface: RowStates (the examples' replay of BatchUpdates) against the
persistent batch itself over random add / remove / condense / reorder steps (hypothesis),
and the holder's argmax-invariant skip for greedy batches."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_v1.example_logits_processors import RowStates
from runner_v1.logits_processor import BatchProcessorContext, V1LogitsProcessors
from tests.runner_v1.test_persistent_batch import R, make_batch, make_state

# one step: requests to remove (by index into the live ones), how many to add, and which
# of the live requests are scheduled as decodes (query length 1) for the reorder
STEP = st.tuples(st.lists(st.integers(0, R - 1), max_size=3), st.integers(0, 3),
                 st.lists(st.booleans(), min_size=R, max_size=R))


@settings(max_examples=60, deadline=None)
@given(st.lists(STEP, min_size=1, max_size=8))
def test_row_states_follow_the_batch(steps):
    batch, states, counter = make_batch(), RowStates(), 0
    for removes, num_adds, decodes in steps:
        live = [r for r in batch.req_ids if r is not None]
        for i in removes:
            if live and i < len(live):
                batch.remove_request(live[i])
        for _ in range(min(num_adds, R - batch.num_reqs)):
            batch.add_request(make_state(f"q{counter}", [1, 2, 3]))
            counter += 1
        batch.condense()
        batch.reorder_decodes_first(
            {r: 1 if decodes[i] else 4 for i, r in enumerate(batch.req_ids)})
        batch.refresh_sampling_metadata()
        states.replay(batch.last_batch_update, lambda added: added.req_id)
        assert states.rows == {row: r for row, r in enumerate(batch.req_ids)}


class _Recorder:
    def __init__(self, invariant: bool):
        self.invariant, self.calls = invariant, 0

    def is_argmax_invariant(self) -> bool:
        return self.invariant

    def apply(self, logits):
        self.calls += 1
        return logits


def test_greedy_batches_skip_argmax_invariant_processors():
    holder = V1LogitsProcessors([], BatchProcessorContext(4, 8, torch.device("cpu")))
    invariant, changing = _Recorder(True), _Recorder(False)
    holder.processors = [invariant, changing]
    x = torch.zeros(2, 8)
    holder.apply(x, all_greedy=True)
    assert (invariant.calls, changing.calls) == (0, 1)
    holder.apply(x, all_greedy=False)
    assert (invariant.calls, changing.calls) == (1, 2)
