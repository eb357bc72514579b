"""PersistentBatch against a plain-Python model of the rows, and a field-enumeration check
that every row-indexed field moves with its request."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from runner_v1.batch_update import replay_batch_update
from runner_v1.block_table import BlockTable
from runner_v1.buffers import CpuGpuBuffer
from runner_v1.persistent_batch import ROW_FIELDS, PersistentBatch
from runner_v1.request_state import CachedRequestState
from shared.contract.sampling_params import SamplingParams

# Deliberately distinct sizes, so that only row-indexed arrays have max_num_reqs rows.
R, MAX_MODEL_LEN, MAX_TOKENS, VOCAB, BLOCK_SIZE = 6, 40, 64, 50, 4
MAX_BLOCKS = -(-MAX_MODEL_LEN // BLOCK_SIZE)


def make_batch(cls: type[PersistentBatch] = PersistentBatch) -> PersistentBatch:
    return cls(R, MAX_MODEL_LEN, MAX_TOKENS, VOCAB, BLOCK_SIZE, "cpu")


def make_state(
    req_id: str,
    prompt: list[int],
    sp: SamplingParams | None = None,
    resumed: list[int] = (),
    block_ids: list[int] | None = None,
    num_computed: int = 0,
    eos: int | None = 2,
    seed: int | None = None,
) -> CachedRequestState:
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=list(prompt) + list(resumed),
        prompt_len=len(prompt),
        sampling_params=sp or SamplingParams(seed=len(req_id)),
        eos_token_id=eos,
        block_ids=list(block_ids if block_ids is not None else [len(prompt)]),
        num_computed_tokens=num_computed,
        seed=seed,
    )


# ---- the plain-Python model ------------------------------------------------------------


def model_add(rows: list) -> int:
    """Lowest hole, else append."""
    if None in rows:
        return rows.index(None)
    rows.append(None)
    return len(rows) - 1


def model_condense(rows: list) -> tuple[list, bool]:
    """Highest occupied row into the lowest hole, until dense."""
    rows, moved = list(rows), False
    while rows and rows[-1] is None:
        rows.pop()
    while None in rows:
        rows[rows.index(None)] = rows.pop()
        moved = True
        while rows and rows[-1] is None:
            rows.pop()
    return rows, moved


def expected_row(state: CachedRequestState) -> dict:
    sp = state.sampling_params
    eos = state.eos_token_id
    return {
        "num_tokens": state.num_tokens,
        "num_prompt_tokens": state.prompt_len,
        "num_computed_tokens": state.num_computed_tokens,
        "temperature": np.float32(sp.temperature),
        "top_k": sp.top_k if 0 < sp.top_k < VOCAB else 0,
        "top_p": np.float32(sp.top_p),
        "min_p": np.float32(sp.min_p),
        "presence_penalty": np.float32(sp.presence_penalty),
        "frequency_penalty": np.float32(sp.frequency_penalty),
        "repetition_penalty": np.float32(sp.repetition_penalty),
        "seeds": state.seed,
        "min_tokens": sp.min_tokens,
        "num_logprobs": -1 if sp.logprobs is None else sp.logprobs,
        "eos_token_id": -1 if eos is None or sp.ignore_eos else eos,
    }


def expected_builtins(state: CachedRequestState) -> dict:
    """The row's built-in logits processor values, ids past the vocabulary dropped."""
    sp = state.sampling_params
    allowed = None
    if sp.allowed_token_ids is not None:
        allowed = [t for t in sp.allowed_token_ids if t < VOCAB]
    bias = {t: float(np.float32(b)) for t, b in (sp.logit_bias or {}).items() if t < VOCAB}
    words = tuple((tuple(w[:-1]), w[-1]) for w in sp.bad_words_token_ids or () if w[-1] < VOCAB)
    return {"allowed_token_ids": allowed, "logit_bias": bias or None, "bad_words": words or None}


