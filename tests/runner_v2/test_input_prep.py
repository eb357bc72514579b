"""V2 input prep vs NumPy: batch order, query_start_loc / positions / seq_lens with
padding, input ids of a mixed batch (0 ids / positions for the padded tokens),
logits_indices."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import runner_v2.input_batch as ib
from policy.kernel_options import KernelOptions
from runner_v2.block_tables import BlockTables
from runner_v2.input_batch import (
    InputBuffers,
    gather_batch_req_state,
    prepare_inputs,
)
from runner_v2.states import RequestState
from shared.runtime.kernel_options import use_kernel_options

R, MAX_LEN, T, V, BLOCK_SIZE = 8, 64, 128, 1000, 16
DEVICES = ["cpu"]  # "cuda": tests/gpu/runner_v2/test_input_prep_gpu.py


def _expected_order(req_ids, nst):
    decodes = [r for r in req_ids if nst[r] == 1]
    rest = [r for n in sorted({nst[r] for r in req_ids} - {1}) for r in req_ids if nst[r] == n]
    return decodes + rest


def test_batch_order_decodes_first_then_ascending_stable():
    rng = np.random.default_rng(0)
    for trial in range(40):
        req_ids = [f"r{i}" for i in rng.permutation(12)]
        lengths = [1] if trial % 4 == 0 else [1, 1, 2, 3, 5, 8]  # some all-decode steps
        nst = {r: int(rng.choice(lengths)) for r in req_ids}
        state = SimpleNamespace(req_id_to_index={r: 100 + i for i, r in enumerate(req_ids)})
        order, idx_np, q = gather_batch_req_state(nst, state)
        assert order == _expected_order(req_ids, nst)
        assert idx_np.tolist() == [state.req_id_to_index[r] for r in order]
        assert q.tolist() == [nst[r] for r in order]


class _Setup:
    """A state table with rows in every situation a step can meet."""

    def __init__(self, rng, device):
        self.state = RequestState(R, MAX_LEN, T, V, device)
        self.buffers = InputBuffers(R, T, device)
        self.block_tables = BlockTables(R, MAX_LEN // BLOCK_SIZE, T, BLOCK_SIZE, device)
        self.tokens: dict[str, np.ndarray] = {}  # full prefill per request
        self.last: dict[str, int] = {}
        # A first occupant in every row, then removed: every row carries stale data.
        for i in range(R):
            self.state.add_request(f"old{i}", 30, rng.integers(0, V, 40).tolist(), 17)
        self.state.apply_staged_writes()
        for i in range(R):
            self.state.remove_request(f"old{i}")
        # Poison device state that add must overwrite.
        self.state.last_sampled_tokens.gpu.fill_(-3)

    def add(self, req_id, prompt_len, prefill_len, num_computed, rng):
        toks = rng.integers(0, V, prefill_len)
        self.tokens[req_id] = toks
        self.state.add_request(req_id, prompt_len, toks.tolist(), num_computed)

    def make_decode(self, req_id, tok):
        """As after the last prefill chunk plus one sample: num_computed = prefill_len,
        the token lives only in last_sampled_tokens (device)."""
        row = self.state.req_id_to_index[req_id]
        n = len(self.tokens[req_id])
        self.state.num_computed_tokens.gpu[row] = n
        self.state.num_computed_tokens_np[row] = n
        self.state.last_sampled_tokens.gpu[row] = tok
        # Poison where a wrong kernel might read the decode input from.
        self.state.all_token_ids.gpu[row, n] = -99
        self.last[req_id] = tok


@pytest.fixture(params=DEVICES)
def mixed(request):
    return make_mixed(request.param)


def make_mixed(device):
    """A state table with one request in each situation, and the step's scheduled counts."""
    rng = np.random.default_rng(7)
    s = _Setup(rng, device)
    s.add("fresh", 7, 7, 0, rng)  # whole prompt in one chunk
    s.add("chunk", 20, 20, 8, rng)  # continues a prefill (e.g. a prefix-cache hit)
    s.add("resumed", 5, 12, 0, rng)  # prefill = prompt + 7 outputs, first chunk only
    s.add("dec_a", 9, 9, 0, rng)
    s.add("dec_b", 3, 6, 0, rng)
    s.state.apply_staged_writes()
    s.make_decode("dec_a", 555)
    s.make_decode("dec_b", 777)
    nst = {"fresh": 7, "chunk": 5, "dec_a": 1, "resumed": 4, "dec_b": 1}
    return s, nst


def _poison(buffers):
    buffers.input_ids.fill_(-5)
    buffers.positions.fill_(-5)
    buffers.seq_lens.fill_(777)
    buffers.query_start_loc.fill_(-1)
    buffers.logits_indices.fill_(-1)


