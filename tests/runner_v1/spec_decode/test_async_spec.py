"""V1 async speculative decoding's bookkeeping against plain-Python models.

- A verify step's record (1 + d placeholders per row, the device's rejected counts) and
  its landing, with a later plain step in flight behind it: every request's output list
  and token table row equal the model's (its accepted run, then the later placeholder,
  which lands at its moved index); `rejected_by_row` maps the counts to the rows of a
  reshuffled batch by request identity.
- `correct_positions` against NumPy: every token of a row moves back by the row's
  rejected drafts, and its KV slot is the block table's for the moved position.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_v1.in_flight_tokens import PLACEHOLDER, InFlightTokens
from runner_v1.persistent_batch import PersistentBatch
from runner_v1.prepare_inputs import InputBuffers, prepare_inputs
from runner_v1.spec_decode.async_spec import correct_positions
from shared.contract.step import ModelRunnerOutput
from shared.runtime.async_output import (
    AsyncModelRunnerOutput,
    fill_sampled_output,
    fill_spec_sampled_output,
)
from tests.runner_v1.test_persistent_batch import make_state

R, MAX_MODEL_LEN, T, VOCAB, BLOCK = 6, 48, 64, 50, 4


def _output(tensors: dict, fill) -> AsyncModelRunnerOutput:
    out = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
    return AsyncModelRunnerOutput(out, tensors, fill, None)  # CPU: no copy stream


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), data=st.data())
def test_a_verify_record_lands_its_runs_and_moves_the_later_one(seed, data):
    rng = np.random.default_rng(seed)
    n = data.draw(st.integers(1, R - 1))
    batch = PersistentBatch(R, MAX_MODEL_LEN, T, VOCAB, BLOCK, "cpu")
    states, model = {}, {}
    for i in range(n):
        prompt = rng.integers(3, VOCAB, int(rng.integers(2, 9))).tolist()
        state = make_state(f"r{i}", prompt, block_ids=list(range(4 * i, 4 * i + 4)),
                           num_computed=len(prompt))
        states[state.req_id] = state
        model[state.req_id] = list(prompt)  # the model: each request's known tokens
        batch.add_request(state)
    rows = np.arange(n)
    # the verify step: d drafts per row, a accepted, the run is a + 1 tokens
    drafts = np.array(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
    accepted = np.array([data.draw(st.integers(0, int(d))) for d in drafts])
    runs = [rng.integers(3, VOCAB, int(a) + 1).tolist() for a in accepted]
    width = int(drafts.max()) + 1
    sampled = torch.full((n, width), -1, dtype=torch.int64)
    for i, run in enumerate(runs):
        sampled[i, : len(run)] = torch.tensor(run)
    num_sampled = torch.tensor([len(r) for r in runs], dtype=torch.int32)
    in_flight = InFlightTokens(T, torch.device("cpu"))
    verify = _output({"sampled": sampled, "num_sampled": num_sampled},
                     lambda o, h: fill_spec_sampled_output(o, h, [True] * n, 3))
    last = torch.tensor([r[-1] for r in runs])
    in_flight.record(batch, [states[f"r{i}"] for i in rows], rows, last, verify,
                     num_placeholders=1 + drafts, num_rejected=torch.from_numpy(drafts - accepted))
    # optimistic: 1 + d placeholders each, as the scheduler counts them
    for i in rows:
        assert batch.num_tokens[i] == len(model[f"r{i}"]) + 1 + drafts[i]
    # the next step's rows, reshuffled, with a stranger: moved back by request identity
    states["new"] = make_state("new", [5, 6], block_ids=[40], num_computed=0)
    order = [*reversed([f"r{i}" for i in rows]), "new"]
    expected = [int(drafts[int(r[1:])] - accepted[int(r[1:])]) if r != "new" else 0
                for r in order]
    assert in_flight.rejected_by_row(order, states).tolist() == expected
    # a later plain step samples for a subset, in flight behind the verify
    later = sorted(data.draw(st.sets(st.sampled_from(list(range(n))))))
    later_tokens = torch.from_numpy(rng.integers(3, VOCAB, n))
    plain = _output({"sampled": later_tokens},
                    lambda o, h: fill_sampled_output(o, h, [True] * n, [-1] * n))
    in_flight.record(batch, [states[f"r{i}"] for i in later], np.array(later, dtype=np.int64),
                     later_tokens, plain)
    assert in_flight.rejected_by_row(order, states) is None  # a plain step moves nothing
    in_flight.land(batch, keep_latest=True)  # the verify lands
    for i in rows:
        rid = f"r{i}"
        model[rid] += runs[i]
        expected = runs[i] + ([PLACEHOLDER] if i in later else [])
        assert states[rid].output_token_ids == expected
        known = len(model[rid]) + (1 if i in later else 0)
        assert batch.num_tokens[i] == known
        assert batch.token_ids[i, : len(model[rid])].tolist() == model[rid]
    in_flight.land(batch, keep_latest=False)  # the later step lands at its moved index
    for i in rows:
        rid = f"r{i}"
        tail = [int(later_tokens[i])] if i in later else []
        assert states[rid].output_token_ids == runs[i] + tail
        assert batch.token_ids[i, : batch.num_tokens[i]].tolist() == model[rid] + tail


def test_rejected_by_row_follows_the_requests_not_the_rows():
    batch = PersistentBatch(R, MAX_MODEL_LEN, T, VOCAB, BLOCK, "cpu")
    states = {}
    for i in range(3):
        state = make_state(f"r{i}", [4, 5, 6], block_ids=[i], num_computed=3)
        states[state.req_id] = state
        batch.add_request(state)
    in_flight = InFlightTokens(T, torch.device("cpu"))
    out = _output({"sampled": torch.zeros(3, 2, dtype=torch.int64),
                   "num_sampled": torch.ones(3, dtype=torch.int32)},
                  lambda o, h: fill_spec_sampled_output(o, h, [True] * 3, 1))
    in_flight.record(batch, list(states.values()), np.arange(3), torch.zeros(3, dtype=torch.int64),
                     out, num_placeholders=np.array([2, 2, 2]),
                     num_rejected=torch.tensor([1, 0, 1], dtype=torch.int32))
    assert in_flight.rejected_by_row(["r0", "r1", "r2"], states).tolist() == [1, 0, 1]
    # reordered, one gone, a resubmitted id (a new request under an old name) and a new one
    states["r2"] = make_state("r2", [7], block_ids=[9], num_computed=0)
    states["x"] = make_state("x", [7], block_ids=[8], num_computed=0)
    assert in_flight.rejected_by_row(["r2", "x", "r0"], states).tolist() == [0, 0, 1]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), data=st.data())
def test_correct_positions_moves_rows_back_like_numpy(seed, data):
    rng = np.random.default_rng(seed)
    n = data.draw(st.integers(1, R))
    batch = PersistentBatch(R, MAX_MODEL_LEN, T, VOCAB, BLOCK, "cpu")
    blocks = rng.permutation(200)[: n * 10].reshape(n, 10) + 1
    for i in range(n):
        computed = int(rng.integers(4, 24))
        prompt = rng.integers(3, VOCAB, computed + 4).tolist()
        batch.add_request(make_state(f"r{i}", prompt, block_ids=blocks[i].tolist(),
                                     num_computed=computed))
    num_scheduled = rng.integers(1, 5, n).astype(np.int32)
    buffers = InputBuffers(R, T, "cpu")
    inputs = prepare_inputs(batch, num_scheduled, buffers)
    before = inputs.positions[: inputs.num_tokens].clone()
    lens_before = inputs.seq_lens[:n].clone()
    rejected = np.array([data.draw(st.integers(0, 3)) for _ in range(n)], dtype=np.int32)
    req = np.repeat(np.arange(n), num_scheduled)
    batch.block_table.commit(n)
    correct_positions(inputs, torch.from_numpy(rejected), batch.block_table.block_table.gpu,
                      BLOCK, req)
    pos = before.numpy() - rejected[req]
    assert inputs.positions[: inputs.num_tokens].tolist() == pos.tolist()
    assert inputs.seq_lens[:n].tolist() == (lens_before.numpy() - rejected).tolist()
    slots = blocks[req, pos // BLOCK] * BLOCK + pos % BLOCK
    assert inputs.slot_mapping[: inputs.num_tokens].tolist() == slots.tolist()
