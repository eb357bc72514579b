"""The batch-invariant matmul (issue 26): y = x W^T (+ b) with a per-element reduction order
that depends on the weight's shape and dtype alone.

cuBLAS picks its algorithm (tile shape, split-K, stream-K) by the row count M, and the GEMV
path (shared.model.kernels.gemv) takes over at small M, so a token's logits differ bitwise
between batch 1 and batch 64. Batch-invariant mode needs each row's result to be a
function of that row and the weight only: not of M, of the row's position, of padding or
of the other rows. This kernel gets that by construction:

- The tile: up to SMALL_ROWS rows, BLOCK_M 16 (tl.dot's smallest tile) with BLOCK_N and
  BLOCK_K from `invariant_config(N, K, dtype, device)`: the decode steps' weight
  streaming; up to MEDIUM_ROWS, 64-row tiles sized by `medium_config` (decode batches);
  above, TALL_CONFIG's 128 x 128 tiles (wgmma on sm_90), which prefill needs: at BLOCK_M 16
  an 8192-row GEMM ran several times cuBLAS's time on the H200
  (docs/results/raw/1f8faa0/h200_bi_matmul_block_m16_only.json). Tile shape changes which
  program computes an element, not its order: on the H200 a 16-, 32-, 64- and 128-row
  tile (mma.sync and wgmma) and other BLOCK_N / BLOCK_K gave every element bitwise the
  same on llama-3-8b's five shapes (scripts/bench_batch_invariant_matmul.py), on the H100
  all 96 tiles of scripts/sweep_bi_matmul_medium.py on qwen3-0.6b's five (docs/results/
  raw/ for the runs), and the GPU needle tests cross both boundaries. A new GPU must pass
  them again before the rule holds there. `block_m` forces a tile height (the
  experiment's); the engine never passes it. M is not specialised on (one binary per
  tile for every row count).
- Each program walks K once, in increasing k, with the accumulator threaded through the
  dot (`acc = tl.dot(a, b, acc=acc)`), so an element's sum is one chain of MMA k-steps
  whatever BLOCK_K is (sm_90: mma.sync m16n8k16 for bf16/fp16, m8n8k4 for fp64; the fp32
  "ieee" dot is FMAs on CUDA cores). No split-K, no atomics: nothing else ever adds into
  an element.
- Edges are masked loads with other=0: rows past M, columns past N and k past K read
  zeros, and a row of the MMA never mixes with another row.

Accumulation is float32 (float64 for float64 inputs); the bias joins in the epilogue in
that dtype, and the sum is rounded to x.dtype once: y = round(acc + b). (The CPU F.linear
of a row rounds x W^T before adding b; the two differ by at most a rounding.)

The grid depends on the shapes only and nothing is read back to the host, so a launch is
CUDA-graph capturable. No autotuning (it does not run under the interpreter, and a tuned
choice would have to be pinned per shape anyway).

Under the Triton interpreter (no CUDA) the same kernel runs on CPU tensors: bf16 tiles
are upcast to float32 (the interpreter's bf16 arithmetic is garbage) and the float32 result
rounded to bf16 by torch (the interpreter truncates; the GPU rounds to nearest even). There
tl.dot is numpy's matmul, and this container's OpenBLAS float32 GEMM gives a row of a
16-row tile other bits by its position (rows 6-11 differ from rows 0-5); its float64 GEMM
does not. So on the CPU the kernel is invariant in float64 only, which is what its CPU
test checks; the bf16 and float32 forms are checked on the GPU
(tests/gpu/shared/model/kernels/test_batch_invariant_matmul_gpu.py). For a model on the
CPU, shared.model.kernels.batch_invariant_cpu (torch's GEMM on fixed 16-row tiles) is
invariant in float32 too, and far faster than the interpreter.
"""

from __future__ import annotations

import torch

from shared.runtime.triton_utils import INTERPRET, next_power_of_2, tl, triton