def test_mixed_batch_matches_numpy(mixed):
    s, nst = mixed
    state = s.state
    req_ids, idx_np, q = gather_batch_req_state(nst, state)
    assert req_ids == ["dec_a", "dec_b", "resumed", "chunk", "fresh"]
    assert idx_np.tolist() == [state.req_id_to_index[r] for r in req_ids]
    _poison(s.buffers)
    num_reqs_padded, num_tokens_padded = 7, 24
    batch = prepare_inputs(req_ids, idx_np, q, num_reqs_padded, num_tokens_padded, state,
                           s.buffers, s.block_tables)

    # NumPy oracle.
    nc = {r: (len(s.tokens[r]) if r in s.last else 0) for r in req_ids}
    nc["chunk"] = 8
    qsl = np.zeros(num_reqs_padded + 1, dtype=np.int32)
    qsl[1 : len(req_ids) + 1] = np.cumsum([nst[r] for r in req_ids])
    qsl[len(req_ids) + 1 :] = qsl[len(req_ids)]
    positions = np.concatenate([nc[r] + np.arange(nst[r]) for r in req_ids])
    seq_lens = np.zeros(num_reqs_padded, dtype=np.int32)
    seq_lens[: len(req_ids)] = [nc[r] + nst[r] for r in req_ids]
    input_ids = np.concatenate(
        [[s.last[r]] if r in s.last else s.tokens[r][nc[r] : nc[r] + nst[r]] for r in req_ids]
    )
    num_tokens = int(qsl[len(req_ids)])

    np.testing.assert_array_equal(batch.query_start_loc.cpu().numpy(), qsl)
    np.testing.assert_array_equal(batch.query_start_loc_np, qsl)
    np.testing.assert_array_equal(batch.positions[:num_tokens].cpu().numpy(), positions)
    np.testing.assert_array_equal(batch.seq_lens.cpu().numpy(), seq_lens)
    np.testing.assert_array_equal(batch.seq_lens_np, seq_lens)
    np.testing.assert_array_equal(batch.input_ids[:num_tokens].cpu().numpy(), input_ids)
    np.testing.assert_array_equal(batch.logits_indices.cpu().numpy(), qsl[1 : len(req_ids) + 1] - 1)
    # The whole persistent seq_lens tail is zero (any padded graph size reads zeros).
    assert (s.buffers.seq_lens[len(req_ids) :] == 0).all()
    # The padded tokens get id 0 and position 0 (not the poison); past the padded size
    # nothing is written.
    for buf in (s.buffers.input_ids, s.buffers.positions):
        assert buf[num_tokens:num_tokens_padded].tolist() == [0] * (num_tokens_padded - num_tokens)
        assert (buf[num_tokens_padded:] == -5).all()
    assert batch.num_tokens == num_tokens and batch.num_tokens_padded == num_tokens_padded
    assert batch.input_ids.shape == (num_tokens_padded,)
    assert batch.max_query_len == 7 and batch.max_seq_len == seq_lens.max()
    assert batch.num_decodes == 2 and batch.num_decode_tokens == 2
    assert not batch.is_uniform_decode
    assert batch.idx_mapping.tolist() == idx_np.tolist()


def test_one_launch_per_step_decode_and_mixed(mixed, monkeypatch):
    s, _ = mixed
    launched = []
    real = ib._prepare_inputs_kernel

    class _Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(ib, "_prepare_inputs_kernel", _Spy())
    # every launch through the dispatch, where the spy sees it: on the GPU a kept
    # kernel's later launches skip __getitem__ (shared/runtime/triton_launch.py)
    with use_kernel_options(KernelOptions(repeat_launches=False)):
        nst = {"dec_b": 1, "dec_a": 1}
        req_ids, idx_np, q = gather_batch_req_state(nst, s.state)
        assert req_ids == ["dec_b", "dec_a"]  # stable among equal keys
        _poison(s.buffers)
        batch = prepare_inputs(req_ids, idx_np, q, 4, 4, s.state, s.buffers, s.block_tables)
        assert launched == [(3,)]  # one program per row + the padded-tail program
        assert batch.is_uniform_decode and batch.num_decodes == 2
        assert batch.input_ids[:2].tolist() == [777, 555]
        assert batch.positions[:2].tolist() == [6, 9]
        assert batch.seq_lens.tolist() == [7, 10, 0, 0]
        assert batch.query_start_loc.tolist() == [0, 1, 2, 2, 2]
        assert batch.logits_indices.tolist() == [0, 1]
        # A batch with a prefilling row is still one launch.
        nst = {"dec_b": 1, "fresh": 7}
        req_ids, idx_np, q = gather_batch_req_state(nst, s.state)
        prepare_inputs(req_ids, idx_np, q, 2, 8, s.state, s.buffers, s.block_tables)
        assert launched == [(3,), (3,)]


def test_buffers_keep_their_addresses(mixed):
    s, nst = mixed
    ptrs = [b.data_ptr() for b in (s.buffers.input_ids, s.buffers.positions, s.buffers.seq_lens,
                                   s.block_tables.input_block_tables, s.block_tables.slot_mappings)]
    for _ in range(2):
        req_ids, idx_np, q = gather_batch_req_state(nst, s.state)
        batch = prepare_inputs(req_ids, idx_np, q, 8, 32, s.state, s.buffers, s.block_tables)
        assert [batch.input_ids.data_ptr(), batch.positions.data_ptr(),
                batch.seq_lens.data_ptr(), batch.block_table.data_ptr(),
                batch.slot_mapping.data_ptr()] == ptrs  # fmt: skip
