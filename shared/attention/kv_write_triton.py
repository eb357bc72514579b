"""Triton KV-cache write: store a step's K/V at `slot_mapping`, skipping PAD (< 0) slots.

The CUDA path of shared.attention.kv_write. Unlike the PyTorch path it needs no boolean
mask (which syncs to learn its size), so it is CUDA-graph capturable: the grid is fixed
by the number of (padded) tokens and every PAD decision is taken inside the kernel.
"""

from __future__ import annotations

import torch

from shared.runtime.triton_utils import (
    next_power_of_2,
    pdl_launch,
    pdl_wait_and_release,
    tl,
    triton,
)

# One program stores one token's Hkv * D elements in chunks of at most this many, so a
# token row (8 heads x 128 = 1024 elements for Llama-3-8B) is one program.
_MAX_BLOCK = 2048


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # int64 [>= T]
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (sm_90+)
):
    if USE_PDL:  # launched while the qkv projection that wrote k and v drains
        pdl_wait_and_release()
    token = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    # PAD slot (-1): return before forming any cache address, so a padded token of a
    # CUDA-graph batch can never write into block 0 or wrap to the last row.
    if slot < 0:
        return
    block = slot // KV_BLOCK_SIZE
    offset = slot % KV_BLOCK_SIZE

    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUM_KV_HEADS * HEAD_DIM
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM

    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim * stride_vd, mask=mask)
    k_dst = key_cache_ptr + block * stride_kcb + offset * stride_kcs
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vcs
    # load/store (and a cast when the cache dtype differs) only: no arithmetic, so bf16
    # is safe under the interpreter too.
    tl.store(
        k_dst + head * stride_kch + dim * stride_kcd,
        k.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + head * stride_vch + dim * stride_vcd,
        v.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64 [>= T]; negative = do not write
) -> None:
    """Write K/V rows into the paged cache. No host sync; grid = (T, chunks per token)."""
    assert key.dim() == 3 and key.shape == value.shape, (key.shape, value.shape)
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), (key_cache.shape, key.shape)
    assert slot_mapping.dtype == torch.int64, slot_mapping.dtype
    assert slot_mapping.dim() == 1 and slot_mapping.shape[0] >= num_tokens
    assert key.is_floating_point() and key_cache.is_floating_point()
    if num_tokens == 0:
        return
    block = min(next_power_of_2(num_kv_heads * head_dim), _MAX_BLOCK)
    grid = (num_tokens, triton.cdiv(num_kv_heads * head_dim, block))
    _write_kv_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(),
        *key_cache.stride(), *value_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_BLOCK_SIZE=key_cache.shape[1],
        BLOCK=block,
        num_warps=4,
        **pdl_launch(key),
    )