def builtins_at_row(batch: PersistentBatch, row: int) -> dict:
    allowed, bias = batch.allowed_token_ids[row], batch.logit_bias[row]
    return {
        "allowed_token_ids": None if allowed is None else allowed.tolist(),
        "logit_bias": None if bias is None else dict(zip(bias[0].tolist(), bias[1].tolist())),
        "bad_words": batch.bad_words[row],
    }


NO_BUILTINS = {"allowed_token_ids": None, "logit_bias": None, "bad_words": None}


def expected_min_tokens_stop_ids(layout: list, states: dict) -> dict[int, list[int]]:
    result = {}
    for row, req_id in enumerate(layout):
        state = states[req_id]
        sp = state.sampling_params
        if len(state.output_token_ids) < sp.min_tokens:
            ids = list(sp.stop_token_ids)
            if state.eos_token_id is not None and not sp.ignore_eos:
                ids.append(state.eos_token_id)
            if ids:
                result[row] = ids
    return result


def check_request_at_row(batch: PersistentBatch, state: CachedRequestState, row: int) -> None:
    assert batch.req_id_to_index[state.req_id] == row
    assert batch.req_ids[row] == state.req_id
    n = state.num_tokens
    assert batch.token_ids[row, :n].tolist() == state.all_token_ids
    for name, value in expected_row(state).items():
        field = getattr(batch, name)
        array = field.np if isinstance(field, CpuGpuBuffer) else field
        assert array[row] == value, (name, row, array[row], value)
    assert batch.stop_token_ids[row] == tuple(state.sampling_params.stop_token_ids)
    assert batch.req_output_token_ids[row] is state.output_token_ids
    assert builtins_at_row(batch, row) == expected_builtins(state)
    table = batch.block_table
    nb = len(state.block_ids)
    assert table.num_blocks_per_row[row] == nb
    assert table.np[row, :nb].tolist() == state.block_ids
    assert not table.np[row, nb:].any()


# ---- the state machine ----------------------------------------------------------------

sampling_params_st = st.builds(
    SamplingParams,
    max_tokens=st.just(16),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_k=st.sampled_from([0, 5, VOCAB + 10]),
    top_p=st.sampled_from([1.0, 0.9]),
    min_p=st.sampled_from([0.0, 0.1]),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    min_tokens=st.integers(0, 3),
    stop_token_ids=st.lists(st.integers(3, VOCAB - 1), max_size=2),
    ignore_eos=st.booleans(),
    logprobs=st.sampled_from([None, 0, 3]),
    presence_penalty=st.sampled_from([0.0, 0.5]),
    frequency_penalty=st.sampled_from([0.0, -0.5]),
    repetition_penalty=st.sampled_from([1.0, 1.2]),
    # ids up to VOCAB + 2: those past the vocabulary are dropped by the batch
    allowed_token_ids=st.one_of(st.none(), st.lists(st.integers(0, VOCAB + 2), min_size=1,
                                                    max_size=4, unique=True)),
    logit_bias=st.one_of(st.none(), st.dictionaries(st.integers(0, VOCAB + 2),
                                                    st.sampled_from([-2.5, 0.1, 7.0]),
                                                    max_size=3)),
    bad_words_token_ids=st.one_of(st.none(), st.lists(
        st.lists(st.integers(0, VOCAB + 2), min_size=1, max_size=3), min_size=1, max_size=3)),
)
tokens_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10)


class PersistentBatchMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.batch = make_batch()
        self.layout: list[str | None] = []  # the model's row -> req_id
        self.live: dict[str, CachedRequestState] = {}
        self.preempted: dict[str, CachedRequestState] = {}  # resumes as a new request
        self.unscheduled: dict[str, CachedRequestState] = {}  # re-added as the same state
        self.aborted: set[str] = set()  # ids that may be resubmitted
        self.counter = 0
        self.moved_this_step = False
        self.changed_since_refresh = True
        self.replayed: list = []  # layout rebuilt from BatchUpdate records only
        self.last_metadata = None

    # -- helpers
    def _free(self, req_id: str) -> bool:
        return (
            req_id not in self.live
            and req_id not in self.preempted
            and req_id not in self.unscheduled
        )

    def _add(self, state: CachedRequestState) -> None:
        row = model_add(self.layout)
        self.layout[row] = state.req_id
        assert self.batch.add_request(state) == row
        self.live[state.req_id] = state
        self.changed_since_refresh = True

    def _can_add(self) -> bool:
        return not self.moved_this_step and len(self.live) < R

    # -- adds
    @precondition(lambda self: self._can_add())
    @rule(data=st.data(), prompt=tokens_st, resumed=st.lists(st.integers(0, VOCAB - 1), max_size=3),
          sp=sampling_params_st, eos=st.sampled_from([None, 2]))
    def add_new(self, data, prompt, resumed, sp, eos) -> None:
        reusable = sorted(r for r in self.aborted if self._free(r))
        if reusable and data.draw(st.booleans(), label="resubmit aborted id"):
            req_id = data.draw(st.sampled_from(reusable), label="req_id")
            self.aborted.discard(req_id)
        else:
            self.counter += 1
            req_id = f"r{self.counter}"
        n = len(prompt) + len(resumed)
        blocks = data.draw(st.lists(st.integers(1, 99), min_size=1, max_size=-(-n // BLOCK_SIZE)))
        computed = data.draw(st.integers(0, n - 1), label="num_computed")
        self._add(make_state(req_id, prompt, sp, resumed, blocks, computed, eos))

    @precondition(lambda self: self._can_add() and self.preempted)
    @rule(data=st.data())
    def resume_preempted(self, data) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.preempted)))
        old = self.preempted.pop(req_id)
        # Back as new: the prefill carries the generated tokens, the prompt length stays.
        state = CachedRequestState(
            req_id=req_id,
            prompt_token_ids=old.all_token_ids,
            prompt_len=old.prompt_len,
            sampling_params=old.sampling_params,
            eos_token_id=old.eos_token_id,
            block_ids=[7, 8],
            num_computed_tokens=0,
            seed=old.seed,
        )
        assert state.output_token_ids == old.output_token_ids
        self._add(state)

    @precondition(lambda self: self._can_add() and self.unscheduled)
    @rule(data=st.data())
    def readd_unscheduled(self, data) -> None:
        self._add(self.unscheduled.pop(data.draw(st.sampled_from(sorted(self.unscheduled)))))

    # -- removes
    @precondition(lambda self: not self.moved_this_step and self.live)
    @rule(data=st.data(), kind=st.sampled_from(["finish", "abort", "preempt", "unschedule"]))
    def remove(self, data, kind) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        state = self.live.pop(req_id)
        row = self.layout.index(req_id)
        self.layout[row] = None
        assert self.batch.remove_request(req_id) == row
        assert self.batch.remove_request(req_id) is None
        {"abort": lambda: self.aborted.add(req_id),
         "preempt": lambda: self.preempted.__setitem__(req_id, state),
         "unschedule": lambda: self.unscheduled.__setitem__(req_id, state),
         "finish": lambda: None}[kind]()
        self.changed_since_refresh = True

    # -- per-step edits that are not row moves
    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode(self, data) -> None:
        open_ids = sorted(r for r, s in self.live.items() if s.num_tokens < MAX_MODEL_LEN)
        chosen = data.draw(st.lists(st.sampled_from(open_ids), unique=True)) if open_ids else []
        tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(chosen),
                                    max_size=len(chosen)))
        rows = np.array([self.batch.req_id_to_index[r] for r in chosen], dtype=np.int64)
        self.batch.append_output_tokens(rows, np.array(tokens, dtype=np.int32))
        for req_id, token in zip(chosen, tokens):
            self.live[req_id].output_token_ids.append(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def append_blocks(self, data) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        state = self.live[req_id]
        room = MAX_BLOCKS - len(state.block_ids)
        new = data.draw(st.lists(st.integers(1, 99), max_size=min(room, 2)))
        self.batch.block_table.append_row(new, self.batch.req_id_to_index[req_id])
        state.block_ids.extend(new)

    # -- row moves
    @rule()
    def condense(self) -> None:
        self.layout, moved = model_condense(self.layout)
        self.batch.condense()
        assert self.batch.req_ids == self.layout
        assert None not in self.batch.req_ids and len(self.layout) == self.batch.num_reqs
        self.moved_this_step |= moved
        self.changed_since_refresh |= moved

    @precondition(lambda self: len(self.live) >= 2)
    @rule(data=st.data())
    def swap(self, data) -> None:
        a, b = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=2, max_size=2,
                                  unique=True))
        i, j = self.layout.index(a), self.layout.index(b)
        self.layout[i], self.layout[j] = b, a
        self.batch.swap_states(i, j)
        self.moved_this_step = self.changed_since_refresh = True

    @precondition(lambda self: None not in self.layout)
    @rule(data=st.data())
    def reorder(self, data) -> None:
        query_lens = {r: data.draw(st.sampled_from([1, 1, 2, 5]), label=r) for r in self.layout}
        before = list(self.layout)
        self.layout = decodes_first_by_fewest_swaps(before, query_lens)
        num_decodes = self.batch.reorder_decodes_first(query_lens)
        assert num_decodes == sum(q == 1 for q in query_lens.values())
        if self.layout != before:
            self.moved_this_step = self.changed_since_refresh = True

    @precondition(lambda self: None not in self.layout)
    @rule()
    def end_step(self) -> None:
        metadata = self.batch.refresh_sampling_metadata()
        self.replayed = replay_batch_update(self.replayed, self.batch.last_batch_update)
        assert self.replayed == self.layout
        if not self.changed_since_refresh:
            assert metadata is self.last_metadata  # unchanged batch: not rebuilt
        self.check_metadata(metadata)
        self.last_metadata = metadata
        self.moved_this_step = self.changed_since_refresh = False

    def check_metadata(self, md) -> None:
        states = [self.live[r] for r in self.layout]
        assert md.num_reqs == len(states)
        temps = [np.float32(s.sampling_params.temperature) for s in states]
        assert md.temperature.tolist() == temps
        assert md.all_greedy == all(t == 0 for t in temps)
        assert md.seeds.tolist() == [s.seed for s in states]
        top_k = [expected_row(s)["top_k"] for s in states]
        assert (md.top_k is None) == (not any(top_k))
        assert md.top_k is None or md.top_k.tolist() == top_k
        assert all(a is s.output_token_ids for a, s in zip(md.output_token_ids, states))
        assert md.num_logprobs == [expected_row(s)["num_logprobs"] for s in states]
        uses_penalties = any(s.sampling_params.uses_penalties for s in states)
        assert (md.prompt_token_ids is None) == (not uses_penalties)
        if uses_penalties:
            width = max(s.prompt_len for s in states)
            expected = [s.prompt_token_ids[: s.prompt_len] + [VOCAB] * (width - s.prompt_len)
                        for s in states]
            assert md.prompt_token_ids.tolist() == expected
        assert md.min_tokens_stop_ids == expected_min_tokens_stop_ids(self.layout, self.live)
        check_builtin_metadata(md, states)

    @invariant()
    def rows_match_model(self) -> None:
        if not hasattr(self, "batch"):
            return
        batch = self.batch
        assert batch.req_ids == self.layout
        assert batch.num_reqs == len(self.live) == len(batch.req_id_to_index)
        for row, req_id in enumerate(self.layout):
            if req_id is not None:
                check_request_at_row(batch, self.live[req_id], row)
            else:
                assert not batch.block_table.np[row].any()  # holes hold no blocks
                assert builtins_at_row(batch, row) == NO_BUILTINS  # nor built-ins
        assert not batch.block_table.np[len(self.layout):].any()
        for row in range(len(self.layout), R):
            assert builtins_at_row(batch, row) == NO_BUILTINS


