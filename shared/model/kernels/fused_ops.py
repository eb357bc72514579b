"""Fused Triton kernels for the model's elementwise layers (the CUDA path).

At batch 1 a decode step is a few hundred tiny elementwise launches between the matmuls;
each of these kernels replaces a chain of them with one launch:
- `rms_norm`: (optional residual add) + RMSNorm, one launch per norm;
- `qk_norm_rope`: Qwen3's per-head q/k RMSNorm (optional) + neox RoPE, in place in the
  fused qkv buffer, one launch per layer;
- `silu_and_mul`: silu(gate) * up, one launch.

Every kernel keeps the rounding order of the PyTorch code in shared.model.layers (compute
in float32, or float64 for a float64 model; round to the model dtype where the torch code
rounds), so the two paths agree to rounding. Grids depend on the token count only and
nothing is read back to the host, so every launch is CUDA-graph capturable.

KernelOptions.fused_ops = False forces the PyTorch path on CUDA too (tests compare the two).
"""

from __future__ import annotations

import torch

from shared.runtime.kernel_options import kernel_options
from shared.runtime.triton_utils import next_power_of_2, tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def use_fused(x: torch.Tensor) -> bool:
    """The dispatch rule: fused Triton kernels for CUDA tensors (unless the engine's
    KernelOptions turn them off), PyTorch elsewhere."""
    return x.is_cuda and kernel_options().fused_ops


def _compute_dtype(dtype: torch.dtype):
    # Half types reduce in float32; float32 and float64 keep their own precision.
    return tl.float64 if dtype == torch.float64 else tl.float32


