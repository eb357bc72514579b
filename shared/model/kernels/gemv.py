"""Small-batch weight GEMVs with the decoder's neighbouring ops fused in (the CUDA path).

At batch 1 a decode step is weight streaming: every GEMV reads its whole matrix once for
one activation row. On the H200, cuBLAS streams the small llama-3-8b matrices (qkv,
o_proj) well below the read bandwidth (docs/results/raw/1f85703/h200_gemv.log) and splits
K behind an extra reduction kernel, and each of the decoder's ~13 kernels per layer pays
launch latency and a tail. Here a
program owns BLOCK_N output rows over the whole of K (each weight row read once, no
split-K), with FMAs (kernel 0), FMAs over a register double buffer (kernel 2, one token
row) or a tensor-core dot against the token rows padded to 16 (kernel
1); the table below picks per shape. Their sm_90 code, compiled with the 16-byte pointer
alignment a launch specialises on: the dot kernel streams the weights through a
num_stages-deep shared-memory pipeline (cp.async); the FMA kernels use 16-byte vector
loads straight to registers (Triton does not software-pipeline them), so kernel 0 gets its
bandwidth from many programs in flight, and kernel 2 also from issuing the loads of tile
k + 1 before it multiplies tile k (on the H200 it streams llama's down_proj faster than the
best single-buffered config: docs/results/raw/77684d6/h200_gemv_variants.log). None uses
TMA. Under PDL a program loads its
first weight tile before it waits for the previous kernel. Weight loads are evict-first
(gemv_tiles.weight_tile). The ops around a GEMV ride along in its prologue or epilogue:

- NORM prologue: RMSNorm of the input, folded into the dot product:
  y = rstd * sum_k W[n, k] * (x_k * g_k), with sum_k x_k^2 accumulated in the same pass,
  so the norm costs no extra kernel and no extra pass. (The unfused path rounds the
  normalised row to the model dtype before the matmul; this one keeps it in float32 -
  the same value up to bf16 rounding, identical math in float32.)
- RESIDUAL epilogue: out = round(round(y) + residual), the unfused `x + residual`.
- SILU epilogue (gate|up weight): out[j] = round(silu(round(gate_j))) * round(up_j).
- ROPE epilogue (q|k|v weight): a program owns rows (d, d + D/2) of one head, the pairs
  neox RoPE rotates together, and rotates q and k heads in float32 at `positions`.

Each kernel is one launch whose grid depends only on the weight shape and the token count,
and nothing is read back to the host: CUDA-graph capturable. The launch configuration per
(device, variant, shape) comes from gemv_configs.json, written on that device by
scripts/bench_gemv.py (each shape alone), then for llama-3-8b's four layer GEMVs by
scripts/tune_gemv_in_step.py (inside the decode step; bench_gemv_variants.py, which times
them in a chain, can write too): measured, not guessed; shapes it lacks get a default.
A config is (BLOCK_N, BLOCK_K, num_warps, num_stages[, kernel[, 1]]), kernel 0 by
default; the sixth field, kept for the table's format, is always 1 (preload; the variant
that waited before its first tile was removed, as were the triple-buffered FMA kernel 3
and the other weight-load cache hints: docs/journal has their measurements).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from shared.model.kernels import fused_ops
from shared.model.kernels.gemv_tiles import (
    apply_epilogue,
    dot_acc,
    first_weights_then_wait,
    fma_buffered,
    fma_row_sums,
    program_rows,
    weight_tile,
    x_tile_dot,
    x_tile_fma,
)
from shared.runtime.kernel_options import kernel_options
from shared.runtime.triton_utils import pdl_launch, tl, triton

# KernelOptions.gemv_max_tokens (default 1): token counts up to it take the GEMV path. With
# the M=1 configs a layer's fused GEMVs gain little over cuBLAS + separate kernels at 2-8
# rows and lose at 16 (docs/results/raw/1f85703/h200_gemv.log), so one row (batch-1 decode) is where
# they pay. KernelOptions.gemv = False: cuBLAS + separate kernels.

_EPILOGUES = {"none": 0, "residual": 1, "silu": 2, "rope": 3}
_CONFIG_FILE = Path(__file__).with_name("gemv_configs.json")
# (BLOCK_N, BLOCK_K, num_warps, num_stages, kernel) when the table has no entry: one
# token row, and more: the tensor-core kernel, which reads the weights once for all rows
# and was the fastest kernel at 4 rows on every llama-3-8b shape
# (docs/results/raw/a5e84ee/h100_gemv_m4.log); the FMA kernel reads them once per row.
_DEFAULT_CONFIG = (16, 512, 4, 3, 0)
_DEFAULT_ROWS_CONFIG = (64, 256, 4, 3, 1)
# float32 weights: half the K tile, the same shared-memory bytes a pipeline stage
_DEFAULT_ROWS_CONFIG_FP32 = (64, 128, 4, 3, 1)


def use_gemv(x: torch.Tensor) -> bool:
    """The dispatch rule: CUDA, fused kernels and GEMVs on, at most gemv_max_tokens rows
    (the engine's KernelOptions), a float type the kernels reduce in float32. Never in
    batch-invariant mode: a row's GEMV result differs from its result at more rows."""
    options = kernel_options()
    return (
        options.gemv
        and not options.batch_invariant
        and fused_ops.use_fused(x)
        and 0 < x.shape[0] <= options.gemv_max_tokens
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K], unit last stride
    w_ptr,  # [rows, K] row-major (nn.Linear's layout)
    bias_ptr,  # [rows]; read only when HAS_BIAS
    norm_w_ptr,  # [K]; read only when HAS_NORM
    residual_ptr,  # [M, N_OUT]; read only by the RESIDUAL epilogue
    out_ptr,  # [M, N_OUT]
    positions_ptr,  # int [M]; read only by the ROPE epilogue
    cos_sin_ptr,  # [max_position, HEAD_DIM]: cos | sin; read only by ROPE
    N_OUT,  # output columns (SILU: the intermediate size; its weight has 2 * N_OUT rows)
    stride_x, stride_r, stride_o, stride_cs,
    eps,
    K: tl.constexpr,
    M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,  # tensor-core dot over the tokens padded to BLOCK_M, else FMAs
    BLOCK_M: tl.constexpr,  # USE_DOT: M rounded up to a power of two >= 16
    IEEE: tl.constexpr,  # USE_DOT on float32: exact products, not TF32
    HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    EPILOGUE: tl.constexpr,  # 0 none, 1 residual, 2 silu, 3 rope
    HEAD_DIM: tl.constexpr,  # ROPE only
    NUM_ROPE_HEADS: tl.constexpr,  # ROPE: q + k heads (rotated); the v heads after are not
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (sm_90+)
    BUFFERED_FMA: tl.constexpr = False,  # FMA, M = 1: two weight tiles in flight
):
    rows_a, rows_b, row_mask, head, dims = program_rows(
        tl.program_id(0), N_OUT, BLOCK_N, EPILOGUE, HEAD_DIM)
    PAIRED: tl.constexpr = EPILOGUE >= 2
    w_a = w_ptr + rows_a[:, None].to(tl.int64) * K
    w_b = w_ptr + rows_b[:, None].to(tl.int64) * K
    if USE_DOT:
        # All tokens in one pass over the weight: [BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M].
        offs_m = tl.arange(0, BLOCK_M)
        acc_a = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        start = 0
        if USE_PDL:
            # The loop's first step, with the weight load moved ahead of the PDL wait.
            cols, col_mask, wa, wb = first_weights_then_wait(w_a, w_b, row_mask, K, BLOCK_K,
                                                             PAIRED)
            xt, sum_sq = x_tile_dot(x_ptr, w_ptr, norm_w_ptr, offs_m, stride_x, cols,
                                    col_mask, sum_sq, M, HAS_NORM)
            acc_a = dot_acc(wa, xt, acc_a, IEEE)
            if PAIRED:
                acc_b = dot_acc(wb, xt, acc_b, IEEE)
            start = BLOCK_K
        for k0 in range(start, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < K
            xt, sum_sq = x_tile_dot(x_ptr, w_ptr, norm_w_ptr, offs_m, stride_x, cols,
                                    col_mask, sum_sq, M, HAS_NORM)
            acc_a = dot_acc(weight_tile(w_a, cols, row_mask, col_mask), xt, acc_a, IEEE)
            if PAIRED:
                acc_b = dot_acc(weight_tile(w_b, cols, row_mask, col_mask), xt, acc_b,
                                IEEE)
        if HAS_NORM:
            rstd = tl.math.rsqrt(sum_sq / K + eps)
            acc_a = acc_a * rstd[None, :]
            acc_b = acc_b * rstd[None, :]
        for m in tl.static_range(M):
            pick = offs_m[None, :] == m
            y_a = tl.sum(tl.where(pick, acc_a, 0.0), axis=1)
            y_b = tl.sum(tl.where(pick, acc_b, 0.0), axis=1)
            apply_epilogue(y_a, y_b, m, rows_a, rows_b, row_mask, head, dims,
                           bias_ptr, residual_ptr, out_ptr, positions_ptr, cos_sin_ptr,
                           stride_r, stride_o, stride_cs,
                           HAS_BIAS, EPILOGUE, HEAD_DIM, NUM_ROPE_HEADS)
    elif BUFFERED_FMA:
        fma_buffered(x_ptr, w_a, w_b, norm_w_ptr, bias_ptr, residual_ptr, out_ptr,
                     positions_ptr, cos_sin_ptr, rows_a, rows_b, row_mask, head, dims,
                     stride_r, stride_o, stride_cs, eps, K, BLOCK_K, HAS_BIAS,
                     HAS_NORM, EPILOGUE, HEAD_DIM, NUM_ROPE_HEADS, USE_PDL)
    else:
        # FMAs per token: the weight tile is re-read (from L2) for every token after the
        # first, so this is for M = 1. (Keeping one accumulator per token row instead, and
        # the weights streamed once, lost to the dot kernel on every llama-3-8b shape at 4
        # rows: docs/journal/2026-12-07-verify-attention-and-kept-launches.md.)
        for m in tl.static_range(M):
            acc_a = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_b = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
            x_row = x_ptr + m * stride_x
            start = 0
            if USE_PDL and m == 0:  # see the dot branch
                cols, col_mask, wa, wb = first_weights_then_wait(w_a, w_b, row_mask, K,
                                                                 BLOCK_K, PAIRED)
                x, sum_sq = x_tile_fma(x_row, norm_w_ptr, cols, col_mask, sum_sq, HAS_NORM)
                acc_a += wa.to(tl.float32) * x[None, :]
                if PAIRED:
                    acc_b += wb.to(tl.float32) * x[None, :]
                start = BLOCK_K
            for k0 in range(start, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                col_mask = cols < K
                x, sum_sq = x_tile_fma(x_row, norm_w_ptr, cols, col_mask, sum_sq, HAS_NORM)
                acc_a += (weight_tile(w_a, cols, row_mask, col_mask).to(tl.float32)
                          * x[None, :])
                if PAIRED:
                    acc_b += (weight_tile(w_b, cols, row_mask, col_mask).to(tl.float32)
                              * x[None, :])
            y_a, y_b = fma_row_sums(acc_a, acc_b, sum_sq, eps, K, HAS_NORM)
            apply_epilogue(y_a, y_b, m, rows_a, rows_b, row_mask, head, dims,
                           bias_ptr, residual_ptr, out_ptr, positions_ptr, cos_sin_ptr,
                           stride_r, stride_o, stride_cs,
                           HAS_BIAS, EPILOGUE, HEAD_DIM, NUM_ROPE_HEADS)


@functools.cache
def _device_name(index: int) -> str:
    """Cached: the launcher asks on every eager launch, and the name never changes."""
    return torch.cuda.get_device_name(index)


@functools.cache
def _config_table(device_name: str) -> dict[str, list[int]]:
    if not _CONFIG_FILE.exists():
        return {}
    return json.loads(_CONFIG_FILE.read_text()).get(device_name, {})


def config_key(epilogue: str, has_norm: bool, rows: int, k: int, m: int,
               dtype: torch.dtype) -> str:
    # The dtype is part of the key: a tile tuned for bf16 may not fit shared memory in fp32.
    return f"{epilogue}{'+norm' if has_norm else ''}:{rows}x{k}:m{m}:{str(dtype)[6:]}"


def table_config(table: dict[str, list[int]], key: str) -> tuple[int, ...]:
    """The table's config for `key`; for a row count above one that it lacks, the config
    of the most rows below it, above one, that it has for the same shape and dtype (never
    the one-row tile: tuned for the FMA kernels at one row); else the default."""
    if key in table:
        return tuple(table[key])
    shape, rows, dtype = key.rsplit(":", 2)  # config_key's layout
    if int(rows[1:]) == 1:
        return _DEFAULT_CONFIG
    for fewer in range(int(rows[1:]) - 1, 1, -1):
        found = table.get(f"{shape}:m{fewer}:{dtype}")
        if found is not None:
            return tuple(found)
    return _DEFAULT_ROWS_CONFIG_FP32 if dtype == "float32" else _DEFAULT_ROWS_CONFIG


def _config_for(x: torch.Tensor, key: str, override) -> tuple[int, int, int, int, int, int]:
    if override is None:
        override = kernel_options().gemv_config(key)  # a benchmark's or tuner's choice
    if override is not None:
        config = tuple(override)
    elif not x.is_cuda:
        config = _DEFAULT_CONFIG
    else:
        config = table_config(_config_table(_device_name(x.device.index or 0)), key)
    config = config + (0,) * (5 - len(config))  # 4-tuples: the FMA kernel
    config = config + (1,) * (6 - len(config))
    if config[4] not in (0, 1, 2) or config[5] != 1:
        raise ValueError(f"GEMV config {config} for {key}: kernel must be 0 (FMA), 1 (dot) or "
                         "2 (double-buffered FMA) and the sixth field 1 (the removed variants: "
                         "kernel 3, preload 0)")
    return config


def gemv(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [rows, K]
    bias: torch.Tensor | None = None,  # [rows]
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: RMSNorm the input first
    eps: float = 0.0,
    epilogue: str = "none",  # none | residual | silu | rope
    residual: torch.Tensor | None = None,  # [M, rows] (RESIDUAL)
    positions: torch.Tensor | None = None,  # int [M] (ROPE)
    cos_sin_cache: torch.Tensor | None = None,  # [max_position, head_dim] (ROPE)
    head_dim: int = 0,  # ROPE
    num_rope_heads: int = 0,  # ROPE: leading heads to rotate (q and k)
    config: tuple | None = None,  # (BLOCK_N, BLOCK_K, warps, stages[, kernel[, 1]])
) -> torch.Tensor:
    """out = epilogue(norm?(x) @ weight.T + bias): [M, rows], or [M, rows / 2] for SILU.
    One launch."""
    assert epilogue in _EPILOGUES, epilogue
    num_tokens, k = x.shape
    rows = weight.shape[0]
    assert weight.shape == (rows, k) and weight.is_contiguous(), (weight.shape, k)
    assert x.stride(-1) == 1 and x.dtype == weight.dtype, (x.stride(), x.dtype, weight.dtype)
    assert bias is None or (bias.shape == (rows,) and bias.is_contiguous())
    assert norm_weight is None or (norm_weight.shape == (k,) and norm_weight.is_contiguous())
    n_out = rows // 2 if epilogue == "silu" else rows
    out = torch.empty(num_tokens, n_out, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    key = config_key(epilogue, norm_weight is not None, rows, k, num_tokens, x.dtype)
    block_n, block_k, num_warps, num_stages, kernel, _ = _config_for(x, key, config)
    use_dot = kernel == 1
    buffered_fma = kernel == 2 and num_tokens == 1  # two weight tiles in flight, one row
    if use_dot:
        block_n = max(block_n, 16)  # tl.dot's smallest tile
    if epilogue == "rope":
        half = head_dim // 2
        block_n = min(block_n, half & -half)  # a power of two that tiles a half head
        use_dot = use_dot and block_n >= 16
        assert rows % head_dim == 0 and half % block_n == 0, (rows, head_dim, block_n)
        assert cos_sin_cache.shape[1] == head_dim and cos_sin_cache.stride(1) == 1
        assert positions.shape == (num_tokens,)
        grid = (rows // head_dim * (head_dim // 2 // block_n),)
    else:
        assert epilogue != "silu" or rows % 2 == 0
        grid = (triton.cdiv(n_out, block_n),)
    if epilogue == "residual":
        assert residual.shape == out.shape and residual.stride(-1) == 1, residual.shape
    extra = {"num_warps": num_warps, "num_stages": num_stages} if x.is_cuda else {}
    # launched while the previous kernel drains where PDL is on; see pdl_wait_and_release
    extra.update(pdl_launch(x))
    _gemv_kernel[grid](
        x, weight, x if bias is None else bias, x if norm_weight is None else norm_weight,
        x if residual is None else residual, out,
        x if positions is None else positions, x if cos_sin_cache is None else cos_sin_cache,
        n_out,
        x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        0 if cos_sin_cache is None else cos_sin_cache.stride(0),
        eps,
        K=k, M=num_tokens, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
        BUFFERED_FMA=buffered_fma,
        BLOCK_M=max(16, triton.next_power_of_2(num_tokens)), IEEE=x.dtype == torch.float32,
        HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None,
        EPILOGUE=_EPILOGUES[epilogue], HEAD_DIM=head_dim, NUM_ROPE_HEADS=num_rope_heads,
        **extra,
    )
    return out