def check_builtin_metadata(md, states: list[CachedRequestState]) -> None:
    """The mask, the bias entries and the bad words from each row's own request only."""
    expected = [expected_builtins(s) for s in states]
    allowed = [e["allowed_token_ids"] for e in expected]
    if all(a is None for a in allowed):
        assert md.allowed_token_mask is None
    else:
        mask = np.ones((len(states), VOCAB), dtype=bool)
        for row, ids in enumerate(allowed):
            if ids is not None:
                mask[row] = np.isin(np.arange(VOCAB), ids)
        assert md.allowed_token_mask.dtype == torch.bool
        assert md.allowed_token_mask.numpy().tolist() == mask.tolist()
    entries = {(row, t, b) for row, e in enumerate(expected)
               for t, b in (e["logit_bias"] or {}).items()}
    if not entries:
        assert md.logit_bias_index is None and md.logit_bias_values is None
    else:
        rows, cols = md.logit_bias_index.tolist()
        got = list(zip(rows, cols, md.logit_bias_values.tolist()))
        assert len(got) == len(entries) and set(got) == entries
    words = {row: e["bad_words"] for row, e in enumerate(expected) if e["bad_words"]}
    assert md.bad_words == (words or None)


TestPersistentBatchMachine = PersistentBatchMachine.TestCase
TestPersistentBatchMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---- field enumeration ------------------------------------------------------------------


