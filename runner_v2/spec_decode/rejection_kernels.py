"""Triton kernels of the V2 rejection sampler (host side: rejection_sampler.py).

Layout: request b owns logit rows cu[b] .. cu[b + 1] - 1 (k_b + 1 of them); row j's
state row is expanded_idx_mapping[j], its draft draft[j] (ignored on a request's last
row), its draft distribution q row j (when given). Grids are (N,), (N, max_k + 1) or
(N, vocab blocks): they depend on shapes only, never on device values (CUDA graphs; no
host sync). Programs past a request's rows do nothing.

Numerics follow tests/oracles/rejection_reference.py operation by operation: scaled in
the compute dtype (div_ieee), p = e / Z in float64 with e = exp(float64(scaled) -
float64(max scaled)) on the keep set, w_i = min((w_{i-1} * p(d)) / q(d), 1),
h_i = S_i / (S_i + (1 - w_i)), the exponential race r / E. Launch with
enable_fp_fusion=False: a fused multiply-add would round once where the reference
rounds twice (w * p - q).
"""

from __future__ import annotations

from runner_v2.sample.gumbel import div_ieee, load_logits
from shared.runtime.triton_utils import tl, triton
from shared.sampling.noise_kernels import acceptance_uniform, exponential_noise, row_lanes

STANDARD = tl.constexpr(0)
SYNTHETIC = tl.constexpr(1)
BLOCK_VERIFY = tl.constexpr(2)


@triton.jit
def _scaled(row_ptr, offs, valid, temp, IS_FP64: tl.constexpr):
    x = load_logits(row_ptr, offs, valid, IS_FP64)  # -inf past the vocabulary
    return div_ieee(x, temp.to(x.dtype), IS_FP64)


@triton.jit
def _threshold(thr_ptr, j, HAS_THRESHOLD: tl.constexpr):
    if HAS_THRESHOLD:
        thr = tl.load(thr_ptr + j)
    else:
        thr = float("-inf")
    return thr


@triton.jit
def _probs(row_ptr, offs, valid, temp, thr, lmax64, z, IS_FP64: tl.constexpr):
    """p over one block of the row: e / Z on the keep set, 0 elsewhere (and past V)."""
    scaled = _scaled(row_ptr, offs, valid, temp, IS_FP64)
    keep = valid & (scaled >= thr)
    return tl.where(keep, tl.exp(scaled.to(tl.float64) - lmax64), 0.0) / z


@triton.jit
def _draft_probs(q_row_ptr, offs, valid, draft, HAS_Q: tl.constexpr):
    """q over one block: the draft model's row, or one-hot at the draft."""
    if HAS_Q:
        q = tl.load(q_row_ptr + offs, mask=valid, other=0.0)
    else:
        q = tl.where(offs == draft, 1.0, 0.0).to(tl.float64)
    return q


