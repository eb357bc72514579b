"""RequestState + BlockTables under random add / finish / abort(+resubmit) / preempt /
resume / step sequences, against a plain-Python model of what every live row holds."""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runner_v2.block_tables import BlockTables
from runner_v2.post_update import post_update
from runner_v2.states import RequestState

R, MAX_LEN, T, V, BS = 4, 24, 64, 100, 4
W = MAX_LEN // BS


@dataclass
class Req:
    prompt: list[int]
    outputs: list[int] = field(default_factory=list)  # every output, across preemptions
    prefill: list[int] = field(default_factory=list)  # what the current row was given
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    row: int = -1
    sampled_since_add: list[int] = field(default_factory=list)


class StateMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = RequestState(R, MAX_LEN, T, V, "cpu")
        self.bt = BlockTables(R, W, T, BS, "cpu")
        self.live: dict[str, Req] = {}
        self.preempted: dict[str, Req] = {}
        self.free = list(range(R))  # the model's LIFO free list
        self.next_id = 0
        self.finished_ids: list[str] = []

    # ---- helpers -------------------------------------------------------------------

    def _admit(self, req_id: str, req: Req, data) -> None:
        req.prefill = req.prompt + req.outputs
        req.num_computed = data.draw(st.integers(0, len(req.prefill) - 1), label="hit")
        req.blocks = data.draw(st.lists(st.integers(0, 999), min_size=1, max_size=W))
        req.sampled_since_add = []
        req.row = self.free.pop()
        row = self.state.add_request(req_id, len(req.prompt), req.prefill, req.num_computed)
        assert row == req.row
        self.bt.append_block_ids(row, req.blocks, overwrite=True)
        self.live[req_id] = req

    def _new_req(self, data) -> Req:
        n = data.draw(st.integers(1, MAX_LEN // 2), label="prompt_len")
        return Req(prompt=data.draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n)))

    def _remove(self, req_id: str) -> Req:
        req = self.live.pop(req_id)
        assert self.state.remove_request(req_id) == req.row
        self.free.append(req.row)
        return req

    # ---- rules ---------------------------------------------------------------------

    @precondition(lambda self: len(self.free) > 0)
    @rule(data=st.data())
    def add(self, data):
        reuse = self.finished_ids and data.draw(st.booleans(), label="reuse id")
        req_id = self.finished_ids.pop() if reuse else f"r{self.next_id}"
        self.next_id += 1
        self._admit(req_id, self._new_req(data), data)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        self._remove(req_id)
        self.finished_ids.append(req_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort_then_resubmit(self, data):
        # Same id, same step, two distinct requests: nothing of the first may leak.
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        self._remove(req_id)
        self._admit(req_id, self._new_req(data), data)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        self.preempted[req_id] = self._remove(req_id)

    @precondition(lambda self: self.preempted and self.free)
    @rule(data=st.data())
    def resume(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.preempted)))
        req = self.preempted.pop(req_id)
        if len(req.prompt) + len(req.outputs) > MAX_LEN - 1:
            return  # would be finished by max_model_len, not resumed
        self._admit(req_id, req, data)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data):
        self.state.apply_staged_writes()
        self.bt.apply_staged_writes()
        ids = [r for r in sorted(self.live) if len(self.live[r].prefill)
               + len(self.live[r].sampled_since_add) < MAX_LEN]  # fmt: skip
        ids = data.draw(st.lists(st.sampled_from(ids), unique=True)) if ids else []
        if not ids:
            return
        q = []
        for r in ids:
            req = self.live[r]
            left = len(req.prefill) - req.num_computed
            q.append(data.draw(st.integers(1, left)) if left > 0 else 1)
        idx = np.array([self.live[r].row for r in ids], dtype=np.int32)
        q = np.array(q, dtype=np.int32)
        qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(q)]).astype(np.int32))
        seq_lens = np.array([self.live[r].num_computed for r in ids], dtype=np.int32) + q
        idx_t = torch.from_numpy(idx)
        toks = data.draw(st.lists(st.integers(0, V - 1), min_size=len(ids), max_size=len(ids)))
        post_update(idx_t, len(ids), torch.tensor(toks, dtype=torch.int64),
                    torch.from_numpy(seq_lens), qsl, self.state)  # fmt: skip
        for b, r in enumerate(ids):
            req = self.live[r]
            req.num_computed += int(q[b])
            self.state.num_computed_tokens_np[req.row] = req.num_computed  # as the runner
            if req.num_computed >= len(req.prefill):
                req.outputs.append(toks[b])
                req.sampled_since_add.append(toks[b])
            if len(req.blocks) < W and data.draw(st.booleans(), label="new block"):
                new = data.draw(
                    st.lists(st.integers(0, 999), min_size=1, max_size=W - len(req.blocks))
                )
                self.bt.append_block_ids(req.row, new, overwrite=False)
                req.blocks += new

    # ---- checks --------------------------------------------------------------------

    @invariant()
    def host_bookkeeping(self):
        s = self.state
        assert s.free_indices == self.free  # exact LIFO order
        assert s.req_id_to_index == {r: req.row for r, req in self.live.items()}
        assert s.index_to_req_id == {req.row: r for r, req in self.live.items()}
        live_rows = [req.row for req in self.live.values()]
        assert len(set(live_rows)) == len(live_rows)  # no row shared by two live requests
        assert sorted(live_rows + s.free_indices) == list(range(R))

    @rule()
    def check_device_state(self):
        s = self.state
        s.apply_staged_writes()
        self.bt.apply_staged_writes()
        for req in self.live.values():
            row = req.row
            total = len(req.prefill) + len(req.sampled_since_add)
            assert s.prompt_len.gpu[row] == len(req.prompt) == s.prompt_len_np[row]
            assert s.prefill_len.gpu[row] == len(req.prefill) == s.prefill_len_np[row]
            assert s.num_computed_tokens.gpu[row] == req.num_computed
            assert s.num_computed_tokens_np[row] == req.num_computed
            assert s.total_len.gpu[row] == total
            assert s.all_token_ids.gpu[row, :total].tolist() == req.prefill + req.sampled_since_add
            last = req.sampled_since_add[-1] if req.sampled_since_add else 0
            assert s.last_sampled_tokens.gpu[row] == last
            assert self.bt.num_blocks[row] == len(req.blocks)
            assert self.bt.block_table.gpu[row, : len(req.blocks)].tolist() == req.blocks