def _storage_key(value) -> tuple | None:
    """Identity of one row-indexed storage (a tensor and its NumPy view share one)."""
    if isinstance(value, CpuGpuBuffer):
        value = value.cpu  # .gpu is the per-step copy destination, not row state
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == R:
        return ("mem", value.data_ptr())
    if isinstance(value, np.ndarray) and value.ndim and value.shape[0] == R:
        return ("mem", value.__array_interface__["data"][0])
    if isinstance(value, list) and len(value) == R:
        return ("list", id(value))
    return None


def discover_row_storages(batch: PersistentBatch) -> dict[tuple, tuple[str, object]]:
    """Every row-indexed array / tensor / list on the instance (block table included),
    found by introspection: first dimension == max_num_reqs."""
    found: dict[tuple, tuple[str, object]] = {}
    for owner, prefix in ((batch, ""), (batch.block_table, "block_table.")):
        for name, value in vars(owner).items():
            key = _storage_key(value)
            if key is None:
                continue
            if isinstance(value, CpuGpuBuffer):
                value = value.np
            elif isinstance(value, torch.Tensor):
                value = value.numpy()
            # A tensor and its NumPy view are one field: name it as ROW_FIELDS does.
            if key not in found or name in batch.ROW_FIELDS:
                found[key] = (prefix + name, value)
    return found


def declared_row_storages(batch: PersistentBatch) -> set[tuple]:
    keys = set()
    for name in batch.ROW_FIELDS:
        value = getattr(batch, name)
        owners = [value.block_table, value.num_blocks_per_row] if isinstance(
            value, BlockTable) else [value]
        keys.update(_storage_key(v) for v in owners)
    return keys


def undeclared_row_fields(batch: PersistentBatch) -> list[str]:
    found = discover_row_storages(batch)
    declared = declared_row_storages(batch)
    return sorted(name for key, (name, _) in found.items() if key not in declared)


