"""V1 BlockTable: row edits, the prefix-only commit and the slot mapping vs NumPy."""

import numpy as np
import pytest
import torch

from runner_v1.block_table import BlockTable
from runner_v1.buffers import CpuGpuBuffer
from shared.attention.metadata import PAD_SLOT_ID
from shared.runtime.host_buffers import is_pin_memory_available

R, B, T, BS = 5, 4, 32, 8


def make_table(block_size: int = BS, max_blocks: int = B) -> BlockTable:
    return BlockTable(R, max_blocks, T, block_size, "cpu")


def rows(table: BlockTable) -> list[list[int]]:
    """The table as lists of live blocks; also checks the zero-past-the-count invariant."""
    out = []
    for row in range(R):
        n = table.num_blocks_per_row[row]
        assert not table.np[row, n:].any(), f"row {row} has blocks past its count"
        out.append(table.np[row, :n].tolist())
    return out


def test_cpu_gpu_buffer_copies_only_the_prefix():
    buf = CpuGpuBuffer(6, dtype=torch.int32, device="cpu")
    assert buf.cpu.is_pinned() == is_pin_memory_available()
    buf.np[:] = np.arange(6)
    buf.gpu.fill_(-5)
    view = buf.copy_to_gpu(4)
    assert view.tolist() == [0, 1, 2, 3]
    assert buf.gpu.tolist() == [0, 1, 2, 3, -5, -5]
    assert buf.gpu.data_ptr() != buf.cpu.data_ptr()  # a separate "device" tensor on CPU too


def test_add_append_clear():
    t = make_table()
    t.add_row([3, 4, 5], 0)
    t.append_row([6], 0)
    t.add_row([9], 2)
    assert rows(t)[:3] == [[3, 4, 5, 6], [], [9]]
    t.add_row([1], 0)  # replaces; the old tail must not survive
    t.clear_row(2)
    assert rows(t)[:3] == [[1], [], []]
    with pytest.raises(ValueError, match="maximum"):
        t.append_row([1, 2, 3, 4], 0)


def test_move_row_zeroes_the_source():
    t = make_table()
    t.add_row([1, 2, 3], 1)
    t.add_row([7], 4)
    t.move_row(4, 1)  # onto a longer row: its tail must be cleared
    assert rows(t) == [[], [7], [], [], []]
    t.add_row([5, 6], 3)
    t.move_row(3, 0)
    assert rows(t) == [[5, 6], [7], [], [], []]


def test_swap_row_matches_numpy():
    t = make_table()
    t.add_row([1, 2, 3], 0)
    t.add_row([8], 3)
    expected_table = t.np.copy()[[3, 1, 2, 0, 4]]
    expected_counts = t.num_blocks_per_row.copy()[[3, 1, 2, 0, 4]]
    t.swap_row(0, 3)
    np.testing.assert_array_equal(t.np, expected_table)
    np.testing.assert_array_equal(t.num_blocks_per_row, expected_counts)
    assert rows(t) == [[8], [], [], [1, 2, 3], []]


def test_commit_copies_only_the_live_prefix_and_zeroes_dropped_rows():
    t = make_table()
    for row in range(R):
        t.add_row([10 * row + 1, 10 * row + 2], row)
    device = t.block_table.gpu
    device.fill_(-1)  # sentinel: whatever commit does not write stays -1
    t.commit(3)
    np.testing.assert_array_equal(device[:3].numpy(), t.np[:3])
    assert (device[3:] == -1).all()  # rows past num_reqs were not copied
    t.clear_row(2)
    t.commit(2)  # the batch shrank: the row that left must not stay live on the device
    np.testing.assert_array_equal(device[:2].numpy(), t.np[:2])
    assert (device[2] == 0).all() and (device[3:] == -1).all()


def slot_mapping_oracle(table: np.ndarray, req_indices, positions, block_size: int) -> list:
    return [
        int(table[r, p // block_size]) * block_size + p % block_size
        for r, p in zip(req_indices.tolist(), positions.tolist())
    ]


@pytest.mark.parametrize("seed", range(5))
def test_slot_mapping_matches_a_loop_and_pads_the_tail(seed):
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([1, 4, 16]))
    t = make_table(block_size=block_size, max_blocks=6)
    for row in range(R):
        t.add_row(rng.integers(1, 10_000, size=6).tolist(), row)
    num_tokens = int(rng.integers(1, T // 2))
    req_indices = np.sort(rng.integers(0, R, size=num_tokens)).astype(np.int32)
    positions = rng.integers(0, 6 * block_size, size=num_tokens).astype(np.int64)
    t.slot_mapping.np[:] = 12345  # stale values from an earlier, larger step
    padded = num_tokens + int(rng.integers(0, T - num_tokens + 1))
    device = t.compute_slot_mapping(req_indices, positions, padded)
    expected = slot_mapping_oracle(t.np, req_indices, positions, block_size)
    assert device.shape == (padded,) and device.dtype == torch.int64
    assert device.tolist() == expected + [PAD_SLOT_ID] * (padded - num_tokens)
    assert t.slot_mapping.np.tolist() == expected + [PAD_SLOT_ID] * (T - num_tokens)


def test_seed_cpu_oracle_with_an_empty_row():
    """The seed's oracle: query lengths [2, 0, 1, 3], prefixes [5, 0, 12, 1], block 8."""
    t = BlockTable(4, 2, 8, 8, "cpu")
    for row, blocks in enumerate([[2, 3], [4, 5], [6, 7], [8, 9]]):
        t.add_row(blocks, row)
    query_lengths, prefix_lengths = np.array([2, 0, 1, 3]), np.array([5, 0, 12, 1])
    req_indices = np.repeat(np.arange(4), query_lengths)
    positions = np.concatenate([np.arange(p, p + n) for p, n in zip(prefix_lengths, query_lengths)])
    slots = t.compute_slot_mapping(req_indices, positions, 8).numpy()
    np.testing.assert_array_equal(slots, [21, 22, 60, 65, 66, 67, -1, -1])
    # A consumer must drop negative slots before indexing: -1 would hit the last row.
    cache = np.full(80, -99)
    valid = slots >= 0
    cache[slots[valid]] = np.arange(8)[valid]
    assert cache[-1] == -99 and np.count_nonzero(cache != -99) == 6


def test_slot_mapping_rejects_a_padding_smaller_than_the_tokens():
    t = make_table()
    with pytest.raises(ValueError, match="num_tokens_padded"):
        t.compute_slot_mapping(np.zeros(3, np.int32), np.zeros(3, np.int64), 2)
    with pytest.raises(ValueError, match="num_tokens_padded"):
        t.compute_slot_mapping(np.zeros(3, np.int32), np.zeros(3, np.int64), T + 1)