BLOCK_M = 16  # every row count: see the module docstring
_BLOCK_NS = (64, 32, 16)  # the widest that still gives MIN_PROGRAMS column blocks
# Column blocks a weight needs at M = 1 to stream at the read bandwidth: llama-3-8b's
# o_proj (N = 4096) streams at BLOCK_N 64 (64 blocks) as fast as at 32 on the H200
# (scripts/sweep_bi_matmul_decode.py; docs/results/ for the run), so 64 blocks suffice.
MIN_PROGRAMS = 64
# Under the interpreter a program's cost is Python per op: few, wide programs; 64 still
# leaves a test's N and K of a few hundred several tiles (partial last ones included).
_INTERPRETER_CONFIG = (64, 64, 4, 1)
# Shared memory the pipeline's stages may take (the H200 gives a block 227 KiB; the rest is
# headroom for the dot's layout conversions). Binds only for the experiment's tall tiles.
_SMEM_BUDGET = 160 * 1024
_MAX_GRID_Y = 65535  # CUDA's limit on grid dimension 1 (the N blocks)
# Above SMALL_ROWS rows, 2-byte types take 64-row tiles (medium_config), above MEDIUM_ROWS
# the tall tiles: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). fp32/fp64 keep the
# small tiles at every M: their exact dots run on CUDA cores.
SMALL_ROWS = 16
MEDIUM_ROWS = 512
TALL_CONFIG = (128, 128, 64, 8, 3)
# 64-row tiles between them. 16-row tiles read the weight once per 16 rows, 128 x 128 tiles
# leave a small model's weight a few dozen programs (qwen3-0.6b's o_proj at 256 rows: 16).
# BLOCK_N: the widest of MEDIUM_BLOCK_NS that still gives MEDIUM_MIN_PROGRAMS programs;
# BLOCK_K 128 beside 32 columns, 64 beside wider tiles (the 4 stages of a 64 x 128 x 128
# tile would not overlap in _SMEM_BUDGET). Chosen from the H100 sweep of qwen3-0.6b's GEMMs
# at 64 and 256 rows (scripts/sweep_bi_matmul_medium.py; docs/results/ for the run): near
# the best of its 96 tiles per shape, summed over a step, and ahead of the 16-row tiles at
# 64 rows and of the 64 x 16..64 tiles with 64-column K steps at 256.
MEDIUM_BLOCK_M = 64
MEDIUM_BLOCK_NS = (128, 64, 32)
MEDIUM_MIN_PROGRAMS = 256
MEDIUM_LAUNCH = (4, 4)  # num_warps, num_stages


def invariant_config(n: int, k: int, dtype: torch.dtype,
                     device: torch.device | str) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a weight of n rows by k columns.

    A function of the weight's shape and dtype and of the device, never of the row count,
    so every M runs the same binary. BLOCK_N: the widest of 64/32/16 that still gives
    MIN_PROGRAMS column blocks, else 16. BLOCK_K (clipped to K): 128 for 2-byte types with
    6 stages in flight (the H200 sweep's best near M = 1 and M = 64 together on
    llama-3-8b's shapes), 32 for fp32/fp64, whose exact dots keep their operands in
    registers. Every config the sweep tried gave the same bits (the order of an element's
    k-steps does not depend on the tile), so this is a speed choice only."""
    device = torch.device(device)
    if INTERPRET or device.type != "cuda":
        return _INTERPRETER_CONFIG
    block_n = next((b for b in _BLOCK_NS if triton.cdiv(n, b) >= MIN_PROGRAMS), _BLOCK_NS[-1])
    wide = dtype.itemsize >= 4
    block_k = min(32 if wide else 128, max(16, next_power_of_2(k)))
    return block_n, block_k, 4, 3 if wide else 6


def medium_config(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of a 64-row tile for m rows of a 2-byte
    type, SMALL_ROWS < m <= MEDIUM_ROWS (the constants above say why). A speed choice:
    the tile does not change the bits, so it may follow m."""
    row_blocks = triton.cdiv(m, MEDIUM_BLOCK_M)
    block_n = next((b for b in MEDIUM_BLOCK_NS
                    if row_blocks * triton.cdiv(n, b) >= MEDIUM_MIN_PROGRAMS),
                   MEDIUM_BLOCK_NS[-1])
    block_k = min(128 if block_n == 32 else 64, max(16, next_power_of_2(k)))
    return block_n, block_k, *MEDIUM_LAUNCH


def _dot_dtype(dtype: torch.dtype):
    """What tl.dot sees: the input dtype, except bf16 under the interpreter (upcast)."""
    if dtype == torch.bfloat16:
        return tl.float32 if INTERPRET else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32,
            torch.float64: tl.float64}[dtype]