def fill_batch_with_distinct_rows(batch: PersistentBatch) -> dict[str, object]:
    for r in range(R):
        batch.add_request(make_state(f"q{r}", [r] * (r + 1), SamplingParams(
            seed=r, stop_token_ids=[r + 3])))
    storages = discover_row_storages(batch)
    for name, array in storages.values():
        if name == "_req_ids":
            continue  # the row -> id map itself; already distinct
        if isinstance(array, list):
            for r in range(R):
                array[r] = ("sentinel", name, r)
        elif array.dtype == bool and array.ndim == 2:
            array[:] = (np.arange(R)[:, None] >> np.arange(array.shape[1])) & 1  # row in bits
        elif array.dtype == bool:
            array[:] = np.arange(R) >= 4  # rows 4, 5 (moved or swapped) differ from 1, 3
        elif array.ndim == 2:
            array[:] = (100 * np.arange(1, R + 1)[:, None] + np.arange(array.shape[1]))
        elif name == "block_table.num_blocks_per_row":
            array[:] = np.minimum(np.arange(1, R + 1), MAX_BLOCKS)
        else:
            array[:] = np.arange(1, R + 1)  # all counts <= MAX_MODEL_LEN
    return {name: (array, _snapshot(array)) for name, array in storages.values()}


def _snapshot(array):
    return list(array) if isinstance(array, list) else array.copy()


def _valid_width(batch: PersistentBatch, name: str, row_values: dict, row: int) -> int | None:
    """Columns of a 2-D row that are meant to move: the counted prefix."""
    if name == "block_table.block_table":
        return int(row_values["block_table.num_blocks_per_row"][row])
    count_name = batch.ROW_PREFIX_COUNTS.get(name)
    return int(row_values[count_name][row]) if count_name else None


def check_condense_moves_every_field(batch: PersistentBatch) -> None:
    before = fill_batch_with_distinct_rows(batch)
    snap = {name: snap for name, (_, snap) in before.items()}
    batch.remove_request("q1")
    batch.remove_request("q3")
    batch.condense()  # expected: row 5 -> 1, row 4 -> 3
    assert batch.req_ids == ["q0", "q5", "q2", "q4"]
    for name, (array, old) in before.items():
        for dst, src in ((0, 0), (1, 5), (2, 2), (3, 4)):
            width = _valid_width(batch, name, snap, src)
            got, want = array[dst], old[src]
            if width is not None:
                got, want = got[:width], want[:width]
            assert np.array_equal(np.asarray(got, dtype=object), np.asarray(want, dtype=object)), (
                f"{name}: row {src} was not moved to row {dst} by condense()")


def check_swap_swaps_every_field(batch: PersistentBatch) -> None:
    before = fill_batch_with_distinct_rows(batch)
    snap = {name: snap for name, (_, snap) in before.items()}
    batch.swap_states(1, 4)
    for name, (array, old) in before.items():
        for dst, src in ((1, 4), (4, 1), (0, 0)):
            width = _valid_width(batch, name, snap, src)
            got, want = array[dst], old[src]
            if width is not None:
                got, want = got[:width], want[:width]
            assert np.array_equal(np.asarray(got, dtype=object), np.asarray(want, dtype=object)), (
                f"{name}: rows 1 and 4 were not swapped")


def test_declared_row_fields_are_all_row_fields():
    batch = make_batch()
    assert undeclared_row_fields(batch) == []
    discovered = set(discover_row_storages(batch))
    assert discovered == declared_row_storages(batch)
    # The enumeration really sees the fields (not an empty set on both sides).
    assert len(discovered) == len(ROW_FIELDS) + 1  # the block table has two arrays


def test_condense_moves_every_row_field():
    check_condense_moves_every_field(make_batch())


def test_swap_states_swaps_every_row_field():
    check_swap_swaps_every_field(make_batch())


class _BatchWithUndeclaredField(PersistentBatch):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bad_words_mask = np.zeros((self.max_num_reqs, 3), dtype=bool)


class _BatchWithForgottenField(PersistentBatch):
    ROW_FIELDS = tuple(f for f in ROW_FIELDS if f != "top_p")


def test_enumeration_catches_an_undeclared_field():
    assert undeclared_row_fields(make_batch(_BatchWithUndeclaredField)) == ["bad_words_mask"]
    with pytest.raises(AssertionError, match="bad_words_mask"):
        check_condense_moves_every_field(make_batch(_BatchWithUndeclaredField))


