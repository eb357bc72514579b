"""KV-cache write: PyTorch path and Triton kernel (interpreter) against a NumPy oracle.

The batch is the seed's CPU addressing oracle: an empty row, mixed query lengths
[2, 0, 1, 3], cached prefixes [5, 0, 12, 1], block size 8, and two PAD (-1) slots at the
tail. The cache starts filled with a sentinel so any stray write (a PAD slot read as
"the last row", a wrong block) shows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.attention.kv_write import write_kv_torch
from shared.attention.kv_write_triton import write_kv_triton

SENTINEL = -99.0
BLOCK_SIZE = 8
NUM_BLOCKS = 10
NUM_KV_HEADS = 2
HEAD_DIM = 4


def seed_slots() -> np.ndarray:
    """Slot mapping of the seed oracle, computed in NumPy (int64, PAD = -1 at the tail)."""
    query_lengths = np.array([2, 0, 1, 3])
    prefix_lengths = np.array([5, 0, 12, 1])
    table = np.array([[2, 3], [4, 5], [6, 7], [8, 9]])
    rows = np.repeat(np.arange(4), query_lengths)
    positions = np.concatenate(
        [np.arange(p, p + n) for p, n in zip(prefix_lengths, query_lengths)]
    )
    slots = table[rows, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    np.testing.assert_array_equal(slots, [21, 22, 60, 65, 66, 67])
    return np.r_[slots, -1, -1].astype(np.int64)


def numpy_oracle(key: np.ndarray, cache: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """cache: [num_blocks * block_size, Hkv, D]; negative slots are filtered *before*
    indexing (NumPy would read -1 as the last row)."""
    out = cache.copy()
    valid = slots >= 0
    out[slots[valid]] = key[: len(slots)][valid]
    return out


def _inputs(dtype: torch.dtype, num_tokens: int):
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return key, value, torch.full(shape, SENTINEL, dtype=dtype), torch.full(shape, SENTINEL, dtype=dtype)


@pytest.mark.parametrize("writer", [write_kv_torch, write_kv_triton], ids=["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seed_oracle_write(writer, dtype):
    slots = seed_slots()
    key, value, key_cache, value_cache = _inputs(dtype, len(slots))
    writer(key, value, key_cache, value_cache, torch.from_numpy(slots))

    flat_shape = (NUM_BLOCKS * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    for src, cache in ((key, key_cache), (value, value_cache)):
        src_np = src.float().numpy()
        expected = numpy_oracle(src_np, np.full(flat_shape, SENTINEL, np.float32), slots)
        got = cache.float().numpy().reshape(flat_shape)
        np.testing.assert_array_equal(got, expected)  # load/store only: bit-exact
        # PAD slots touched nothing: exactly the 6 real rows changed, the last row did not.
        changed = np.any(got != SENTINEL, axis=(1, 2))
        assert changed.sum() == 6 and not changed[-1]


def test_triton_matches_torch_with_strided_key_and_cast():
    """K/V as views into a fused qkv buffer (token stride != Hkv * D), cache in another
    dtype, a slot_mapping longer than T, and every negative value treated as PAD."""
    gen = torch.Generator().manual_seed(1)
    num_tokens = 7
    qkv = torch.randn(num_tokens, 3, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    key, value = qkv[:, 1], qkv[:, 2]
    assert not key.is_contiguous()
    slots = torch.tensor([3, -1, 79, 0, -5, 40, 41, -1, 12], dtype=torch.int64)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.full(shape, SENTINEL, dtype=torch.float16) for _ in range(4)]
    write_kv_torch(key, value, caches[0], caches[1], slots)
    write_kv_triton(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    flat = caches[2].view(-1, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(flat[79], key[2].half())  # the real last slot is written
    assert (flat != SENTINEL).any(dim=(1, 2)).sum() == 5  # 5 real tokens, 2 PAD skipped
