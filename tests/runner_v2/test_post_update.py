"""post_update vs a NumPy model of the state table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner_v2.post_update import post_update
from runner_v2.states import RequestState

R, MAX_LEN, T, V = 6, 48, 64, 50
DEVICES = ["cpu"]  # "cuda": tests/gpu/runner_v2/test_post_update_gpu.py


def _state_with(rng, specs, device):
    """specs: (req_id, prompt_len, prefill_len, num_computed)."""
    state = RequestState(R, MAX_LEN, T, V, device)
    prefills = {}
    for req_id, prompt_len, prefill_len, nc in specs:
        prefills[req_id] = rng.integers(0, V, prefill_len)
        state.add_request(req_id, prompt_len, prefills[req_id].tolist(), nc)
    state.apply_staged_writes()
    return state, prefills


def _snapshot(state):
    return {
        "nc": state.num_computed_tokens.gpu.cpu().numpy().copy(),
        "total": state.total_len.gpu.cpu().numpy().copy(),
        "last": state.last_sampled_tokens.gpu.cpu().numpy().copy(),
        "tokens": state.all_token_ids.gpu.cpu().numpy().copy(),
    }


@pytest.mark.parametrize("device", DEVICES)
def test_post_update_matches_numpy_model(device):
    rng = np.random.default_rng(3)
    specs = [("a", 10, 10, 0), ("b", 20, 20, 4), ("c", 5, 8, 8), ("d", 7, 7, 7), ("e", 3, 3, 0)]
    state, _ = _state_with(rng, specs, device)
    bins = torch.from_numpy(rng.integers(0, 3, (R, V)).astype(np.int32)).to(device)
    dev = lambda a: torch.from_numpy(np.asarray(a)).to(device)
    # Batch: c and d decode, e's 3-token prefill reaches its end, b is a partial chunk
    # (4 + 6 < 20), a a whole prefill.
    req_ids = ["c", "d", "e", "b", "a"]
    q = np.array([1, 1, 3, 6, 10], dtype=np.int32)
    # "c" and "d" are decoding: their sampled tokens at prefill_len were appended earlier.
    for r in ("c", "d"):
        row = state.req_id_to_index[r]
        state.total_len.gpu[row] += 1
    for _step in range(3):
        idx = np.array([state.req_id_to_index[r] for r in req_ids], dtype=np.int32)
        qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        before = _snapshot(state)
        bins_before = bins.cpu().numpy().copy()
        seq_lens = (before["nc"][idx] + q).astype(np.int32)
        expected_ns = seq_lens >= state.prefill_len_np[idx]  # a partial chunk samples nothing
        sampled = dev(rng.integers(0, V, (len(idx), 1)))  # [N, 1] accepted
        post_update(dev(idx), len(idx), sampled, dev(seq_lens), dev(qsl), state, bins)

        # NumPy model.
        exp = {k: v.copy() for k, v in before.items()}
        exp_bins = bins_before.copy()
        for b, row in enumerate(idx):
            exp["nc"][row] += q[b]
            if expected_ns[b]:
                tok = int(sampled[b, 0].item())
                exp["last"][row] = tok
                exp["tokens"][row, exp["total"][row]] = tok
                exp["total"][row] += 1
                exp_bins[row, tok] += 1
        after = _snapshot(state)
        for k in exp:
            np.testing.assert_array_equal(after[k], exp[k], err_msg=k)
        np.testing.assert_array_equal(bins.cpu().numpy(), exp_bins)
        q = np.ones_like(q)  # next steps: single-token steps (b keeps chunking)
    # The partial chunk never sampled; b's row still holds only its prefill.
    row_b = state.req_id_to_index["b"]
    assert state.total_len.gpu[row_b] == 20 and state.num_computed_tokens.gpu[row_b] == 12


def test_post_update_without_bin_counts_and_padded_inputs():
    rng = np.random.default_rng(4)
    state, _ = _state_with(rng, [("x", 4, 4, 0), ("y", 2, 2, 0)], "cpu")
    idx = torch.tensor([state.req_id_to_index["y"]], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 2, 2], dtype=torch.int32)  # padded tail repeats
    sampled = torch.tensor([41, 99, 99], dtype=torch.int64)  # N > num_reqs
    seq_lens = torch.tensor([2, 0, 0], dtype=torch.int32)  # padded rows: seq_len 0
    before = _snapshot(state)
    post_update(idx, 1, sampled, seq_lens, qsl, state, None)
    after = _snapshot(state)
    ry, rx = state.req_id_to_index["y"], state.req_id_to_index["x"]
    assert after["nc"][ry] == 2 and after["total"][ry] == 3 and after["last"][ry] == 41
    assert after["tokens"][ry, 2] == 41
    # Only the batch's rows change.
    for k in before:
        np.testing.assert_array_equal(after[k][rx], before[k][rx])