def test_enumeration_catches_a_field_condense_forgets():
    assert undeclared_row_fields(make_batch(_BatchWithForgottenField)) == ["top_p"]
    with pytest.raises(AssertionError, match="top_p"):
        check_condense_moves_every_field(make_batch(_BatchWithForgottenField))
    with pytest.raises(AssertionError, match="top_p"):
        check_swap_swaps_every_field(make_batch(_BatchWithForgottenField))


# ---- focused cases ----------------------------------------------------------------------


def test_swap_states_does_not_duplicate_rows():
    # The trap: `t[i], t[j] = t[j], t[i]` on torch/NumPy row views copies row j twice.
    trap = torch.tensor([[1, 1], [2, 2]])
    trap[0], trap[1] = trap[1], trap[0]
    assert trap.tolist() == [[2, 2], [2, 2]]
    batch = make_batch()
    a = batch.add_request(make_state("a", [5, 6, 7], block_ids=[1]))
    b = batch.add_request(make_state("b", [8, 9], block_ids=[2, 3]))
    batch.swap_states(a, b)
    assert batch.req_ids == ["b", "a"]
    assert batch.token_ids[0, :2].tolist() == [8, 9]
    assert batch.token_ids[1, :3].tolist() == [5, 6, 7]
    assert batch.block_table.np[0, :3].tolist() == [2, 3, 0]
    assert batch.block_table.np[1, :3].tolist() == [1, 0, 0]


def test_abort_then_resubmit_same_id_is_a_new_request():
    batch = make_batch()
    old = make_state("x", [1, 2, 3], SamplingParams(temperature=0.0, seed=1), block_ids=[4])
    batch.add_request(old)
    with pytest.raises(ValueError, match="already"):
        batch.add_request(make_state("x", [9]))
    batch.remove_request("x")
    new = make_state("x", [9, 9], SamplingParams(temperature=1.0, seed=2), block_ids=[6])
    row = batch.add_request(new)
    check_request_at_row(batch, new, row)


def test_refresh_rebuilds_only_on_change_and_tracks_min_tokens_every_step():
    batch = make_batch()
    sp = SamplingParams(min_tokens=2, stop_token_ids=[7], seed=0)
    state = make_state("m", [1, 2], sp, eos=2)
    batch.add_request(state)
    md = batch.refresh_sampling_metadata()
    assert md.min_tokens_stop_ids == {0: [7, 2]}
    for token in (11, 12):
        state.output_token_ids.append(token)
        batch.append_output_tokens(np.array([0]), np.array([token]))
        again = batch.refresh_sampling_metadata()
        assert again is md and batch.last_batch_update is None
    assert md.min_tokens_stop_ids == {}
    assert batch.token_ids[0, :4].tolist() == [1, 2, 11, 12] and batch.num_tokens[0] == 4
    batch.add_request(make_state("n", [3]))
    assert batch.refresh_sampling_metadata() is not md


def test_resumed_outputs_count_as_outputs_not_prompt():
    batch = make_batch()
    sp = SamplingParams(min_tokens=3, presence_penalty=0.5, seed=0)
    state = make_state("p", [4, 5], sp, resumed=[6, 7], eos=2)
    assert state.output_token_ids == [6, 7]
    batch.add_request(state)
    md = batch.refresh_sampling_metadata()
    assert md.prompt_token_ids.tolist() == [[4, 5]]
    assert md.min_tokens_stop_ids == {0: [2]}  # 2 outputs < 3
    assert batch.num_prompt_tokens[0] == 2 and batch.num_tokens[0] == 4


def test_refresh_and_reorder_require_a_condensed_batch():
    batch = make_batch()
    batch.add_request(make_state("a", [1]))
    batch.add_request(make_state("b", [1]))
    batch.remove_request("a")
    with pytest.raises(RuntimeError, match="condense"):
        batch.refresh_sampling_metadata()
    with pytest.raises(RuntimeError, match="condense"):
        batch.reorder_decodes_first({"b": 1})


