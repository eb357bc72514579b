"""min_p, top_k and top_p as one per-row threshold on scaled = logits / temperature.

Each filter keeps an upper set of scaled (see tests/oracles/sampling_reference.py), so together
they keep exactly {i : scaled_i >= threshold}; the Gumbel kernel then masks with it. No
sort: one program per row finds the threshold by passes over the row.
  min_p: the smallest scaled with float64(scaled) - float64(max scaled) >= log(float64(min_p)).
  top_k: the k-th largest scaled, by bisection on the float's order-preserving integer key
         that snaps to values present in the row (at most 32 passes in float32, 64 in
         float64; far fewer in practice).
  top_p: the smallest v with mass(survivors with scaled > v) < top_p * Z, by the same
         bisection; the mass is monotone in v, so {scaled_i >= v*} is exactly the set of
         tokens whose more-probable survivors hold less than top_p of the mass.
Rows that are greedy or use no filter get -inf (keep all) without reading the row.
Correct first: top_k / top_p cost O(32 * V) per row (64 in float64).
"""

from __future__ import annotations

import torch

from runner_v2.sample.gumbel import NOISE_BLOCK, div_ieee, load_logits
from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton


@triton.jit
def _key(x, IS_FP64: tl.constexpr):
    """Order-preserving int64 key of a float: negative floats get their magnitude
    bits flipped so that integer order equals float order."""
    if IS_FP64:
        bits = x.to(tl.int64, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFFFFFFFFFF)
    else:
        bits32 = x.to(tl.int32, bitcast=True)
        key = tl.where(bits32 >= 0, bits32, bits32 ^ 0x7FFFFFFF).to(tl.int64)
    return key


@triton.jit
def _unkey(key, IS_FP64: tl.constexpr):
    if IS_FP64:
        bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFFFFFFFFFF)
        x = bits.to(tl.float64, bitcast=True)
    else:
        bits32 = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.int32)
        x = bits32.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _load_l(row_ptr, start, vocab_size, temp, BLOCK: tl.constexpr, IS_FP64: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    valid = offs < vocab_size
    x = load_logits(row_ptr, offs, valid, IS_FP64)
    return div_ieee(x, temp.to(x.dtype), IS_FP64), valid


@triton.jit
def _kth_largest(row_ptr, vocab_size, temp, k, lmin, lmax,
                 BLOCK: tl.constexpr, IS_FP64: tl.constexpr):
    """Largest v with count(scaled >= v) >= k, which is the k-th largest value.

    Bisection on keys that snaps to values present in the row: count(scaled >= v) is
    constant between neighbouring values, so the answer is always a row value."""
    lo = _key(lmin, IS_FP64)  # count(scaled >= lmin) = V >= k
    hi = _key(lmax, IS_FP64)
    while lo < hi:
        mid = (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)  # ceil((lo + hi) / 2), no overflow
        v = _unkey(mid, IS_FP64)
        count = tl.zeros([], tl.int32)
        up = lmax  # smallest value >= v
        down = lmin  # largest value < v
        for start in range(0, vocab_size, BLOCK):
            scaled, valid = _load_l(row_ptr, start, vocab_size, temp, BLOCK, IS_FP64)
            ge = valid & (scaled >= v)
            count += tl.sum(ge.to(tl.int32), 0)
            up = tl.minimum(up, tl.min(tl.where(ge, scaled, float("inf")), 0))
            down = tl.maximum(down, tl.max(tl.where(valid & ~ge, scaled, float("-inf")), 0))
        if count >= k:
            lo = _key(up, IS_FP64)  # > old lo: up >= v = mid > lo
        else:
            hi = _key(down, IS_FP64)  # < old hi: down < v <= hi
    return _unkey(lo, IS_FP64)


@triton.jit
def _top_p_threshold(row_ptr, vocab_size, temp, top_p, thr, lmin, lmax,
                     BLOCK: tl.constexpr, IS_FP64: tl.constexpr):
    """Smallest v with sum(e_j : scaled_j >= thr, scaled_j > v) < top_p * Z, e_j = exp(scaled_j - max)."""
    lmax64 = lmax.to(tl.float64)
    z = tl.zeros([], tl.float64)
    for start in range(0, vocab_size, BLOCK):
        scaled, valid = _load_l(row_ptr, start, vocab_size, temp, BLOCK, IS_FP64)
        keep = valid & (scaled >= thr)
        z += tl.sum(tl.where(keep, tl.exp(scaled.to(tl.float64) - lmax64), 0.0), 0)
    limit = top_p.to(tl.float64) * z
    # mass(scaled > v) is constant between neighbouring survivor values, so the answer
    # is a survivor value: the bisection snaps to survivor values.
    lo = _key(tl.maximum(thr, lmin), IS_FP64)  # at or below the smallest survivor
    hi = _key(lmax, IS_FP64)  # mass above the max is 0 < limit
    while lo < hi:
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2), no overflow
        v = _unkey(mid, IS_FP64)
        mass = tl.zeros([], tl.float64)
        up = lmax  # smallest survivor > v
        down = tl.maximum(thr, lmin)  # largest survivor <= v
        for start in range(0, vocab_size, BLOCK):
            scaled, valid = _load_l(row_ptr, start, vocab_size, temp, BLOCK, IS_FP64)
            survivor = valid & (scaled >= thr)
            above = survivor & (scaled > v)
            mass += tl.sum(tl.where(above, tl.exp(scaled.to(tl.float64) - lmax64), 0.0), 0)
            up = tl.minimum(up, tl.min(tl.where(above, scaled, float("inf")), 0))
            down = tl.maximum(down, tl.max(tl.where(survivor & ~above, scaled, float("-inf")), 0))
        if mass < limit:
            hi = _key(down, IS_FP64)  # < old hi: down <= v < hi
        else:
            lo = _key(up, IS_FP64)  # > old lo: up > v >= lo
    return _unkey(hi, IS_FP64)