@triton.jit
def _row_stats_kernel(
    logits_ptr, logits_stride,  # [M, V]
    idx_ptr,  # int32 [M]: logit row -> state row
    cu_ptr,  # int32 [N + 1]
    draft_ptr,  # int64 [M]
    q_ptr,  # float64 [M, V] (read iff HAS_Q)
    temperature_ptr,  # float32 [R]
    thr_ptr,  # [M] compute dtype (read iff HAS_THRESHOLD)
    lmax_ptr, z_ptr, p_d_ptr, q_d_ptr,  # float64 [M] out
    vocab_size,
    BLOCK: tl.constexpr, HAS_Q: tl.constexpr, HAS_THRESHOLD: tl.constexpr,
    IS_FP64: tl.constexpr,
):
    """Per random row: max scaled, Z = sum of e over the keep set; per draft row also
    p(d) and q(d)."""
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    end = tl.load(cu_ptr + b + 1)
    j = start + tl.program_id(1)
    if j < end:
        temp = tl.load(temperature_ptr + tl.load(idx_ptr + j))
        if temp != 0:
            row_ptr = logits_ptr + j.to(tl.int64) * logits_stride
            thr = _threshold(thr_ptr, j, HAS_THRESHOLD)
            lmax = tl.max(_scaled(row_ptr, tl.arange(0, BLOCK), tl.arange(0, BLOCK) < vocab_size,
                                  temp, IS_FP64), 0)
            for v0 in range(BLOCK, vocab_size, BLOCK):
                offs = v0 + tl.arange(0, BLOCK)
                lmax = tl.maximum(lmax, tl.max(_scaled(row_ptr, offs, offs < vocab_size, temp,
                                                       IS_FP64), 0))
            lmax64 = lmax.to(tl.float64)
            z = tl.zeros([], tl.float64)
            for v0 in range(0, vocab_size, BLOCK):
                offs = v0 + tl.arange(0, BLOCK)
                scaled = _scaled(row_ptr, offs, offs < vocab_size, temp, IS_FP64)
                keep = (offs < vocab_size) & (scaled >= thr)
                z += tl.sum(tl.where(keep, tl.exp(scaled.to(tl.float64) - lmax64), 0.0), 0)
            tl.store(lmax_ptr + j, lmax64)
            tl.store(z_ptr + j, z)
            if j < end - 1:
                d = tl.load(draft_ptr + j)
                scaled_d = div_ieee(load_logits(row_ptr, d, d >= 0, IS_FP64), temp.to(lmax.dtype),
                                    IS_FP64)
                e_d = tl.where(scaled_d >= thr, tl.exp(scaled_d.to(tl.float64) - lmax64), 0.0)
                tl.store(p_d_ptr + j, e_d / z)
                if HAS_Q:
                    tl.store(q_d_ptr + j, tl.load(q_ptr + j.to(tl.int64) * vocab_size + d))
                else:
                    tl.store(q_d_ptr + j, tl.full([], 1.0, tl.float64))


@triton.jit
def _block_weights_kernel(
    idx_ptr, cu_ptr, temperature_ptr,
    p_d_ptr, q_d_ptr,  # float64 [M]
    w_ptr,  # float64 [M] out: w_i at row cu[b] + i
    max_k,
):
    """w_0 = 1, w_{i+1} = min((w_i * p_i(d_i)) / q_i(d_i), 1), 1 where q_i(d_i) == 0:
    a recurrence, so one program walks its request's rows."""
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    k = tl.load(cu_ptr + b + 1) - start - 1
    if tl.load(temperature_ptr + tl.load(idx_ptr + start)) != 0:
        w = tl.full([], 1.0, tl.float64)
        tl.store(w_ptr + start, w)
        for i in range(0, max_k):
            if i < k:
                p_d = tl.load(p_d_ptr + start + i)
                q_d = tl.load(q_d_ptr + start + i)
                q_safe = tl.where(q_d == 0, 1.0, q_d)  # no 0 / 0 computed where discarded
                w = tl.where(q_d == 0, 1.0, tl.minimum(w * p_d / q_safe, 1.0))
                tl.store(w_ptr + start + i + 1, w)


