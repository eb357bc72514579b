"""The fused GEMV kernel's building blocks (shared/model/kernels/gemv.py has the kernel and its
launcher): which weight rows a program owns, its weight and input tiles, the buffered FMA
loop for one token, and the epilogues. Inlined into the kernel: their sm_90 code is the
kernel's (scripts/gemv_ptx_fingerprint.py)."""

from __future__ import annotations

from shared.runtime.triton_utils import pdl_wait_and_release, tl, triton


@triton.jit
def program_rows(pid, N_OUT, BLOCK_N: tl.constexpr, EPILOGUE: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """The weight rows a program owns: rows_a, and for the paired epilogues rows_b (SILU:
    the up row j + I of gate row j; ROPE: dims d and d + D/2 of one head)."""
    offs = tl.arange(0, BLOCK_N)
    if EPILOGUE == 3:
        half: tl.constexpr = HEAD_DIM // 2
        head = pid // (half // BLOCK_N)
        dims = (pid % (half // BLOCK_N)) * BLOCK_N + offs
        rows_a = head * HEAD_DIM + dims
        rows_b = rows_a + half
        row_mask = offs < BLOCK_N  # the grid tiles the heads exactly
    else:
        head = pid
        dims = offs
        rows_a = pid * BLOCK_N + offs
        rows_b = rows_a + N_OUT
        row_mask = rows_a < N_OUT
    return rows_a, rows_b, row_mask, head, dims


@triton.jit
def apply_epilogue(y_a, y_b, m, rows_a, rows_b, row_mask, head, dims,
                   bias_ptr, residual_ptr, out_ptr, positions_ptr, cos_sin_ptr,
                   stride_r, stride_o, stride_cs,
                   HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   NUM_ROPE_HEADS: tl.constexpr):
    """Token m's outputs from its float32 dot products y_a, y_b [BLOCK_N]."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        y_a += tl.load(bias_ptr + rows_a, mask=row_mask, other=0.0).to(tl.float32)
        if EPILOGUE >= 2:
            y_b += tl.load(bias_ptr + rows_b, mask=row_mask, other=0.0).to(tl.float32)
    # Round to the model dtype where the unfused path's matmul output is rounded.
    y_a = y_a.to(dtype).to(tl.float32)
    y_b = y_b.to(dtype).to(tl.float32)
    out_row = out_ptr + m * stride_o
    if EPILOGUE == 0:
        tl.store(out_row + rows_a, y_a.to(dtype), mask=row_mask)
    elif EPILOGUE == 1:
        r = tl.load(residual_ptr + m * stride_r + rows_a, mask=row_mask, other=0.0)
        tl.store(out_row + rows_a, (y_a + r.to(tl.float32)).to(dtype), mask=row_mask)
    elif EPILOGUE == 2:
        act = (y_a / (1.0 + tl.exp(-y_a))).to(dtype).to(tl.float32)
        tl.store(out_row + rows_a, (act * y_b).to(dtype), mask=row_mask)
    else:
        half: tl.constexpr = HEAD_DIM // 2
        pos = tl.load(positions_ptr + m).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + dims).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * stride_cs + half + dims).to(tl.float32)
        rotate = head < NUM_ROPE_HEADS
        out_a = tl.where(rotate, y_a * cos - y_b * sin, y_a)
        out_b = tl.where(rotate, y_b * cos + y_a * sin, y_b)
        tl.store(out_row + rows_a, out_a.to(dtype))
        tl.store(out_row + rows_b, out_b.to(dtype))


@triton.jit
def fma_buffered(x_ptr, w_a, w_b, norm_w_ptr, bias_ptr, residual_ptr, out_ptr,
                 positions_ptr, cos_sin_ptr, rows_a, rows_b, row_mask, head, dims,
                 stride_r, stride_o, stride_cs, eps, K: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
                 EPILOGUE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 NUM_ROPE_HEADS: tl.constexpr, USE_PDL: tl.constexpr):
    """The FMA kernel for one token with two weight tiles in registers: each step issues
    the loads of tile k + 1 before it multiplies tile k, so a program keeps two tiles in
    flight (the FMA loop is not software-pipelined: nothing of it goes through shared
    memory). The first tile is loaded before the PDL wait. Steps past the last tile load
    nothing (all masked)."""
    PAIRED: tl.constexpr = EPILOGUE >= 2
    BLOCK_N: tl.constexpr = rows_a.shape[0]
    wa, wb = weight_tiles(w_a, w_b, 0, row_mask, K, BLOCK_K, PAIRED)
    if USE_PDL:
        pdl_wait_and_release()
    acc_a = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(BLOCK_K, K + BLOCK_K, BLOCK_K):
        wa_next, wb_next = weight_tiles(w_a, w_b, k0, row_mask, K, BLOCK_K, PAIRED)
        cols = k0 - BLOCK_K + tl.arange(0, BLOCK_K)
        x, sum_sq = x_tile_fma(x_ptr, norm_w_ptr, cols, cols < K, sum_sq, HAS_NORM)
        acc_a += wa.to(tl.float32) * x[None, :]
        if PAIRED:
            acc_b += wb.to(tl.float32) * x[None, :]
        wa, wb = wa_next, wb_next
    y_a, y_b = fma_row_sums(acc_a, acc_b, sum_sq, eps, K, HAS_NORM)
    apply_epilogue(y_a, y_b, 0, rows_a, rows_b, row_mask, head, dims,
                   bias_ptr, residual_ptr, out_ptr, positions_ptr, cos_sin_ptr,
                   stride_r, stride_o, stride_cs, HAS_BIAS, EPILOGUE, HEAD_DIM, NUM_ROPE_HEADS)


@triton.jit
def fma_row_sums(acc_a, acc_b, sum_sq, eps, K: tl.constexpr, HAS_NORM: tl.constexpr):
    """The FMA kernels' [BLOCK_N, BLOCK_K] accumulators -> each row's dot product, scaled
    by the input's rstd under NORM."""
    y_a = tl.sum(acc_a, axis=1)
    y_b = tl.sum(acc_b, axis=1)
    if HAS_NORM:
        rstd = tl.math.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
        y_a = y_a * rstd
        y_b = y_b * rstd
    return y_a, y_b


@triton.jit
def weight_tiles(w_a, w_b, k0, row_mask, K: tl.constexpr, BLOCK_K: tl.constexpr,
                 PAIRED: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of the program's rows (wb is wa when not PAIRED)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    col_mask = cols < K
    wa = weight_tile(w_a, cols, row_mask, col_mask)
    wb = wa
    if PAIRED:
        wb = weight_tile(w_b, cols, row_mask, col_mask)
    return wa, wb


@triton.jit
def first_weights_then_wait(w_a, w_b, row_mask, K: tl.constexpr, BLOCK_K: tl.constexpr,
                            PAIRED: tl.constexpr):
    """Under PDL: the first K tile of the weights (they never depend on the kernel before),
    then the wait for that kernel's output. Returns the tile's columns, their mask and the
    weight tiles (wb is wa when not PAIRED)."""
    wa, wb = weight_tiles(w_a, w_b, 0, row_mask, K, BLOCK_K, PAIRED)
    pdl_wait_and_release()
    cols = tl.arange(0, BLOCK_K)
    return cols, cols < K, wa, wb


@triton.jit
def weight_tile(w_rows, cols, row_mask, col_mask):
    """[BLOCK_N, len(cols)] of the weight: w_rows points at each row's first element.
    Loaded evict-first from L2: a weight is read once per step, so it should not push out
    the activations, partials and KV that the next kernels read back (on the H200 this beat
    no hint and L2-only .cg loads in the llama-3-8b batch-1 step:
    docs/results/raw/98ef088/h200_decode_llama3_8b_weight_hint.json)."""
    mask = row_mask[:, None] & col_mask[None, :]
    return tl.load(w_rows + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")

@triton.jit
def x_tile_fma(x_row, norm_w_ptr, cols, col_mask, sum_sq, HAS_NORM: tl.constexpr):
    """One token's input columns in float32, times the norm weight; sum x^2 accumulates."""
    x = tl.load(x_row + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        sum_sq += x * x
        x = x * tl.load(norm_w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    return x, sum_sq


@triton.jit
def x_tile_dot(x_ptr, w_ptr, norm_w_ptr, offs_m, stride_x, cols, col_mask, sum_sq,
               M: tl.constexpr, HAS_NORM: tl.constexpr):
    """[BLOCK_K, BLOCK_M] of the token rows (rows past M are 0), times the norm weight and
    back in the weight's dtype for tl.dot; sum x^2 per token accumulates."""
    xt = tl.load(x_ptr + offs_m[None, :] * stride_x + cols[:, None],
                 mask=(offs_m < M)[None, :] & col_mask[:, None], other=0.0)
    if HAS_NORM:
        xf = xt.to(tl.float32)
        sum_sq += tl.sum(xf * xf, axis=0)
        g = tl.load(norm_w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        xt = (xf * g[:, None]).to(w_ptr.dtype.element_ty)
    return xt, sum_sq


@triton.jit
def dot_acc(w, xt, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(w, xt, acc, input_precision="ieee")
    return tl.dot(w, xt, acc)
