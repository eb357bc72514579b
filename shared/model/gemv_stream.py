"""Batch-1 GEMV as one flat, software-pipelined weight stream per program (the CUDA path).

gemv.py gives each program BLOCK_N rows over the whole of K and launches one program per
row tile. Its tensor-core variant pipelines the weight through shared memory, but the
pipeline drains at the end of every program and refills in the next, and the grid runs in
uneven waves (e.g. 448 programs of two per SM on 132 SMs). Here a fixed grid of programs
(typically a multiple of the SM count) walks row tiles pid, pid + G, pid + 2G, ... in one
flat loop over (tile, K tile) pairs, so the cp.async pipeline runs across tile boundaries
and each program's epilogue (the same ones as gemv.py: residual, SiLU-and-mul, RoPE) runs
inside the loop when a tile's last K tile is in.

One token row (M = 1): the token is column 0 of a [BLOCK_K, 16] tile for tl.dot, the other
15 are masked to zero. The input x is read only after the PDL wait and is part of the
pipelined loop, so nothing of it may be loaded before the loop; the weights are not
another kernel's output, so with PREFETCH_K > 0 the program asks L2 for the first
PREFETCH_K columns of its first tile's rows before the wait (cp.async.bulk.prefetch.L2:
no registers, nothing to wait for).
"""

from __future__ import annotations

import functools

import torch

from shared.model.gemv import _EPILOGUES, _epilogue, _program_rows, _x_tile_dot
from shared.triton_utils import INTERPRET, pdl_launch, pdl_wait_and_release, tl, triton


