"""Store a step's K/V into the paged cache at `slot_mapping`, skipping PAD (< 0) slots."""

from __future__ import annotations

import torch


def write_kv_torch(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [>= T]; negative = do not write
) -> None:
    """PyTorch path (CPU, and the GPU oracle). The boolean mask syncs on GPU, so the
    CUDA path uses the Triton kernel instead."""
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens]
    valid = slots >= 0
    idx = slots[valid]
    k_flat = key_cache.view(-1, key_cache.shape[-2], key_cache.shape[-1])
    v_flat = value_cache.view(-1, value_cache.shape[-2], value_cache.shape[-1])
    k_flat[idx] = key[valid].to(key_cache.dtype)
    v_flat[idx] = value[valid].to(value_cache.dtype)


def write_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Dispatch: Triton kernel on CUDA (graph-capturable, no sync), PyTorch elsewhere."""
    if key.is_cuda:
        from shared.attention.kv_write_triton import write_kv_triton

        write_kv_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        write_kv_torch(key, value, key_cache, value_cache, slot_mapping)
