"""Batch-1 GEMVs whose weight stream goes through a TMA ring in shared memory (sm_90+).

Why (docs/results, seventh session): on the H200 the chain of llama-3-8b's four layer
GEMVs under PDL takes ~114 us per layer, and the same kernels with no dependency wait
take ~100 us (the floor of their bytes). The whole gap is the waits: a producer's tail,
grid completion, and the consumer's ramp. The FMA kernels (gemv.py) can only hold one to
three weight tiles per program in registers across the wait. Here a program keeps STAGES
weight tiles in flight in shared memory through the Tensor Memory Accelerator: they are
issued before `griddepcontrol.wait` (weights never depend on the previous kernel) and cost
no registers, so the programs that land on SMs freed by the producer's tail keep the HBM
busy while the producer drains.

A program owns BLOCK_N output rows over the whole of K. Per K tile it waits on the tile's
mbarrier, reads it from shared memory into registers (16-byte vectors, a warp per row
run), multiplies by the input's tile (from L2) and, once every warp has read the slot,
reissues the slot's TMA for the tile STAGES ahead. The same fusions as gemv.py: an
RMSNorm prologue folded into the dot product, residual and SiLU-pair epilogues.

Experimental: launched only by scripts/bench_tma_gemv.py and tests/gpu; it needs a CUDA
device of capability 9.0 or newer (Gluon has no interpreter path).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_EPILOGUES = {"none": 0, "residual": 1, "silu": 2, "rope": 3}


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _issue(w_desc, bar, slot_a, slot_b, row_a, row_b, k0, PAIRED: gl.constexpr):
    """One ring slot's TMA: the [BLOCK_N, BLOCK_K] weight tile at (row_a, k0), and for a
    pair (SiLU, RoPE) the one at (row_b, k0) on the same barrier."""
    if PAIRED:
        mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [row_a, k0], bar, slot_a)
        tma.async_copy_global_to_shared(w_desc, [row_b, k0], bar, slot_b)
    else:
        mbarrier.expect(bar, w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [row_a, k0], bar, slot_a)


@gluon.jit
def _tile_rows(t, N_OUT, BLOCK_N: gl.constexpr, EPILOGUE: gl.constexpr,
               HEAD_DIM: gl.constexpr):
    """Row tile t's first rows: row_a, and for the pairs row_b (SiLU: the up row j + N_OUT
    of gate row j; RoPE: dims d and d + D/2 of one head); RoPE's head and first dim."""
    if EPILOGUE == 3:
        HALF: gl.constexpr = HEAD_DIM // 2
        head = t // (HALF // BLOCK_N)
        dim0 = (t % (HALF // BLOCK_N)) * BLOCK_N
        row_a = head * HEAD_DIM + dim0
        row_b = row_a + HALF
    else:
        head = t
        dim0 = t * 0
        row_a = t * BLOCK_N
        row_b = N_OUT + row_a
    return row_a, row_b, head, dim0


@gluon.jit
def _issue_item(w_desc, bars, smem_a, smem_b, i, tile0, N_OUT, BLOCK_N: gl.constexpr,
                BLOCK_K: gl.constexpr, NUM_K: gl.constexpr, STAGES: gl.constexpr,
                EPILOGUE: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The TMA of the program's i-th (row tile, K tile) item into ring slot i % STAGES."""
    slot = i % STAGES
    row_a, row_b, _, _ = _tile_rows(tile0 + i // NUM_K, N_OUT, BLOCK_N, EPILOGUE, HEAD_DIM)
    _issue(w_desc, bars.index(slot), smem_a.index(slot), smem_b.index(slot), row_a, row_b,
           (i % NUM_K) * BLOCK_K, EPILOGUE >= 2)


@gluon.jit
def _store_tile(acc_a, acc_b, sum_sq, t, residual_ptr, out_ptr, positions_ptr, cos_sin_ptr,
                N_OUT, stride_cs, eps, K: gl.constexpr, BLOCK_N: gl.constexpr,
                HAS_NORM: gl.constexpr, EPILOGUE: gl.constexpr, HEAD_DIM: gl.constexpr,
                NUM_ROPE_HEADS: gl.constexpr, row_layout: gl.constexpr):
    """Row tile t's outputs from its float32 partial products, as
    gemv_tiles.apply_epilogue computes them."""
    row_a, row_b, head, dim0 = _tile_rows(t, N_OUT, BLOCK_N, EPILOGUE, HEAD_DIM)
    y_a = gl.sum(acc_a, axis=1)
    y_b = gl.sum(acc_b, axis=1)
    if HAS_NORM:
        rstd = gl.rsqrt(gl.sum(sum_sq, axis=0) / K + eps)
        y_a = y_a * rstd
        y_b = y_b * rstd
    offs = gl.arange(0, BLOCK_N, layout=row_layout)
    out_ty: gl.constexpr = out_ptr.dtype.element_ty
    # Round to the model dtype where the unfused path's matmul output is rounded.
    y_a = y_a.to(out_ty).to(gl.float32)
    y_b = y_b.to(out_ty).to(gl.float32)
    if EPILOGUE == 0:
        gl.store(out_ptr + row_a + offs, y_a.to(out_ty))
    elif EPILOGUE == 1:
        res = gl.load(residual_ptr + row_a + offs).to(gl.float32)
        gl.store(out_ptr + row_a + offs, (y_a + res).to(out_ty))
    elif EPILOGUE == 2:
        act = (y_a / (1.0 + gl.exp(-y_a))).to(out_ty).to(gl.float32)
        gl.store(out_ptr + row_a + offs, (act * y_b).to(out_ty))
    else:
        HALF: gl.constexpr = HEAD_DIM // 2
        pos = gl.load(positions_ptr).to(gl.int64)
        cos = gl.load(cos_sin_ptr + pos * stride_cs + dim0 + offs).to(gl.float32)
        sin = gl.load(cos_sin_ptr + pos * stride_cs + HALF + dim0 + offs).to(gl.float32)
        rotate = head < NUM_ROPE_HEADS
        out_a = gl.where(rotate, y_a * cos - y_b * sin, y_a)
        out_b = gl.where(rotate, y_b * cos + y_a * sin, y_b)
        gl.store(out_ptr + row_a + offs, out_a.to(out_ty))
        gl.store(out_ptr + row_b + offs, out_b.to(out_ty))


@gluon.jit
def tma_gemv_kernel(
    w_desc,  # TMA descriptor of the [rows, K] weight, block [BLOCK_N, BLOCK_K]
    x_ptr,  # [K] input row
    norm_w_ptr,  # [K]; read only when HAS_NORM
    residual_ptr,  # [N_OUT]; read only by the residual epilogue
    out_ptr,  # [N_OUT]
    positions_ptr,  # int [1]; read only by the RoPE epilogue
    cos_sin_ptr,  # [max_position, HEAD_DIM]: cos | sin; read only by RoPE
    N_OUT,  # output columns (SiLU: the intermediate size; the weight has 2 * N_OUT rows)
    stride_cs,
    eps,
    K: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    TILES: gl.constexpr,  # row tiles per program, consecutive, streamed through one ring
    HAS_NORM: gl.constexpr,
    EPILOGUE: gl.constexpr,  # 0 none, 1 residual, 2 silu, 3 rope
    HEAD_DIM: gl.constexpr,  # RoPE only
    NUM_ROPE_HEADS: gl.constexpr,  # RoPE: q + k heads (rotated); the v heads after are not
    USE_PDL: gl.constexpr,
    EARLY_RELEASE: gl.constexpr,  # USE_PDL: let the next kernel launch before this one waits
    SKIP_WAIT: gl.constexpr = False,  # diagnostic: never wait for the previous kernel (wrong)
    PREFETCH: gl.constexpr = True,  # USE_PDL: fill the ring before the wait (else after it)
):
    NUM_WARPS: gl.constexpr = gl.num_warps()
    # Each thread reads 8 contiguous bf16 (16 bytes) of a row; a warp covers 256 columns of
    # one row per step, the warps split the rows.
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])
    col_layout: gl.constexpr = gl.SliceLayout(0, layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    PAIRED: gl.constexpr = EPILOGUE >= 2
    NUM_K: gl.constexpr = K // BLOCK_K
    TOTAL: gl.constexpr = TILES * NUM_K  # (row tile, K tile) items, in this order
    gl.static_assert(K % BLOCK_K == 0)

    tile0 = gl.program_id(0) * TILES
    dtype: gl.constexpr = w_desc.dtype
    smem_a = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    if PAIRED:
        smem_b = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    else:
        smem_b = smem_a
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)

    # The weights never depend on the previous kernel: fill the ring before the wait.
    if PREFETCH:
        for s in gl.static_range(STAGES):
            if s < TOTAL:
                _issue_item(w_desc, bars, smem_a, smem_b, s, tile0, N_OUT, BLOCK_N, BLOCK_K,
                            NUM_K, STAGES, EPILOGUE, HEAD_DIM)
    if USE_PDL:
        if EARLY_RELEASE:
            _gdc_launch_dependents()
        if not SKIP_WAIT:
            _gdc_wait()
        if not EARLY_RELEASE:
            _gdc_launch_dependents()
    if not PREFETCH:
        for s in gl.static_range(STAGES):
            if s < TOTAL:
                _issue_item(w_desc, bars, smem_a, smem_b, s, tile0, N_OUT, BLOCK_N, BLOCK_K,
                            NUM_K, STAGES, EPILOGUE, HEAD_DIM)

    acc_a = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
    acc_b = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
    sum_sq = gl.zeros([BLOCK_K], gl.float32, col_layout)
    cols = gl.arange(0, BLOCK_K, layout=col_layout)
    for i in range(TOTAL):
        slot = i % STAGES
        k0 = (i % NUM_K) * BLOCK_K
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        x = gl.load(x_ptr + k0 + cols).to(gl.float32)
        if HAS_NORM:
            sum_sq += x * x
            x = x * gl.load(norm_w_ptr + k0 + cols).to(gl.float32)
        acc_a += smem_a.index(slot).load(layout).to(gl.float32) * x[None, :]
        if PAIRED:
            acc_b += smem_b.index(slot).load(layout).to(gl.float32) * x[None, :]
        # Every warp has read the slot before its next TMA overwrites it.
        gl.thread_barrier()
        if i + STAGES < TOTAL:
            _issue_item(w_desc, bars, smem_a, smem_b, i + STAGES, tile0, N_OUT, BLOCK_N,
                        BLOCK_K, NUM_K, STAGES, EPILOGUE, HEAD_DIM)
        if i % NUM_K == NUM_K - 1:  # a row tile's last K tile: its outputs, then the next
            _store_tile(acc_a, acc_b, sum_sq, tile0 + i // NUM_K, residual_ptr, out_ptr,
                        positions_ptr, cos_sin_ptr, N_OUT, stride_cs, eps, K, BLOCK_N,
                        HAS_NORM, EPILOGUE, HEAD_DIM, NUM_ROPE_HEADS, row_layout)
            acc_a = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
            acc_b = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
            sum_sq = gl.zeros([BLOCK_K], gl.float32, col_layout)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


@functools.cache
def _smem_layout(block_n: int, block_k: int) -> gl.NVMMASharedLayout:
    # No swizzle: rows are read whole by one warp in 16-byte vectors, which is free of
    # bank conflicts, and an unswizzled box may be 256 elements wide.
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


def descriptor(w: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """The TMA descriptor of a [rows, K] bf16/fp16 weight for tma_gemv (build once, reuse)."""
    return TensorDescriptor(w, list(w.shape), list(w.stride()), [block_n, block_k],
                            _smem_layout(block_n, block_k))


def supports(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int,
             epilogue: str, head_dim: int = 0, has_bias: bool = False) -> bool:
    """Whether tma_gemv takes this call: one bf16/fp16 row on a CUDA device of capability
    9.0+, no bias, tiles that cover the weight exactly, 16-byte aligned rows (TMA)."""
    rows, k = weight.shape
    n_out = rows // 2 if epilogue == "silu" else rows
    return (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and not has_bias and weight.is_contiguous()
            and k % block_k == 0 and (k * x.element_size()) % 16 == 0
            and weight.data_ptr() % 16 == 0
            and (n_out % block_n == 0 if epilogue != "rope"
                 else head_dim and (head_dim // 2) % block_n == 0 and rows % head_dim == 0))


def tma_gemv(x: torch.Tensor, w: torch.Tensor, w_desc: TensorDescriptor | None = None, *,
             norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
             epilogue: str = "none", residual: torch.Tensor | None = None,
             positions: torch.Tensor | None = None,
             cos_sin_cache: torch.Tensor | None = None, head_dim: int = 0,
             num_rope_heads: int = 0, out: torch.Tensor | None = None,
             block_n: int = 16, block_k: int = 256, stages: int = 4, num_warps: int = 4,
             use_pdl: bool = True, early_release: bool = False, skip_wait: bool = False,
             prefetch: bool = True, tiles_per_program: int = 1) -> torch.Tensor:
    """y = epilogue(W @ norm(x)) for one row x [1, K] and W [rows, K] (SiLU: rows =
    2 * N_OUT, gate then up; RoPE: q | k | v heads of head_dim), as gemv.gemv computes it."""
    if x.shape[0] != 1 or w.shape[1] != x.shape[1]:
        raise ValueError(f"tma_gemv takes one row x [1, K] and W [rows, K]; got x "
                         f"{tuple(x.shape)}, W {tuple(w.shape)}")
    if not supports(x, w, block_n, block_k, epilogue, head_dim):
        raise ValueError(f"tma_gemv: block_n={block_n} must divide the output rows (RoPE: "
                         f"half of head_dim={head_dim}) and block_k={block_k} the K="
                         f"{x.shape[1]} columns, of a bf16/fp16 weight on sm_90+; got W "
                         f"{tuple(w.shape)} {w.dtype}, epilogue {epilogue}")
    n_out = w.shape[0] // 2 if epilogue == "silu" else w.shape[0]
    if w_desc is None:
        # Built per call, not cached: a descriptor holds its weight, and a cache would keep
        # freed models alive. The cost is host time at eager launches only (a CUDA graph
        # keeps the launch's parameters, the encoded descriptor among them).
        w_desc = descriptor(w, block_n, block_k)
    if out is None:
        out = torch.empty(1, n_out, device=x.device, dtype=x.dtype)
    rope = epilogue == "rope"
    num_tiles = w.shape[0] // 2 // block_n if rope else n_out // block_n
    if num_tiles % tiles_per_program:
        raise ValueError(f"tma_gemv: tiles_per_program={tiles_per_program} must divide the "
                         f"{num_tiles} row tiles of {block_n} rows")
    grid = (num_tiles // tiles_per_program,)
    tma_gemv_kernel[grid](
        w_desc, x, norm_weight if norm_weight is not None else x,
        residual if residual is not None else out, out,
        positions if rope else x, cos_sin_cache if rope else x, n_out,
        cos_sin_cache.stride(0) if rope else 0, eps,
        K=x.shape[1], BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        TILES=tiles_per_program,
        HAS_NORM=norm_weight is not None, EPILOGUE=_EPILOGUES[epilogue],
        HEAD_DIM=head_dim if rope else 0, NUM_ROPE_HEADS=num_rope_heads if rope else 0,
        USE_PDL=use_pdl, EARLY_RELEASE=early_release, SKIP_WAIT=skip_wait,
        PREFETCH=prefetch, num_warps=num_warps, launch_pdl=use_pdl)
    return out