@triton.jit
def _mma_step(a, b, acc, IEEE: tl.constexpr):
    # The accumulator goes into the dot (not `acc += dot`): one chain of MMA k-steps.
    if IEEE:
        return tl.dot(a, b, acc=acc, input_precision="ieee")  # exact products, no tf32
    return tl.dot(a, b, acc=acc)


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr,  # [M, K], unit last stride
    w_ptr,  # [N, K], unit last stride (nn.Linear's layout)
    bias_ptr,  # [N]; read only when HAS_BIAS
    out_ptr,  # [M, N], contiguous
    M, N, K,
    stride_xm, stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC_DTYPE)
    for k0 in range(0, K, BLOCK_K):  # increasing k, every program the same steps
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks[None, :] < K
        # zeros past the edges: a padded row, column or k adds nothing to a real element
        a = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask, other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask, other=0.0)
        acc = _mma_step(a.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, IEEE)
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=col_mask, other=0.0)
        acc = acc + b[None, :].to(ACC_DTYPE)  # in the accumulator dtype, then one rounding
    out = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _fit_stages(stages: int, block_m: int, block_n: int, block_k: int, itemsize: int) -> int:
    """Fewer pipeline stages where both tiles' copies would overflow shared memory: a no-op
    at BLOCK_M 16 for every config above, needed by the experiment's 128-row tiles. Stages
    move loads earlier; they do not change what is summed, or in what order."""
    per_stage = (block_m + block_n) * block_k * itemsize
    return max(1, min(stages, _SMEM_BUDGET // per_stage))


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     *, block_m: int | None = None) -> torch.Tensor:
    """y = x W^T (+ b): x [..., K], weight [N, K] -> [..., N] in x.dtype, each row's bits a
    function of that row and the weight alone. One launch.

    `block_m` is for scripts/bench_batch_invariant_matmul.py's experiment only (do other
    tile heights change the bits?); the engine never passes it, and a value chosen from the
    row count would break the invariance this function exists for."""
    k = x.shape[-1]
    n = weight.shape[0]
    assert weight.dim() == 2 and weight.shape[1] == k, (x.shape, weight.shape)
    assert weight.stride(-1) == 1, f"weight needs a unit last stride, got {weight.stride()}"
    assert x.dtype == weight.dtype and x.device == weight.device, (x.dtype, weight.dtype)
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64), x.dtype
    assert x.is_cuda or INTERPRET, "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous(), bias.shape
        assert bias.dtype == x.dtype and bias.device == x.device, bias.dtype
    assert block_m is None or (block_m >= 16 and block_m == next_power_of_2(block_m)), block_m
    lead = x.shape[:-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    # The interpreter rounds float32 -> bf16 by truncation: store float32, let torch round.
    interpreted_bf16 = INTERPRET and x.dtype == torch.bfloat16
    out = torch.empty((m, n), dtype=torch.float32 if interpreted_bf16 else x.dtype,
                      device=x.device)
    if m > 0 and n > 0:
        if block_m is None:
            block_m, config = _tile(m, n, k, x)
        else:
            config = invariant_config(n, k, x.dtype, x.device)
        _launch(rows, weight, bias, out, config, block_m)
    return out.to(x.dtype).reshape(*lead, n)


def _tile(m: int, n: int, k: int, x: torch.Tensor) -> tuple[int, tuple[int, int, int, int]]:
    """(BLOCK_M, launch config) for m rows: the small tiles, or for 2-byte types on CUDA
    the medium and tall ones (the module docstring)."""
    if m > SMALL_ROWS and x.is_cuda and not INTERPRET and x.element_size() == 2:
        if m > MEDIUM_ROWS:
            return TALL_CONFIG[0], TALL_CONFIG[1:]
        return MEDIUM_BLOCK_M, medium_config(m, n, k)
    return BLOCK_M, invariant_config(n, k, x.dtype, x.device)


def _launch(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor, config: tuple[int, int, int, int], block_m: int):
    """One launch with an explicit config: invariant_linear's, or the experiment's (which
    reads the compiled kernel this returns, to name the MMA instruction it used)."""
    (m, k), n = rows.shape, weight.shape[0]
    block_n, block_k, num_warps, num_stages = config
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    assert grid[1] <= _MAX_GRID_Y, f"N = {n} needs more than {_MAX_GRID_Y} column blocks"
    launch = {}
    if rows.is_cuda and not INTERPRET:
        stages = _fit_stages(num_stages, block_m, block_n, block_k, rows.element_size())
        launch = {"num_warps": num_warps, "num_stages": stages}
    return _invariant_matmul_kernel[grid](
        rows, weight, rows if bias is None else bias, out,
        m, n, k,
        rows.stride(0), weight.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=_dot_dtype(rows.dtype),
        ACC_DTYPE=tl.float64 if rows.dtype == torch.float64 else tl.float32,
        IEEE=rows.dtype in (torch.float32, torch.float64),
        HAS_BIAS=bias is not None,
        **launch,
    )
