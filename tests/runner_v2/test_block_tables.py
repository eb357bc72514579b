"""BlockTables: staged appends, and the per-step prepare (the gathered table with padded
rows zeroed, the slot mapping with PAD from the real token count to the end), vs NumPy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner_v2.block_tables import BlockTables
from shared.attention.metadata import PAD_SLOT_ID

R, W, T, BS = 8, 6, 64, 4
DEVICES = ["cpu"]  # "cuda": tests/gpu/runner_v2/test_block_tables_gpu.py


def _filled_tables(rng, device) -> tuple[BlockTables, np.ndarray]:
    bt = BlockTables(R, W, T, BS, device)
    model = np.zeros((R, W), dtype=np.int32)
    for row in range(R):  # a first occupant everywhere, then appends in two rounds
        ids = rng.integers(0, 1000, size=rng.integers(1, 4))
        bt.append_block_ids(row, ids.tolist(), overwrite=True)
        model[row, : len(ids)] = ids
    bt.apply_staged_writes()
    for row in rng.choice(R, size=5, replace=False):
        start = bt.num_blocks[row]
        ids = rng.integers(0, 1000, size=W - start)
        bt.append_block_ids(int(row), ids.tolist(), overwrite=False)
        model[row, start:] = ids
    bt.apply_staged_writes()
    return bt, model


def test_append_overwrite_and_counts():
    bt = BlockTables(R, W, T, BS, "cpu")
    bt.append_block_ids(2, [5, 6, 7], overwrite=True)
    bt.append_block_ids(2, [8], overwrite=False)
    bt.apply_staged_writes()
    assert bt.num_blocks[2] == 4 and bt.block_table.gpu[2, :4].tolist() == [5, 6, 7, 8]
    # A new occupant of the row starts at column 0; its count forgets the old one.
    bt.append_block_ids(2, [9], overwrite=True)
    bt.apply_staged_writes()
    assert bt.num_blocks[2] == 1 and bt.block_table.gpu[2, 0].item() == 9


@pytest.mark.parametrize("device", DEVICES)
def test_prepare_matches_numpy_pads_rows_and_slots(device):
    """One launch: the step's table gathered by state row (padded rows zeroed) and the
    slot mapping (PAD from the real token count to the end of the persistent buffer)."""
    rng = np.random.default_rng(1)
    bt, model = _filled_tables(rng, device)
    dev = lambda a: torch.from_numpy(a).to(device)
    bt.input_block_tables.fill_(-7)  # poison: stale content from "an earlier step"
    bt.slot_mappings.fill_(12345)
    idx_np = np.array([7, 2, 4, 1], dtype=np.int32)
    q = np.array([1, 1, 5, 9], dtype=np.int32)
    num_computed = np.array([3, 0, 2, 10], dtype=np.int64)  # all within W * BS = 24
    num_reqs_padded = 6
    qsl = np.concatenate([[0], np.cumsum(q), np.full(num_reqs_padded - 4, q.sum())])
    qsl = qsl.astype(np.int32)  # padded tail repeats the real token count
    num_tokens = int(q.sum())
    positions = np.concatenate([nc + np.arange(n) for nc, n in zip(num_computed, q)])
    # The positions buffer past num_tokens holds stale junk; it must not matter.
    positions_buf = np.full(T, 10**6, dtype=np.int64)
    positions_buf[:num_tokens] = positions
    num_tokens_padded = 24
    table, slots = bt.prepare(
        dev(idx_np), dev(qsl), dev(positions_buf), num_reqs_padded, num_tokens_padded
    )
    assert table.shape == (num_reqs_padded, W)
    assert table.data_ptr() == bt.input_block_tables.data_ptr()
    expected = np.zeros((num_reqs_padded, W), dtype=np.int32)
    expected[:4] = model[idx_np]
    np.testing.assert_array_equal(table.cpu().numpy(), expected)
    # Beyond num_reqs_padded the persistent buffer is not this step's business.
    assert (bt.input_block_tables[num_reqs_padded:] == -7).all()
    assert slots.shape == (num_tokens_padded,) and slots.dtype == torch.int64
    req_of_token = np.repeat(idx_np, q)
    expected_real = model[req_of_token, positions // BS].astype(np.int64) * BS + positions % BS
    np.testing.assert_array_equal(slots[:num_tokens].cpu().numpy(), expected_real)
    # PAD from the real count to the END of the persistent buffer, not just the view.
    assert (bt.slot_mappings[num_tokens:] == PAD_SLOT_ID).all()


def test_prepare_with_no_requests_pads_everything():
    bt = BlockTables(R, W, T, BS, "cpu")
    bt.slot_mappings.fill_(3)
    bt.input_block_tables.fill_(5)
    qsl = torch.zeros(3, dtype=torch.int32)
    bt.prepare(torch.zeros(0, dtype=torch.int32), qsl, torch.zeros(T, dtype=torch.int64), 2, 8)
    assert (bt.slot_mappings == PAD_SLOT_ID).all()
    assert (bt.input_block_tables[:2] == 0).all() and (bt.input_block_tables[2:] == 5).all()