@triton.jit
def _prefetch_rows_l2(w_rows, NBYTES: tl.constexpr):
    """Bulk L2 prefetch of NBYTES from each row start (16-byte aligned, NBYTES % 16 == 0)."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r", [w_rows, tl.full(w_rows.shape, NBYTES, tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def _stream_gemv_kernel(
    x_ptr,  # [1, K]
    w_ptr,  # [rows, K]
    norm_w_ptr, residual_ptr, out_ptr, positions_ptr, cos_sin_ptr,  # as gemv._gemv_kernel
    partial_ptr,  # float32 [NUM_TILES, MAX_PARTS, 2 * BLOCK_N + 16]: split tiles' parts
    count_ptr,  # int32 [NUM_TILES]: 0 between launches
    N_OUT, stride_cs, eps,
    K: tl.constexpr,
    NUM_TILES: tl.constexpr,  # row tiles (ROPE: heads x half-head tiles)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides K
    HAS_NORM: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_ROPE_HEADS: tl.constexpr,
    MAX_PARTS: tl.constexpr,  # the most programs that share a tile
    PREFETCH_K: tl.constexpr = 0,
    USE_PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    K_TILES: tl.constexpr = K // BLOCK_K
    TOTAL: tl.constexpr = NUM_TILES * K_TILES
    # Program p streams iterations [p * TOTAL / G, (p + 1) * TOTAL / G) of the flattened
    # (tile, K tile) space: equal bytes per program, whatever the tile count.
    start = pid * TOTAL // num_programs
    end = (pid + 1) * TOTAL // num_programs
    PAIRED: tl.constexpr = EPILOGUE >= 2
    if USE_PDL:
        if PREFETCH_K > 0:
            rows_a, rows_b, row_mask, head, dims = _program_rows(
                start // K_TILES, N_OUT, BLOCK_N, EPILOGUE, HEAD_DIM)
            col0 = tl.minimum((start % K_TILES) * BLOCK_K, K - PREFETCH_K)
            _prefetch_rows_l2(w_ptr + rows_a.to(tl.int64) * K + col0, PREFETCH_K * 2)
            if PAIRED:
                _prefetch_rows_l2(w_ptr + rows_b.to(tl.int64) * K + col0, PREFETCH_K * 2)
        pdl_wait_and_release()
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    acc_a = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    sum_sq = tl.zeros([16], dtype=tl.float32)
    # A range that starts inside a tile holds that tile's second part (the "head"), one
    # that ends inside a tile its first part (in the accumulators after the loop). Their
    # sums are joined with the other program's after the loop: no atomics or barriers in
    # the loop, which the software pipeliner needs.
    head_a = tl.zeros([BLOCK_N], dtype=tl.float32)
    head_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    head_ss = 0.0
    for i in range(start, end):
        tile = i // K_TILES
        kk = i % K_TILES
        rows_a, rows_b, row_mask, head, dims = _program_rows(tile, N_OUT, BLOCK_N, EPILOGUE,
                                                             HEAD_DIM)
        cols = kk * BLOCK_K + offs_k
        xt, sum_sq = _x_tile_dot(x_ptr, w_ptr, norm_w_ptr, offs_m, 0, cols, cols < K, sum_sq,
                                 1, HAS_NORM)
        wa = tl.load(w_ptr + rows_a[:, None].to(tl.int64) * K + cols[None, :],
                     mask=row_mask[:, None], other=0.0)
        acc_a = tl.dot(wa, xt, acc_a)
        if PAIRED:
            wb = tl.load(w_ptr + rows_b[:, None].to(tl.int64) * K + cols[None, :],
                         mask=row_mask[:, None], other=0.0)
            acc_b = tl.dot(wb, xt, acc_b)
        if kk == K_TILES - 1:
            y_a, y_b, ss = _token_sums(acc_a, acc_b, sum_sq, offs_m)
            if tile * K_TILES >= start:  # the whole tile was ours
                _finish_tile(y_a, y_b, ss, tile, x_ptr, residual_ptr, out_ptr, positions_ptr,
                             cos_sin_ptr, N_OUT, stride_cs, eps, K, BLOCK_N, HAS_NORM,
                             EPILOGUE, HEAD_DIM, NUM_ROPE_HEADS)
            else:
                head_a, head_b, head_ss = y_a, y_b, ss
            acc_a = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
            acc_b = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
            sum_sq = tl.zeros([16], dtype=tl.float32)
    first_tile = start // K_TILES
    if (start % K_TILES != 0) & ((first_tile + 1) * K_TILES <= end):
        _join_split_tile(head_a, head_b, head_ss, pid, num_programs, first_tile, partial_ptr,
                         count_ptr, x_ptr, residual_ptr, out_ptr, positions_ptr, cos_sin_ptr,
                         N_OUT, stride_cs, eps, K, K_TILES, TOTAL, MAX_PARTS, BLOCK_N,
                         HAS_NORM, EPILOGUE, HEAD_DIM, NUM_ROPE_HEADS)
    if end % K_TILES != 0:  # (a range inside one tile ends up here too)
        y_a, y_b, ss = _token_sums(acc_a, acc_b, sum_sq, offs_m)
        _join_split_tile(y_a, y_b, ss, pid, num_programs, end // K_TILES, partial_ptr,
                         count_ptr, x_ptr, residual_ptr, out_ptr, positions_ptr, cos_sin_ptr,
                         N_OUT, stride_cs, eps, K, K_TILES, TOTAL, MAX_PARTS, BLOCK_N,
                         HAS_NORM, EPILOGUE, HEAD_DIM, NUM_ROPE_HEADS)


@triton.jit
def _token_sums(acc_a, acc_b, sum_sq, offs_m):
    """The token's (column 0's) dot products and sum of squares."""
    y_a = tl.sum(tl.where(offs_m[None, :] == 0, acc_a, 0.0), axis=1)
    y_b = tl.sum(tl.where(offs_m[None, :] == 0, acc_b, 0.0), axis=1)
    return y_a, y_b, tl.sum(tl.where(offs_m == 0, sum_sq, 0.0), axis=0)


@triton.jit
def _finish_tile(y_a, y_b, ss, tile, x_ptr, residual_ptr, out_ptr, positions_ptr, cos_sin_ptr,
                 N_OUT, stride_cs, eps, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_NORM: tl.constexpr, EPILOGUE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 NUM_ROPE_HEADS: tl.constexpr):
    """A tile's whole-K sums -> its outputs (RMSNorm scale, then gemv's epilogue)."""
    rows_a, rows_b, row_mask, head, dims = _program_rows(tile, N_OUT, BLOCK_N, EPILOGUE,
                                                         HEAD_DIM)
    if HAS_NORM:
        rstd = tl.math.rsqrt(ss / K + eps)
        y_a = y_a * rstd
        y_b = y_b * rstd
    _epilogue(y_a, y_b, 0, rows_a, rows_b, row_mask, head, dims,
              x_ptr, residual_ptr, out_ptr, positions_ptr, cos_sin_ptr,
              0, 0, stride_cs, False, EPILOGUE, HEAD_DIM, NUM_ROPE_HEADS)


@triton.jit
def _owner(i, num_programs, TOTAL: tl.constexpr):
    """The program whose range [p * TOTAL // G, (p + 1) * TOTAL // G) holds iteration i."""
    return ((i + 1) * num_programs - 1) // TOTAL


@triton.jit
def _join_split_tile(y_a, y_b, ss, pid, num_programs, tile, partial_ptr, count_ptr,
                     x_ptr, residual_ptr, out_ptr, positions_ptr, cos_sin_ptr,
                     N_OUT, stride_cs, eps, K: tl.constexpr, K_TILES: tl.constexpr,
                     TOTAL: tl.constexpr, MAX_PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_NORM: tl.constexpr, EPILOGUE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     NUM_ROPE_HEADS: tl.constexpr):
    """One program's part of a tile that several programs stream: publish this part's sums
    in the tile's slot for this program; the program that comes last adds all the parts in
    slot order (the same bits whoever comes last) and finishes the tile."""
    PARTIAL: tl.constexpr = 2 * BLOCK_N + 16
    offs = tl.arange(0, BLOCK_N)
    offs_ss = tl.arange(0, 16)  # ss sits in the first of 16 floats after the two rows
    first = _owner(tile * K_TILES, num_programs, TOTAL)
    parts = _owner((tile + 1) * K_TILES - 1, num_programs, TOTAL) - first + 1
    slots = partial_ptr + tile * (MAX_PARTS * PARTIAL)
    mine = slots + (pid - first) * PARTIAL
    tl.store(mine + offs, y_a)
    tl.store(mine + BLOCK_N + offs, y_b)
    tl.store(mine + 2 * BLOCK_N + offs_ss, tl.where(offs_ss == 0, ss, 0.0))
    # Every thread's stores above, then one release: the last program acquires them.
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == parts - 1:
        y_a = tl.zeros([BLOCK_N], dtype=tl.float32)
        y_b = tl.zeros([BLOCK_N], dtype=tl.float32)
        ss_parts = tl.zeros([16], dtype=tl.float32)
        for part in range(parts):
            # .cg: from L2, where the other programs' stores are (L1 is per SM)
            y_a += tl.load(slots + part * PARTIAL + offs, cache_modifier=".cg")
            y_b += tl.load(slots + part * PARTIAL + BLOCK_N + offs, cache_modifier=".cg")
            ss_parts += tl.load(slots + part * PARTIAL + 2 * BLOCK_N + offs_ss,
                                cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch
        _finish_tile(y_a, y_b, tl.sum(ss_parts, axis=0), tile, x_ptr, residual_ptr, out_ptr,
                     positions_ptr, cos_sin_ptr, N_OUT, stride_cs, eps, K, BLOCK_N,
                     HAS_NORM, EPILOGUE, HEAD_DIM, NUM_ROPE_HEADS)


def num_tiles(rows: int, epilogue: str, block_n: int, head_dim: int = 0) -> int:
    if epilogue == "rope":
        return rows // head_dim * (head_dim // 2 // block_n)
    n_out = rows // 2 if epilogue == "silu" else rows
    return triton.cdiv(n_out, block_n)


_WORKSPACE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, partial_size: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials, counters): one pair per device, grown before a graph captures it (the
    counters must be zero when a launch starts; each launch leaves them zero)."""
    have = _WORKSPACE.get(device)
    if have is None or have[0].numel() < partial_size or have[1].numel() < tiles:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("stream_gemv: its workspace must be sized by an eager call "
                               "before CUDA-graph capture (warm the model up first)")
        size = max(partial_size, 0 if have is None else have[0].numel())
        count = max(tiles, 0 if have is None else have[1].numel())
        have = (torch.empty(size, dtype=torch.float32, device=device),
                torch.zeros(count, dtype=torch.int32, device=device))
        _WORKSPACE[device] = have
    return have


@functools.cache
def max_parts_per_tile(tiles: int, k_tiles: int, programs: int) -> int:
    """The most programs whose ranges of the flattened (tile, K tile) space meet one tile."""
    total = tiles * k_tiles
    owner = lambda i: ((i + 1) * programs - 1) // total  # noqa: E731 (the kernel's _owner)
    return max(owner((t + 1) * k_tiles - 1) - owner(t * k_tiles) + 1 for t in range(tiles))


def stream_gemv(
    x: torch.Tensor,  # [1, K]
    weight: torch.Tensor,  # [rows, K]
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    epilogue: str = "none",
    residual: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    head_dim: int = 0,
    num_rope_heads: int = 0,
    config: tuple = (64, 256, 4, 3, 132, 0),  # BLOCK_N, BLOCK_K, warps, stages, programs, PREFETCH_K
) -> torch.Tensor:
    """gemv.gemv's result for one token row, from `programs` programs that each stream an
    equal share of the weight."""
    block_n, block_k, num_warps, num_stages, programs, prefetch_k = config
    rows, k = weight.shape
    assert x.shape == (1, k) and x.is_contiguous() and weight.is_contiguous()
    assert k % block_k == 0 and block_n >= 16, (k, config)
    n_out = rows // 2 if epilogue == "silu" else rows
    if epilogue == "rope":
        assert (head_dim // 2) % block_n == 0, (head_dim, block_n)
    else:
        assert n_out % block_n == 0, (n_out, block_n)
    tiles = num_tiles(rows, epilogue, block_n, head_dim)
    k_tiles = k // block_k
    if not 0 < programs <= tiles * k_tiles:
        raise ValueError(f"stream_gemv: programs={programs} must be in 1..{tiles * k_tiles} "
                         f"(the K tiles to stream); lower it in the config")
    max_parts = max_parts_per_tile(tiles, k_tiles, programs)
    out = torch.empty(1, n_out, dtype=x.dtype, device=x.device)
    partials, counts = _workspace(x.device, tiles * max_parts * (2 * block_n + 16), tiles)
    extra = {"num_warps": num_warps, "num_stages": num_stages} if x.is_cuda else {}
    extra.update(pdl_launch(x))
    _stream_gemv_kernel[(programs,)](
        x, weight, x if norm_weight is None else norm_weight,
        x if residual is None else residual, out,
        x if positions is None else positions, x if cos_sin_cache is None else cos_sin_cache,
        partials, counts,
        n_out, 0 if cos_sin_cache is None else cos_sin_cache.stride(0), eps,
        K=k, NUM_TILES=tiles, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_NORM=norm_weight is not None, EPILOGUE=_EPILOGUES[epilogue], HEAD_DIM=head_dim,
        NUM_ROPE_HEADS=num_rope_heads, MAX_PARTS=max_parts,
        PREFETCH_K=0 if INTERPRET else min(prefetch_k, k),
        **extra,
    )
    return out