TestRequestStateMachine = StateMachine.TestCase
TestRequestStateMachine.settings = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_reused_row_carries_nothing_from_previous_occupant():
    state = RequestState(R, MAX_LEN, T, V, "cpu")
    bt = BlockTables(R, W, T, BS, "cpu")
    row = state.add_request("long", 10, list(range(1, 19)), 5)
    bt.append_block_ids(row, [7, 8, 9, 10, 11], overwrite=True)
    state.apply_staged_writes()
    bt.apply_staged_writes()
    idx = torch.tensor([row], dtype=torch.int32)
    qsl = torch.tensor([0, 13], dtype=torch.int32)
    post_update(idx, 1, torch.tensor([42]), torch.tensor([1], dtype=torch.int32), qsl, state)
    assert state.remove_request("long") == row
    assert state.remove_request("long") is None
    assert state.add_request("short", 2, [3, 4, 5], 1) == row  # LIFO: same row again
    bt.append_block_ids(row, [2], overwrite=True)
    state.apply_staged_writes()
    bt.apply_staged_writes()
    assert state.prompt_len.gpu[row] == 2 and state.prefill_len.gpu[row] == 3
    assert state.num_computed_tokens.gpu[row] == 1 and state.total_len.gpu[row] == 3
    assert state.last_sampled_tokens.gpu[row] == 0
    assert state.all_token_ids.gpu[row, :3].tolist() == [3, 4, 5]
    assert bt.num_blocks[row] == 1 and bt.block_table.gpu[row, 0] == 2


def test_full_table_and_bad_adds_raise():
    state = RequestState(2, MAX_LEN, T, V, "cpu")
    assert [state.add_request(f"r{i}", 1, [1], 0) for i in range(2)] == [1, 0]
    with pytest.raises(RuntimeError, match="state rows are taken"):
        state.add_request("r2", 1, [1], 0)
    with pytest.raises(ValueError, match="already holds"):
        state.add_request("r0", 1, [1], 0)
    state.remove_request("r0")
    with pytest.raises(ValueError, match="prompt_len"):
        state.add_request("r3", 3, [1, 2], 0)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        state.add_request("r3", 1, [1, 2], 3)


def test_admissions_ship_in_two_launches(monkeypatch):
    """However many requests a step admits: one launch for their prompt tokens and one
    for every per-row scalar of theirs (apply_row_scalars), where a launch per field
    would take six; the values land as staged (the state machine above checks them)."""
    import runner_v2.staged_write as sw

    launches: list[str] = []

    class Count:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launches.append(self.name)
            return self.kernel[grid]

    monkeypatch.setattr(sw, "_apply_write_kernel", Count("tokens", sw._apply_write_kernel))
    monkeypatch.setattr(sw, "_apply_row_scalars_kernel",
                        Count("scalars", sw._apply_row_scalars_kernel))
    state = RequestState(R, MAX_LEN, T, V, "cpu")
    rows = [state.add_request(f"r{i}", 3, [5 + i] * (4 + i), i) for i in range(3)]
    state.apply_staged_writes()
    assert sorted(launches) == ["scalars", "tokens"]
    for i, row in enumerate(rows):
        assert (int(state.prompt_len.gpu[row]), int(state.prefill_len.gpu[row]),
                int(state.total_len.gpu[row]), int(state.num_computed_tokens.gpu[row])) == (
            3, 4 + i, 4 + i, i)
    launches.clear()
    state.apply_staged_writes()  # nothing staged
    assert launches == []