@triton.jit
def _threshold_kernel(
    logits_ptr,  # [N, vocab_size] processed (or raw) logits, any float dtype, row stride
    logits_stride,
    idx_mapping_ptr,  # int32 [N]: batch row -> state row
    temperature_ptr, top_p_ptr, min_p_ptr,  # float32 [R]
    top_k_ptr,  # int32 [R], 0 = off
    threshold_ptr,  # [N] compute dtype
    vocab_size,
    BLOCK: tl.constexpr,
    IS_FP64: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b)
    temp = tl.load(temperature_ptr + row)
    k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    row_ptr = logits_ptr + b * logits_stride
    neg_inf = tl.zeros([], tl.float64 if IS_FP64 else tl.float32) - float("inf")
    thr = neg_inf
    if (temp != 0) & ((k > 0) | (top_p < 1.0) | (min_p > 0.0)):
        lmax = neg_inf
        lmin = -neg_inf
        for start in range(0, vocab_size, BLOCK):
            scaled, valid = _load_l(row_ptr, start, vocab_size, temp, BLOCK, IS_FP64)
            lmax = tl.maximum(lmax, tl.max(scaled, 0))
            lmin = tl.minimum(lmin, tl.min(tl.where(valid, scaled, float("inf")), 0))
        if min_p > 0.0:
            log_min_p = tl.log(min_p.to(tl.float64))
            thr = -neg_inf
            for start in range(0, vocab_size, BLOCK):
                scaled, valid = _load_l(row_ptr, start, vocab_size, temp, BLOCK, IS_FP64)
                ok = valid & ((scaled.to(tl.float64) - lmax.to(tl.float64)) >= log_min_p)
                thr = tl.minimum(thr, tl.min(tl.where(ok, scaled, float("inf")), 0))
        if k > 0:
            thr = tl.maximum(thr, _kth_largest(row_ptr, vocab_size, temp, k, lmin, lmax,
                                               BLOCK, IS_FP64))
        if top_p < 1.0:
            thr = tl.maximum(thr, _top_p_threshold(row_ptr, vocab_size, temp, top_p, thr,
                                                   lmin, lmax, BLOCK, IS_FP64))
    tl.store(threshold_ptr + b, thr)


def compute_thresholds(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    block: int = NOISE_BLOCK,
) -> torch.Tensor:
    """Per batch row, keep scaled >= threshold; [N] float32 (float64 for fp64 logits)."""
    n, vocab_size = logits.shape
    assert logits.stride(1) == 1
    assert idx_mapping.dtype == torch.int32 and idx_mapping.shape == (n,)
    assert top_k.dtype == torch.int32
    assert temperature.dtype == top_p.dtype == min_p.dtype == torch.float32
    is_fp64 = logits.dtype == torch.float64
    out = torch.empty(n, dtype=torch.float64 if is_fp64 else torch.float32, device=logits.device)
    if n == 0:
        return out
    kept(_threshold_kernel)((n,),
        logits, logits.stride(0), idx_mapping, temperature, top_p, min_p, top_k, out,
        vocab_size, BLOCK=block, IS_FP64=is_fp64, enable_fp_fusion=False,
    )
    return out