def _warps_for(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


# ---------------------------------------------------------------------------------------
# (residual add +) RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H]; read only when HAS_RESIDUAL
    weight_ptr,  # [H]
    out_ptr,  # [T, H]
    residual_out_ptr,  # [T, H]; written only when HAS_RESIDUAL
    stride_x, stride_r, stride_o, stride_ro,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    dtype = out_ptr.dtype.element_ty
    # Masked lanes read 0: they add nothing to the sum of squares and are never stored.
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # The residual stream is kept in the model dtype, as the unfused `x + residual`.
        x = (x.to(COMPUTE_DTYPE) + r.to(COMPUTE_DTYPE)).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xc = x.to(COMPUTE_DTYPE)
    var = tl.sum(xc * xc, axis=0) / HIDDEN
    # Round the normalised value to the model dtype *before* the weight multiply: the
    # torch path's (and Hugging Face's) order.
    normed = (xc * tl.math.rsqrt(var + eps)).to(dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = normed.to(COMPUTE_DTYPE) * w.to(COMPUTE_DTYPE)
    tl.store(out_ptr + row * stride_o + offs, y.to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight; with `residual`: (norm(x + residual) * weight, x + residual).

    One launch, one program per token. Outputs are new contiguous tensors (the inputs are
    left alone, so a caller may still hold them)."""
    assert x.dim() == 2 and x.stride(-1) == 1, (x.shape, x.stride())
    num_tokens, hidden = x.shape
    assert x.dtype in _FLOAT_DTYPES and weight.dtype == x.dtype, (x.dtype, weight.dtype)
    assert weight.shape == (hidden,) and weight.stride(0) == 1, weight.shape
    assert weight.device == x.device
    has_residual = residual is not None
    if has_residual:
        assert residual.shape == x.shape and residual.dtype == x.dtype, residual.shape
        assert residual.stride(-1) == 1 and residual.device == x.device
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(out) if has_residual else out
    if num_tokens > 0:
        block = next_power_of_2(hidden)
        assert block <= 65536, f"hidden size {hidden} is too large for one program"
        r = residual if has_residual else x  # placeholder pointer, never read
        _rms_norm_kernel[(num_tokens,)](
            x, r, weight, out, residual_out,
            x.stride(0), r.stride(0), out.stride(0), residual_out.stride(0),
            eps,
            HIDDEN=hidden,
            BLOCK=block,
            HAS_RESIDUAL=has_residual,
            COMPUTE_DTYPE=_compute_dtype(x.dtype),
            num_warps=_warps_for(block),
        )
    return (out, residual_out) if has_residual else out


# ---------------------------------------------------------------------------------------
# per-head q/k RMSNorm + neox RoPE, in place in the fused qkv buffer


@triton.jit
def _normed_part(
    x,  # [BLOCK_H, BLOCK_X] in the model dtype
    rstd,  # [BLOCK_H] in NORM_DTYPE
    is_q,  # [BLOCK_H] bool
    q_weight_ptr,  # [D]
    k_weight_ptr,  # [D]
    dims,  # [BLOCK_X]: the head dims this part covers
    dim_mask,  # [BLOCK_X]
    NORM_DTYPE: tl.constexpr,
):
    wq = tl.load(q_weight_ptr + dims, mask=dim_mask, other=0.0)
    wk = tl.load(k_weight_ptr + dims, mask=dim_mask, other=0.0)
    w = tl.where(is_q[:, None], wq[None, :], wk[None, :]).to(NORM_DTYPE)
    # Same order as RMSNorm: normalise, round to the model dtype, scale, round again.
    normed = (x.to(NORM_DTYPE) * rstd[:, None]).to(x.dtype)
    return (normed.to(NORM_DTYPE) * w).to(x.dtype)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,  # [T, (H + 2*Hkv) * D]; q heads, then k heads, then v (untouched)
    positions_ptr,  # int [T]
    cos_sin_ptr,  # [max_position, R]: cos in [:R/2], sin in [R/2:]
    q_weight_ptr,  # [D]; read only when HAS_NORM
    k_weight_ptr,  # [D]; read only when HAS_NORM
    stride_t, stride_cache,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_QK_HEADS: tl.constexpr,  # H + Hkv: q and k heads are adjacent in a row
    HEAD_DIM: tl.constexpr,
    HALF_ROT: tl.constexpr,  # rotary_dim / 2
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    HAS_PASS: tl.constexpr,  # rotary_dim < head_dim
    HAS_NORM: tl.constexpr,
    NORM_DTYPE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < NUM_QK_HEADS
    # Head h (q for h < H, k after) starts at h * D in the row.
    row = qkv_ptr + token * stride_t + heads[:, None] * HEAD_DIM  # [BLOCK_H, 1]
    d1 = tl.arange(0, BLOCK_HALF)
    m1 = d1 < HALF_ROT
    mask1 = head_mask[:, None] & m1[None, :]
    # Each head is split into x1 = [0, R/2), x2 = [R/2, R) and the pass-through [R, D),
    # so the rotation pairs (d, d + R/2) sit in the same lane of two tiles.
    x1 = tl.load(row + d1[None, :], mask=mask1, other=0.0)
    x2 = tl.load(row + HALF_ROT + d1[None, :], mask=mask1, other=0.0)
    if HAS_PASS:
        dp = 2 * HALF_ROT + tl.arange(0, BLOCK_PASS)
        mp = dp < HEAD_DIM
        mask_p = head_mask[:, None] & mp[None, :]
        xp = tl.load(row + dp[None, :], mask=mask_p, other=0.0)
    if HAS_NORM:
        is_q = heads < NUM_Q_HEADS
        a1 = x1.to(NORM_DTYPE)
        a2 = x2.to(NORM_DTYPE)
        sum_sq = tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)
        if HAS_PASS:
            ap = xp.to(NORM_DTYPE)
            sum_sq += tl.sum(ap * ap, axis=1)
        rstd = tl.math.rsqrt(sum_sq / HEAD_DIM + eps)  # masked heads: rsqrt(eps), unused
        x1 = _normed_part(x1, rstd, is_q, q_weight_ptr, k_weight_ptr, d1, m1, NORM_DTYPE)
        x2 = _normed_part(
            x2, rstd, is_q, q_weight_ptr, k_weight_ptr, HALF_ROT + d1, m1, NORM_DTYPE
        )
        if HAS_PASS:
            xp = _normed_part(xp, rstd, is_q, q_weight_ptr, k_weight_ptr, dp, mp, NORM_DTYPE)
            tl.store(row + dp[None, :], xp, mask=mask_p)
    # Rotate in the cache dtype (float32, float64 for a float64 model), round back once.
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cache + d1, mask=m1, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cache + HALF_ROT + d1, mask=m1, other=0.0)[None, :]
    c1 = x1.to(cos_sin_ptr.dtype.element_ty)
    c2 = x2.to(cos_sin_ptr.dtype.element_ty)
    tl.store(row + d1[None, :], (c1 * cos - c2 * sin).to(x1.dtype), mask=mask1)
    tl.store(row + HALF_ROT + d1[None, :], (c2 * cos + c1 * sin).to(x1.dtype), mask=mask1)


def qk_norm_rope(
    qkv: torch.Tensor,  # [T, (H + 2*Hkv) * D]
    positions: torch.Tensor,  # int64 [T]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos | sin, float32/64
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    q_norm_weight: torch.Tensor | None,  # [D]
    k_norm_weight: torch.Tensor | None,  # [D]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm of q and k, then neox RoPE on their first rotary_dim dims,
    written in place into `qkv`. -> (q [T, H*D], k [T, Hkv*D], v [T, Hkv*D]): column
    slices of qkv (row stride (H + 2*Hkv) * D, unit last stride), so `.view(T, heads, D)`
    works on each. One launch; grid = (T, head blocks)."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    assert qkv.dim() == 2 and qkv.shape[1] == q_size + 2 * kv_size, (qkv.shape, q_size, kv_size)
    assert qkv.stride(-1) == 1 and qkv.dtype in _FLOAT_DTYPES, (qkv.stride(), qkv.dtype)
    assert positions.shape == (num_tokens,), (positions.shape, num_tokens)
    assert positions.dtype in (torch.int32, torch.int64), positions.dtype
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == rotary_dim
    assert cos_sin_cache.stride(1) == 1 and cos_sin_cache.dtype in (torch.float32, torch.float64)
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim, (rotary_dim, head_dim)
    has_norm = q_norm_weight is not None
    assert has_norm == (k_norm_weight is not None), "q and k norms come together"
    if has_norm:
        for w in (q_norm_weight, k_norm_weight):
            assert w.shape == (head_dim,) and w.dtype == qkv.dtype and w.stride(0) == 1
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if num_tokens == 0:
        return q, k, v
    num_qk_heads = num_heads + num_kv_heads
    half_rot = rotary_dim // 2
    pass_dims = head_dim - rotary_dim
    # About 2048 elements per program: a whole token's q+k at Qwen3-0.6B sizes in 2
    # programs, while a long prefill still gets big, efficient programs.
    block_h = min(next_power_of_2(num_qk_heads), max(1, 2048 // next_power_of_2(head_dim)))
    grid = (num_tokens, triton.cdiv(num_qk_heads, block_h))
    _qk_norm_rope_kernel[grid](
        qkv, positions, cos_sin_cache,
        q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,
        qkv.stride(0), cos_sin_cache.stride(0),
        eps,
        NUM_Q_HEADS=num_heads,
        NUM_QK_HEADS=num_qk_heads,
        HEAD_DIM=head_dim,
        HALF_ROT=half_rot,
        BLOCK_H=block_h,
        BLOCK_HALF=next_power_of_2(half_rot),
        BLOCK_PASS=next_power_of_2(max(pass_dims, 1)),
        HAS_PASS=pass_dims > 0,
        HAS_NORM=has_norm,
        NORM_DTYPE=_compute_dtype(qkv.dtype),
        num_warps=4,
        # No mul+add -> FMA contraction: the torch path rounds each product, and so
        # matches this kernel bit for bit in float32.
        enable_fp_fusion=False,
    )
    return q, k, v


# ---------------------------------------------------------------------------------------
# SiLU-and-mul

# Columns per program: Llama-3-8B's I = 14336 gives 14 programs per token.
_SILU_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]: gate | up
    out_ptr,  # [T, I]
    stride_x, stride_o,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0).to(COMPUTE_DTYPE)
    up = tl.load(x_ptr + token * stride_x + INTER + cols, mask=mask, other=0.0)
    # F.silu's formula, rounded to the model dtype before the multiply (as silu(g) * up).
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    out = act.to(COMPUTE_DTYPE) * up.to(COMPUTE_DTYPE)
    tl.store(out_ptr + token * stride_o + cols, out.to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> [T, I]: silu(gate) * up. One launch."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(-1) == 1, (x.shape, x.stride())
    assert x.dtype in _FLOAT_DTYPES, x.dtype
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        block = min(next_power_of_2(inter), _SILU_BLOCK)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            x, out,
            x.stride(0), out.stride(0),
            INTER=inter,
            BLOCK=block,
            COMPUTE_DTYPE=_compute_dtype(x.dtype),
            num_warps=4,
        )
    return out
