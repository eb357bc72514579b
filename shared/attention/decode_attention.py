"""Decode attention with the KV write folded in: the TRITON backend's path for a
uniform-decode batch (every row has query length 1, or 0 when padded).

Why a kernel of its own. At batch 1 a decode layer's attention is bound by latency, not
bandwidth: the chain qkv GEMV -> KV write -> attention -> split reduce -> o_proj is a row
of dependent memory round trips. This kernel takes two links out of the critical path:
- no KV-write kernel: the program that owns a row's newest position (the last split)
  stores the new K/V into the cache itself, and uses them from registers;
- under programmatic dependent launch it is scheduled while the qkv GEMV drains, and
  before its griddepcontrol.wait it reads everything no kernel of this step writes: the
  row's metadata, its block table and the first KV tile of its split, which holds only
  positions below seq_len - 1, all written by earlier steps. (A block being appended to
  is never shared with another row, so no other row's new token lands in it.) Only
  the query and the new K/V, which the qkv GEMV writes, are read after the wait.

Program = (request, kv head, split), as the unified kernel's single-query mapping, with
the same split partition, so `reduce_splits_kernel` merges the partials unchanged.

When it runs: the TRITON impl uses it while the batch's (row, KV head) pairs number fewer
than the SMs (KernelOptions.fused_decode_kv_write); with more rows the KV-write kernel +
unified kernel measured faster, for a reason not yet found. The first-tile preload runs
only with KV splits (preload_first_tile).
"""

from __future__ import annotations

import torch

from shared.attention import triton_unified_attention as unified
from shared.attention.unified_attention_kernels import attend_kv_tiles, split_tile_range
from shared.runtime.kernel_options import kernel_options
from shared.runtime.triton_utils import (
    next_power_of_2,
    pdl_launch,
    pdl_wait_and_release,
    tl,
    triton,
)