def decodes_first_by_fewest_swaps(layout: list[str], query_lens: dict[str, int]) -> list[str]:
    """The model of reorder_decodes_first (vLLM's V1 reorder): walk the front from the
    left for a non-decode and the back from the right for a decode, swap, repeat until
    the two walks meet."""
    rows = list(layout)
    front, back = 0, len(rows) - 1
    while True:
        while front < len(rows) and query_lens[rows[front]] == 1:
            front += 1
        while back >= 0 and query_lens[rows[back]] != 1:
            back -= 1
        if front >= back:
            return rows
        rows[front], rows[back] = rows[back], rows[front]


def test_reorder_puts_decodes_first_in_the_fewest_swaps():
    batch = make_batch()
    for name in "abcdef":
        batch.add_request(make_state(name, [1]))
    batch.refresh_sampling_metadata()
    lens = {"a": 3, "b": 1, "c": 4, "d": 1, "e": 1, "f": 2}
    assert batch.reorder_decodes_first(lens) == 3
    # a and c (the prefills among the first three rows) trade places with e and d
    assert batch.req_ids == ["e", "b", "d", "c", "a", "f"]
    batch.refresh_sampling_metadata()
    update = batch.last_batch_update
    assert update.removed == () and update.added == ()
    assert len(update.moved) == 2  # no fewer swaps can put b, d, e first
    assert all(m.directionality.name == "SWAP" for m in update.moved)
    assert replay_batch_update(list("abcdef"), update) == batch.req_ids
    assert batch.reorder_decodes_first(lens) == 3  # already ordered: no swaps
    batch.refresh_sampling_metadata()
    assert batch.last_batch_update is None


def test_adds_and_removes_after_a_move_are_refused_without_side_effects():
    batch = make_batch()
    for name in "abc":
        batch.add_request(make_state(name, [1]))
    batch.swap_states(0, 2)
    with pytest.raises(RuntimeError, match="moved"):
        batch.add_request(make_state("d", [1]))
    with pytest.raises(RuntimeError, match="moved"):
        batch.remove_request("a")
    assert batch.req_ids == ["c", "b", "a"] and batch.num_reqs == 3
    batch.refresh_sampling_metadata()
    batch.add_request(make_state("d", [1]))  # fine in the next step
    assert batch.req_ids == ["c", "b", "a", "d"]


def test_a_vacated_row_leaks_no_builtin():
    """vLLM V1 leaves the vacated row of its allowed-ids mask set and swaps mask rows by
    tuple assignment of views (../shared/reference/vllm-runners.md, 'Not cleared'). Here:
    A (every built-in) in the top row moves down on condense, an unconstrained C takes
    A's old row, then A and X swap."""
    batch = make_batch()
    full = SamplingParams(seed=0, allowed_token_ids=[5, 6], logit_bias={6: 2.0},
                          bad_words_token_ids=[[8, 9]])
    for name in "XYA":
        batch.add_request(make_state(name, [1], full if name == "A" else None))
    batch.refresh_sampling_metadata()
    batch.remove_request("Y")
    batch.condense()
    batch.refresh_sampling_metadata()
    assert batch.add_request(make_state("C", [1])) == 2  # A's vacated row
    md = batch.refresh_sampling_metadata()
    assert builtins_at_row(batch, 2) == NO_BUILTINS
    assert md.allowed_token_mask[2].all() and not md.allowed_token_mask[1, 7:].any()
    assert md.logit_bias_index.tolist() == [[1], [6]] and md.bad_words == {1: (((8,), 9),)}
    batch.swap_states(0, 1)
    md = batch.refresh_sampling_metadata()
    assert batch.req_ids == ["A", "X", "C"]
    assert md.allowed_token_mask.sum(dim=1).tolist() == [2, VOCAB, VOCAB]
    assert md.logit_bias_index.tolist() == [[0], [6]] and md.bad_words == {0: (((8,), 9),)}
