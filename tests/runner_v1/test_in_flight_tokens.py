"""V1's in-flight tokens against a plain-Python model: after a step records placeholders
and the batch is reshuffled (rows removed, condensed, reordered, new requests added),
the scattered input ids equal, token by token, what a dict from request to its
latest sampled token says; landing writes the same tokens into the token table and the
requests' output lists; a placeholder nobody sampled is an error, not a silent -1."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_v1.in_flight_tokens import PLACEHOLDER, InFlightTokens
from runner_v1.persistent_batch import PersistentBatch
from runner_v1.prepare_inputs import InputBuffers, prepare_inputs
from shared.contract.step import ModelRunnerOutput
from shared.runtime.async_output import AsyncModelRunnerOutput, fill_sampled_output
from tests.runner_v1.test_persistent_batch import make_state

R, MAX_MODEL_LEN, T, VOCAB, BLOCK_SIZE = 6, 40, 64, 50, 4


def _pending(sampled: torch.Tensor, n: int) -> AsyncModelRunnerOutput:
    out = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
    fill = lambda o, h: fill_sampled_output(o, h, [True] * n, [-1] * n)  # noqa: E731
    return AsyncModelRunnerOutput(out, {"sampled": sampled}, fill, None)


def _step_with_placeholders(num_reqs: int, seed: int):
    """A batch of `num_reqs` prefilled requests whose last step sampled one token each
    (recorded as placeholders); -> batch, states by id, in-flight record, the tokens."""
    rng = np.random.default_rng(seed)
    batch = PersistentBatch(R, MAX_MODEL_LEN, T, VOCAB, BLOCK_SIZE, "cpu")
    states = {}
    for i in range(num_reqs):
        prompt = rng.integers(3, VOCAB, int(rng.integers(2, 9))).tolist()
        state = make_state(f"r{i}", prompt, block_ids=list(range(3 * i, 3 * i + 3)),
                           num_computed=len(prompt))
        states[state.req_id] = state
        batch.add_request(state)
    sampled = torch.from_numpy(rng.integers(3, VOCAB, num_reqs))
    in_flight = InFlightTokens(T, torch.device("cpu"))
    rows = np.arange(num_reqs)
    in_flight.record(batch, [states[f"r{i}"] for i in rows], rows, sampled,
                     _pending(sampled, num_reqs))
    return batch, states, in_flight, {f"r{i}": int(sampled[i]) for i in rows}


@settings(max_examples=40, deadline=None)
@given(num_reqs=st.integers(1, R - 1), seed=st.integers(0, 2**16), data=st.data())
def test_scatter_matches_the_model_after_a_reshuffle(num_reqs, seed, data):
    batch, states, in_flight, latest = _step_with_placeholders(num_reqs, seed)
    # reshuffle: drop some requests, add a fresh one (no placeholder), condense, reorder
    gone = data.draw(st.sets(st.sampled_from(sorted(states)), max_size=num_reqs - 1))
    for req_id in gone:
        batch.remove_request(req_id)
    fresh = make_state("new", [5, 6, 7], block_ids=[40], num_computed=0)
    states["new"] = fresh
    batch.add_request(fresh)
    batch.condense()
    order = data.draw(st.permutations(range(batch.num_reqs)))
    for i, j in enumerate(order):  # an arbitrary permutation, by swaps
        if i < j:
            batch.swap_states(i, j)
    req_ids = list(batch.req_ids)
    num_scheduled = np.array([3 if r == "new" else 1 for r in req_ids], dtype=np.int32)
    buffers = InputBuffers(R, T, "cpu")
    inputs = prepare_inputs(batch, num_scheduled, buffers)
    host = buffers.input_ids.np[: inputs.num_tokens].copy()
    in_flight.scatter_into_input_ids(
        host, inputs.query_start_loc_cpu[1 : inputs.num_reqs + 1].numpy(), req_ids, states,
        inputs.input_ids)
    expected = []
    for r, n in zip(req_ids, num_scheduled):
        if r == "new":
            expected += [5, 6, 7]
        else:
            expected.append(latest[r])  # its one scheduled token is the placeholder
    assert inputs.input_ids[: inputs.num_tokens].tolist() == expected
    assert (host == PLACEHOLDER).sum() == len(req_ids) - 1


def test_land_writes_tokens_where_the_placeholders_were():
    batch, states, in_flight, latest = _step_with_placeholders(4, 7)
    batch.remove_request("r1")  # scheduled out: only its own output list gets the token
    batch.condense()
    in_flight.land(batch, keep_latest=True)
    assert in_flight and all(s.output_token_ids == [PLACEHOLDER] for s in states.values())
    in_flight.land(batch, keep_latest=False)
    assert not in_flight
    for req_id, state in states.items():
        assert state.output_token_ids == [latest[req_id]]
        row = batch.req_id_to_index.get(req_id)
        if row is not None:
            n = batch.num_tokens[row]
            assert batch.token_ids[row, :n].tolist() == state.all_token_ids


def test_a_placeholder_nobody_sampled_is_an_error():
    batch, states, in_flight, _ = _step_with_placeholders(2, 3)
    in_flight.clear()  # the record is gone (a bug), the placeholders are not
    buffers = InputBuffers(R, T, "cpu")
    inputs = prepare_inputs(batch, np.ones(2, dtype=np.int32), buffers)
    with pytest.raises(RuntimeError, match="did not sample"):
        in_flight.scatter_into_input_ids(
            buffers.input_ids.np[:2], np.array([1, 2]), list(batch.req_ids), states,
            inputs.input_ids)