@triton.jit
def _kv_tile(cache_ptr, block_row, kv_head, tile, kv_end, stride_b, stride_s, stride_h,
             stride_d, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr,
             KV_BLOCK_SIZE: tl.constexpr):
    """[TILE_N, BLOCK_D] of one KV head's cache at positions tile * TILE_N + n < kv_end."""
    k_pos = tile * TILE_N + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_valid = k_pos < kv_end
    blk = tl.load(block_row + k_pos // KV_BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
    return tl.load(
        cache_ptr + blk[:, None] * stride_b + (k_pos % KV_BLOCK_SIZE)[:, None] * stride_s
        + kv_head * stride_h + offs_d[None, :] * stride_d,
        mask=k_valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0,
    )


@triton.jit
def _fold_tile(q, k, v, k_pos, kv_end, acc, l_i, m_i, qk_scale,
               DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One step of the online softmax over a loaded tile (keys at k_pos < kv_end)."""
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where((k_pos < kv_end)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc=acc * alpha[:, None],
                 input_precision=DOT_PRECISION, out_dtype=acc.dtype)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["num_reqs"])
def decode_attention_kernel(
    output_ptr,  # [T, H, D]; written when NUM_SPLITS == 1
    query_ptr,  # [T, H, D]
    key_ptr,  # [T, Hkv, D]: this step's keys (the qkv GEMV's output)
    value_ptr,  # [T, Hkv, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,
    block_table_ptr,  # int32 [R, max_blocks_per_req]
    seq_lens_ptr,  # int32 [R]
    query_start_loc_ptr,  # int32 [R + 1]
    slot_mapping_ptr,  # int64 [>= T]; negative: the token is not written
    part_out_ptr, part_max_ptr, part_sum_ptr,  # as paged_attention_kernel's
    qk_scale,  # softmax scale * log2(e)
    num_reqs,
    stride_ot, stride_oh, stride_od,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kb, stride_ks, stride_kch, stride_kcd,
    stride_vb, stride_vs, stride_vch, stride_vcd,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # GROUP padded to tl.dot's 16 rows
    TILE_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_TILES_PER_SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PRELOAD: tl.constexpr,  # the first tile in registers before the PDL wait (see preload)
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (sm_90+)
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # --- Before the wait: nothing a kernel of this step writes (module docstring).
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    num_tiles = tl.cdiv(seq_len, TILE_N)  # the split partition counts the new position
    tile_lo, tile_hi = split_tile_range(num_tiles, split, NUM_SPLITS, MIN_TILES_PER_SPLIT)
    cache_end = seq_len - 1  # cached positions; the newest comes from key_ptr/value_ptr
    block_row = block_table_ptr + req.to(tl.int64) * stride_bt
    # Padded rows (q_len 0) and splits past a short context have nothing to do.
    active = (q_len == 1) & (tile_lo < tile_hi)
    if PRELOAD:
        first_end = tl.where(active, cache_end, 0)  # an idle program loads nothing
        k0 = _kv_tile(key_cache_ptr, block_row, kv_head, tile_lo, first_end, stride_kb,
                      stride_ks, stride_kch, stride_kcd, BLOCK_D, HEAD_DIM, TILE_N, KV_BLOCK_SIZE)
        v0 = _kv_tile(value_cache_ptr, block_row, kv_head, tile_lo, first_end, stride_vb,
                      stride_vs, stride_vch, stride_vcd, BLOCK_D, HEAD_DIM, TILE_N, KV_BLOCK_SIZE)
    if USE_PDL:  # launched while the qkv GEMV that writes q, k and v drains
        pdl_wait_and_release()
    if not active:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_valid = offs_m < GROUP
    d_valid = offs_d < HEAD_DIM
    head = kv_head * GROUP + offs_m % GROUP
    token = q_start.to(tl.int64)
    q = tl.load(query_ptr + token * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd,
                mask=row_valid[:, None] & d_valid[None, :], other=0.0).to(DOT_DTYPE)

    # This split owns the new position: its K/V and slot, loaded now so that their
    # latency hides behind the cached tiles' (every program is the owner at batch >= 16).
    owner = tile_hi == num_tiles
    k_new, v_new, slot = _load_new_kv(key_ptr, value_ptr, slot_mapping_ptr, token, kv_head,
                                      owner, stride_kt, stride_kh, stride_kd,
                                      stride_vt, stride_vh, stride_vd, BLOCK_D, HEAD_DIM)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if DOT_DTYPE == tl.float64:
        m_i, l_i, acc = m_i.to(tl.float64), l_i.to(tl.float64), acc.to(tl.float64)
    # The cached keys of this split: the preloaded first tile, then the rest. A split
    # whose range holds only the new position (cache_end on a tile boundary) skips both.
    cache_tile_hi = tl.minimum(tile_hi, tl.cdiv(cache_end, TILE_N))
    if tile_lo < cache_tile_hi:
        loop_lo = tile_lo
        if PRELOAD:
            k_pos = tile_lo * TILE_N + tl.arange(0, TILE_N)
            acc, l_i, m_i = _fold_tile(q, k0, v0, k_pos, cache_end, acc, l_i, m_i, qk_scale,
                                       DOT_DTYPE, DOT_PRECISION)
            loop_lo = tile_lo + 1
        # every query row sees every cached key: the causal limit is the new position
        q_abs = tl.zeros([BLOCK_M], tl.int32) + cache_end
        acc, l_i, m_i = attend_kv_tiles(
            q, q_abs, acc, l_i, m_i, key_cache_ptr, value_cache_ptr, block_row, kv_head,
            loop_lo, cache_tile_hi, cache_end, qk_scale,
            stride_kb, stride_ks, stride_kch, stride_kcd,
            stride_vb, stride_vs, stride_vch, stride_vcd,
            BLOCK_D, HEAD_DIM, TILE_N, KV_BLOCK_SIZE, DOT_DTYPE, DOT_PRECISION,
        )
    if owner:  # write the new K/V, attend to them
        acc, l_i, m_i = _write_and_attend_new_kv(
            q, acc, l_i, m_i, k_new, v_new, slot, key_cache_ptr, value_cache_ptr, kv_head,
            qk_scale, stride_kb, stride_ks, stride_kch, stride_kcd,
            stride_vb, stride_vs, stride_vch, stride_vcd, BLOCK_D, HEAD_DIM, KV_BLOCK_SIZE)

    out_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        tl.store(output_ptr + token * stride_ot + head[:, None] * stride_oh
                 + offs_d[None, :] * stride_od,
                 (acc / l_i[:, None]).to(output_ptr.dtype.element_ty), mask=out_mask)
    else:
        num_heads = tl.num_programs(1) * GROUP
        part = (req.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)


@triton.jit
def _load_new_kv(key_ptr, value_ptr, slot_mapping_ptr, token, kv_head, owner,
                 stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                 BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """This token's new K and V for one KV head, and its slot (-1 where not `owner`)."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_d < HEAD_DIM) & ((offs_d * 0 + owner.to(tl.int32)) > 0)  # tensors only
    k_new = tl.load(key_ptr + token * stride_kt + kv_head * stride_kh + offs_d * stride_kd,
                    mask=mask, other=0.0)
    v_new = tl.load(value_ptr + token * stride_vt + kv_head * stride_vh + offs_d * stride_vd,
                    mask=mask, other=0.0)
    slot = tl.where(owner, tl.load(slot_mapping_ptr + token), -1)
    return k_new, v_new, slot


@triton.jit
def _write_and_attend_new_kv(
    q, acc, l_i, m_i, k_new, v_new, slot, key_cache_ptr, value_cache_ptr, kv_head, qk_scale,
    stride_kb, stride_ks, stride_kch, stride_kcd,
    stride_vb, stride_vs, stride_vch, stride_vcd,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
):
    """The KV write of this token and KV head (skipped for a negative slot, as
    write_kv does), and the online-softmax step for its key, from registers."""
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    blk = slot // KV_BLOCK_SIZE
    in_blk = slot % KV_BLOCK_SIZE
    write = d_valid & ((offs_d * 0 + slot) >= 0)  # a tensor: the interpreter wants one
    tl.store(key_cache_ptr + blk * stride_kb + in_blk * stride_ks + kv_head * stride_kch
             + offs_d * stride_kcd, k_new.to(key_cache_ptr.dtype.element_ty), mask=write)
    tl.store(value_cache_ptr + blk * stride_vb + in_blk * stride_vs + kv_head * stride_vch
             + offs_d * stride_vcd, v_new.to(value_cache_ptr.dtype.element_ty), mask=write)
    # The key as the cache holds it, so the result does not depend on which path ran.
    k_c = k_new.to(key_cache_ptr.dtype.element_ty).to(acc.dtype)
    v_c = v_new.to(value_cache_ptr.dtype.element_ty).to(acc.dtype)
    s = tl.sum(q.to(acc.dtype) * k_c[None, :], 1) * qk_scale
    m_new = tl.maximum(m_i, s)
    p = tl.math.exp2(s - m_new)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v_c[None, :]
    return acc, l_i, m_new


# KernelOptions.decode_attention_preload: None is preload_first_tile's rule; True / False
# force it (benchmarks). KernelOptions.decode_attention_num_stages (default 1): the
# software-pipeline stages of the KV loop. One, not the single-query config's three: on the
# H200 one was faster alone at every context from 1K to 128K keys
# (docs/results/raw/4401167/h200_decode_attention_configs.json), and in the llama-3-8b
# batch-1 step (docs/results/raw/4401167/h200_decode_llama3_8b_attn_config.json). The first tile is loaded by hand before the
# PDL wait anyway.


def preload_first_tile(num_splits: int) -> bool:
    """Hold a split's first KV tile in registers across the PDL wait? Where the grid was
    widened by KV splits (small batches: bound by latency) that takes the loads off the
    critical path. With one split per row the batch fills the GPU on its own, and the
    held tile costs registers the software pipeline of the loop would rather have."""
    forced = kernel_options().decode_attention_preload
    return num_splits > 1 if forced is None else forced


def decode_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]: this step's keys, written into the cache here
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    output: torch.Tensor,  # [T, H, D]; rows of padded tokens are left untouched
    query_start_loc: torch.Tensor,  # int32 [R + 1]
    seq_lens: torch.Tensor,  # int32 [R]
    block_table: torch.Tensor,  # int32 [R, max_blocks_per_req]
    slot_mapping: torch.Tensor,  # int64 [>= T]; negative: not written
    scale: float,
    num_splits: int,
) -> None:
    """write_kv + paged_attention for a batch whose rows all have query length <= 1, in
    one kernel (+ the split reduction). Grids depend only on R and num_splits."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    num_reqs = seq_lens.shape[0]
    assert key.shape == value.shape == (num_tokens, num_kv_heads, head_dim), key.shape
    assert key_cache.shape == value_cache.shape and key_cache.shape[2:] == key.shape[1:]
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape[0] >= num_tokens
    unified.check_launch(query, key_cache, value_cache, output, query_start_loc, seq_lens,
                         block_table, num_splits)
    if num_tokens == 0 or num_reqs == 0:
        return
    group, block_d = num_heads // num_kv_heads, max(16, next_power_of_2(head_dim))
    cfg = unified.single_query_config(group, block_d, query.element_size() >= 4)
    dot_dtype = unified.dot_dtype_for(query.dtype)
    partials = unified.split_partials(query, num_reqs, num_splits)
    decode_attention_kernel[(num_reqs, num_kv_heads, num_splits)](
        output, query, key, value, key_cache, value_cache, block_table, seq_lens,
        query_start_loc, slot_mapping, *partials, scale * unified.LOG2E, num_reqs,
        *output.stride(), *query.stride(), *key.stride(), *value.stride(),
        *key_cache.stride(), *value_cache.stride(), block_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m,
        TILE_N=cfg.tile_n, KV_BLOCK_SIZE=key_cache.shape[1], NUM_SPLITS=num_splits,
        MIN_TILES_PER_SPLIT=unified.min_tiles_per_split(), DOT_DTYPE=dot_dtype,
        DOT_PRECISION=unified.dot_precision_for(dot_dtype),
        PRELOAD=preload_first_tile(num_splits),
        num_warps=cfg.num_warps, num_stages=kernel_options().decode_attention_num_stages,
        **pdl_launch(query),
    )
    unified.reduce_splits(output, partials, seq_lens, query_start_loc, cfg.tile_n, num_splits)
