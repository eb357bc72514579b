"""The shared Gumbel noise in Triton: device functions both samplers' kernels call, and a
kernel that writes the noise alone (V1 on CUDA, tests).

Bit-identical to shared/sampling/noise.py, whose docstring is the spec: uint32 fmix32
chains over (seed, pos, vocab id) -> u in (0, 1) from 52 bits -> -nlog(-nlog(u)) in
float64, where nlog uses only correctly rounded operations; the exponential noise
-nlog(u) and the salted acceptance uniform of speculative decoding likewise. Kernels that call
`gumbel_noise` must launch with enable_fp_fusion=False: a fused multiply-add would round
once where the spec rounds twice.
"""

from __future__ import annotations

import torch

from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton
from shared.sampling.noise import ACCEPT_SALT

NOISE_BLOCK = 1024  # vocab block per program; also the interpreter's sweet spot
_ACCEPT_SALT = tl.constexpr(ACCEPT_SALT)  # a kernel reads globals only as constexpr


@triton.jit
def fmix32(h):
    """MurmurHash3's finaliser on uint32 (wrapping multiplies, logical shifts)."""
    h = h ^ (h >> 16)
    h = h * tl.full([], 0x85EBCA6B, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full([], 0xC2B2AE35, tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def row_lanes(seed, pos):
    """The per-row state of both lanes; seed int64 in [0, 2**63), pos int64."""
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = (seed >> 32).to(tl.uint32)
    pos32 = (pos & 0xFFFFFFFF).to(tl.uint32)
    hi = fmix32(tl.full([], 0x9E3779B9, tl.uint32) ^ seed_lo)
    hi = fmix32(fmix32(hi ^ seed_hi) ^ pos32)
    lo = fmix32(tl.full([], 0x7F4A7C15, tl.uint32) ^ seed_lo)
    lo = fmix32(fmix32(lo ^ seed_hi) ^ pos32)
    return hi, lo


@triton.jit
def f64(bits):
    """The float64 whose bit pattern is the int64 `bits`. Constants are spelled this way:
    a Python float literal in a kernel is a float32 constant, rounded before use."""
    return tl.full([], bits, tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def nlog(x):
    """The spec's log for positive normal float64 x (shared/sampling/noise.py)."""
    bits = x.to(tl.int64, bitcast=True)
    e = (bits >> 52) - 1023
    f = bits & 0xFFFFFFFFFFFFF
    big = f >= 0x6A09E667F3BCD
    m = (f | tl.where(big, 0x3FE0000000000000, 0x3FF0000000000000)).to(tl.float64, bitcast=True)
    e = (e + big.to(tl.int64)).to(tl.float64)
    one = f64(0x3FF0000000000000)
    s = (m - one) / (m + one)
    z = s * s
    p = f64(0x3FA8618618618618)  # 1/21
    p = p * z + f64(0x3FAAF286BCA1AF28)  # 1/19
    p = p * z + f64(0x3FAE1E1E1E1E1E1E)  # 1/17
    p = p * z + f64(0x3FB1111111111111)  # 1/15
    p = p * z + f64(0x3FB3B13B13B13B14)  # 1/13
    p = p * z + f64(0x3FB745D1745D1746)  # 1/11
    p = p * z + f64(0x3FBC71C71C71C71C)  # 1/9
    p = p * z + f64(0x3FC2492492492492)  # 1/7
    p = p * z + f64(0x3FC999999999999A)  # 1/5
    p = p * z + f64(0x3FD5555555555555)  # 1/3
    p = p * z + one
    t = s * p
    return e * f64(0x3FE62E42FEFA39EF) + (t + t)  # ln 2


@triton.jit
def uniform(lane_hi, lane_lo, vocab_ids):
    """float64 u in (0, 1) for the given vocab ids of one row."""
    ids = vocab_ids.to(tl.uint32)
    hi = fmix32(lane_hi ^ ids).to(tl.uint64)
    lo = fmix32(lane_lo ^ ids).to(tl.uint64)
    m = (hi << 20) | (lo >> 12)  # 52 bits
    return (m * 2 + 1).to(tl.float64) * f64(0x3CA0000000000000)  # 2**-53, exact


@triton.jit
def exponential_noise(lane_hi, lane_lo, vocab_ids):
    """E = -nlog(u), float64, Exponential(1): the noise of the exponential race."""
    return -nlog(uniform(lane_hi, lane_lo, vocab_ids))


@triton.jit
def gumbel_noise(lane_hi, lane_lo, vocab_ids):
    """float64 Gumbel noise for the given vocab ids of one row."""
    return -nlog(exponential_noise(lane_hi, lane_lo, vocab_ids))


@triton.jit
def acceptance_uniform(seed, pos, offset):
    """The acceptance uniform u(seed ^ ACCEPT_SALT, pos, vocab_id = offset), float64; the
    twin of shared.sampling.noise.acceptance_uniform (offset may be a block of ids)."""
    lane_hi, lane_lo = row_lanes(seed ^ _ACCEPT_SALT, pos)
    return uniform(lane_hi, lane_lo, offset)


@triton.jit
def _noise_kernel(
    seeds_ptr,  # int64 [N]
    pos_ptr,  # int64 [N]
    out_ptr,  # float64 [N, vocab_size]
    vocab_size,
    BLOCK: tl.constexpr,
    GUMBEL: tl.constexpr,  # False: the exponential noise E (Gumbel = -nlog(E))
):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    lane_hi, lane_lo = row_lanes(tl.load(seeds_ptr + b), tl.load(pos_ptr + b))
    if GUMBEL:
        noise = gumbel_noise(lane_hi, lane_lo, offs)
    else:
        noise = exponential_noise(lane_hi, lane_lo, offs)
    tl.store(out_ptr + b.to(tl.int64) * vocab_size + offs, noise, mask=offs < vocab_size)


def _noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, block: int,
           gumbel: bool) -> torch.Tensor:
    assert seeds.dtype == torch.int64 and positions.dtype == torch.int64
    assert seeds.dim() == 1 and positions.shape == seeds.shape
    n = seeds.shape[0]
    out = torch.empty(n, vocab_size, dtype=torch.float64, device=seeds.device)
    if n == 0:
        return out
    grid = (n, triton.cdiv(vocab_size, block))
    kept(_noise_kernel)(grid, seeds.contiguous(), positions.contiguous(), out, vocab_size,
                        BLOCK=block, GUMBEL=gumbel, enable_fp_fusion=False)
    return out


def triton_gumbel_noise(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, block: int = NOISE_BLOCK
) -> torch.Tensor:
    """float64 [N, vocab_size]; the Triton twin of shared.sampling.noise.torch_gumbel_noise."""
    return _noise(seeds, positions, vocab_size, block, gumbel=True)


def triton_exponential_noise(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, block: int = NOISE_BLOCK
) -> torch.Tensor:
    """float64 [N, vocab_size]; the Triton twin of
    shared.sampling.noise.torch_exponential_noise."""
    return _noise(seeds, positions, vocab_size, block, gumbel=False)


@triton.jit
def _acceptance_kernel(seeds_ptr, pos_ptr, offsets_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    seed = tl.load(seeds_ptr + offs, mask=valid, other=0)
    pos = tl.load(pos_ptr + offs, mask=valid, other=0)
    u = acceptance_uniform(seed, pos, tl.load(offsets_ptr + offs, mask=valid, other=0))
    tl.store(out_ptr + offs, u, mask=valid)


def triton_acceptance_uniform(
    seeds: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor, block: int = 128
) -> torch.Tensor:
    """float64 [N]: the device function `acceptance_uniform` elementwise (V1's rejection
    sampler on CUDA, through shared.sampling.noise.acceptance_uniform)."""
    assert seeds.dtype == positions.dtype == offsets.dtype == torch.int64
    assert seeds.dim() == 1 and positions.shape == seeds.shape == offsets.shape
    n = seeds.shape[0]
    out = torch.empty(n, dtype=torch.float64, device=seeds.device)
    if n:
        kept(_acceptance_kernel)((triton.cdiv(n, block),),
            seeds, positions, offsets, out, n, BLOCK=block, enable_fp_fusion=False)
    return out