@triton.jit
def _block_mass_kernel(
    logits_ptr, logits_stride, idx_ptr, cu_ptr, draft_ptr, q_ptr, temperature_ptr, thr_ptr,
    lmax_ptr, z_ptr, w_ptr,  # float64 [M]
    s_ptr,  # float64 [M] out: S_i for rows 1 <= i < k
    vocab_size,
    BLOCK: tl.constexpr, HAS_Q: tl.constexpr, HAS_THRESHOLD: tl.constexpr,
    IS_FP64: tl.constexpr,
):
    """S_i = sum_v max(w_i p_i(v) - q_i(v), 0), the mass block verification could still
    recover at row i."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    start = tl.load(cu_ptr + b)
    end = tl.load(cu_ptr + b + 1)
    j = start + i
    if (i >= 1) & (j < end - 1):
        temp = tl.load(temperature_ptr + tl.load(idx_ptr + j))
        if temp != 0:
            row_ptr = logits_ptr + j.to(tl.int64) * logits_stride
            q_row_ptr = q_ptr + j.to(tl.int64) * vocab_size
            thr = _threshold(thr_ptr, j, HAS_THRESHOLD)
            lmax64 = tl.load(lmax_ptr + j)
            z = tl.load(z_ptr + j)
            w = tl.load(w_ptr + j)
            d = tl.load(draft_ptr + j)
            s = tl.zeros([], tl.float64)
            for v0 in range(0, vocab_size, BLOCK):
                offs = v0 + tl.arange(0, BLOCK)
                valid = offs < vocab_size
                p = _probs(row_ptr, offs, valid, temp, thr, lmax64, z, IS_FP64)
                q = _draft_probs(q_row_ptr, offs, valid, d, HAS_Q)
                s += tl.sum(tl.maximum(w * p - q, 0.0), 0)
            tl.store(s_ptr + j, s)


@triton.jit
def _leading(accepted, in_k, lanes, k):
    """The number of leading accepted drafts."""
    return tl.min(tl.where(in_k & ~accepted, lanes, k), 0)


@triton.jit
def _decide_kernel(
    idx_ptr, cu_ptr, pos_ptr, draft_ptr, target_ptr,
    temperature_ptr, seeds_ptr,
    rates_ptr,  # float64 [>= max_k] (read iff METHOD == SYNTHETIC)
    p_d_ptr, q_d_ptr, w_ptr, s_ptr,  # float64 [M]
    out_ptr,  # int64 [N, max_k + 1] out: accepted drafts, then -1
    num_sampled_ptr,  # int32 [N] out
    out_row_ptr,  # int32 [N] out: the row that samples the final token
    need_ptr,  # int32 [N] out: 1 iff that token is a residual sample
    w_res_ptr,  # float64 [N] out: the residual's weight on p (1 unless block)
    out_width,
    METHOD: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    k = tl.load(cu_ptr + b + 1) - start - 1
    state = tl.load(idx_ptr + start)
    greedy = tl.load(temperature_ptr + state) == 0
    seed = tl.load(seeds_ptr + state)
    lanes = tl.arange(0, BLOCK_K)
    in_k = lanes < k
    rows = start + lanes
    drafts = tl.load(draft_ptr + rows, mask=in_k, other=-1)
    w_res = tl.full([], 1.0, tl.float64)
    if METHOD == SYNTHETIC:
        u = acceptance_uniform(seed, tl.load(pos_ptr + rows, mask=in_k, other=0), lanes * 0)
        n = _leading(u < tl.load(rates_ptr + lanes, mask=in_k, other=0.0), in_k, lanes, k)
        need = n < 0  # never: the final token is the sample from p at row n
    else:
        exact = drafts == tl.load(target_ptr + rows, mask=in_k, other=-2)  # greedy: the argmax
        n_greedy = _leading(exact, in_k, lanes, k)
        if METHOD == STANDARD:
            u = acceptance_uniform(seed, tl.load(pos_ptr + rows, mask=in_k, other=0), lanes * 0)
            p_d = tl.load(p_d_ptr + rows, mask=in_k, other=0.0)
            q_d = tl.load(q_d_ptr + rows, mask=in_k, other=1.0)
            ratio = p_d / tl.where(q_d == 0, 1.0, q_d)  # q(d) == 0 accepts: no 0 / 0
            n_random = _leading((q_d == 0) | (u < ratio), in_k, lanes, k)
        else:
            # lane l holds i = l + 1; eta_i is keyed by the first row (reference docstring)
            i = lanes + 1
            w_i = tl.load(w_ptr + start + i, mask=in_k, other=1.0)
            s_i = tl.load(s_ptr + start + i, mask=i < k, other=0.0)
            den = s_i + (1.0 - w_i)
            h = tl.where(i == k, w_i, tl.where(den == 0, 1.0, s_i / tl.where(den == 0, 1.0, den)))
            eta = acceptance_uniform(seed, tl.load(pos_ptr + start), lanes)
            n_random = tl.max(tl.where(in_k & (eta <= h), i, 0), 0)
            w_res = tl.where(greedy, 1.0, tl.load(w_ptr + start + n_random, mask=~greedy,
                                                  other=1.0))
        n = tl.where(greedy, n_greedy, n_random)
        need = ~greedy & (n < k)
    tl.store(num_sampled_ptr + b, n + 1)
    tl.store(out_row_ptr + b, start + n)
    tl.store(need_ptr + b, need.to(tl.int32))
    tl.store(w_res_ptr + b, w_res)
    tl.store(out_ptr + b.to(tl.int64) * out_width + lanes, tl.where(lanes < n, drafts, -1),
             mask=lanes < out_width)


@triton.jit
def _residual_kernel(
    logits_ptr, logits_stride, idx_ptr, pos_ptr, draft_ptr, q_ptr,
    temperature_ptr, seeds_ptr, thr_ptr,
    lmax_ptr, z_ptr,  # float64 [M]
    out_row_ptr, need_ptr, w_res_ptr,  # [N], from _decide_kernel
    block_max_ptr, block_arg_ptr,  # [N, num_blocks] out
    vocab_size, num_blocks,
    BLOCK: tl.constexpr, HAS_Q: tl.constexpr, HAS_THRESHOLD: tl.constexpr,
    IS_FP64: tl.constexpr,
):
    """One block of the exponential race over r = max(w p - q, 0) at the rejecting row:
    argmax over r > 0 of r / E, E = -nlog(u(seed, pos, v)). -inf where nothing races."""
    b = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    best_score = tl.full([], float("-inf"), tl.float64)
    best_arg = (blk * BLOCK).to(tl.int64)
    if tl.load(need_ptr + b) != 0:
        j = tl.load(out_row_ptr + b)
        state = tl.load(idx_ptr + j)
        temp = tl.load(temperature_ptr + state)
        valid = offs < vocab_size
        p = _probs(logits_ptr + j.to(tl.int64) * logits_stride, offs, valid, temp,
                   _threshold(thr_ptr, j, HAS_THRESHOLD), tl.load(lmax_ptr + j),
                   tl.load(z_ptr + j), IS_FP64)
        q = _draft_probs(q_ptr + j.to(tl.int64) * vocab_size, offs, valid,
                         tl.load(draft_ptr + j), HAS_Q)
        r = tl.maximum(tl.load(w_res_ptr + b) * p - q, 0.0)
        lane_hi, lane_lo = row_lanes(tl.load(seeds_ptr + state), tl.load(pos_ptr + j))
        score = tl.where(valid & (r > 0), r / exponential_noise(lane_hi, lane_lo, offs),
                         float("-inf"))
        best = tl.argmax(score, 0, tie_break_left=True)
        best_score = tl.max(score, 0)
        best_arg = (blk * BLOCK + best).to(tl.int64)
    tl.store(block_max_ptr + b * num_blocks + blk, best_score)
    tl.store(block_arg_ptr + b * num_blocks + blk, best_arg)


@triton.jit
def _finish_kernel(
    block_max_ptr, block_arg_ptr,  # [N, num_blocks] (read iff HAS_RESIDUAL)
    out_row_ptr, num_sampled_ptr, target_ptr,
    out_ptr, out_width, num_blocks,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,  # BLOCK >= num_blocks
):
    """The final token: the residual race's winner, else (bonus, greedy, synthetic, or an
    all-zero residual) the normal sampler's token at the output row."""
    b = tl.program_id(0)
    y = tl.load(target_ptr + tl.load(out_row_ptr + b))
    if HAS_RESIDUAL:
        offs = tl.arange(0, BLOCK)
        m = tl.load(block_max_ptr + b * num_blocks + offs, mask=offs < num_blocks,
                    other=float("-inf"))
        best = tl.argmax(m, 0, tie_break_left=True)  # lowest block: lowest id on ties
        if tl.max(m, 0) > float("-inf"):
            y = tl.load(block_arg_ptr + b * num_blocks + best)
    n = tl.load(num_sampled_ptr + b) - 1
    tl.store(out_ptr + b.to(tl.int64) * out_width + n, y)
