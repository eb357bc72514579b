"""The Gumbel noise both samplers share: a pure function of (seed, pos, vocab id).

Random sampling is Gumbel-max: token = argmax_i (l_i + g_i) with g_i ~ Gumbel(0, 1).
V1 (PyTorch, this module), V2 (Triton, runner_v2/sample/gumbel.py) and the NumPy
reference (tests/oracles/sampling_reference.py) compute g bit-identically from integers, so a
seeded request samples the same tokens whatever the batch makeup, row order or
preemption: nothing about the batch enters the noise.

Definition (all words are unsigned 32-bit, every operation is taken modulo 2**32):

    fmix32(h):                       # MurmurHash3's finaliser, a bijection on 32 bits
        h ^= h >> 16;  h *= 0x85EBCA6B
        h ^= h >> 13;  h *= 0xC2B2AE35
        h ^= h >> 16

    seed_lo = seed & 0xFFFFFFFF      # seed: int64 in [0, 2**63)
    seed_hi = seed >> 32
    pos32   = pos & 0xFFFFFFFF       # pos: position of the logit's *input* token
    lane(key) = fmix32(fmix32(fmix32(key ^ seed_lo) ^ seed_hi) ^ pos32)
    hi = fmix32(lane(0x9E3779B9) ^ vocab_id)
    lo = fmix32(lane(0x7F4A7C15) ^ vocab_id)

    m = (hi << 20) | (lo >> 12)      # 52 random bits
    u = (2 * m + 1) * 2**-53         # float64, an odd multiple of 2**-53
    g = -nlog(-nlog(u))              # float64, nlog below

    nlog(x), for a positive normal float64 x, in float64 with every operation rounded once
    (IEEE add, subtract, multiply, divide; integer and bit operations exact):
        bits = the 64 bits of x;  e = (bits >> 52) - 1023;  f = bits & (2**52 - 1)
        if f >= 0x6A09E667F3BCD:  m = float with bits f | 0x3FE0000000000000; e += 1
        else:                     m = float with bits f | 0x3FF0000000000000
        s = (m - 1) / (m + 1);  z = s * s      # m in [sqrt(2)/2, sqrt(2)), |s| < 0.172
        p = C[10];  for k = 9 .. 0:  p = p * z + C[k]     # C[k] = float64(1 / (2k + 1))
        t = s * p
        nlog(x) = e * LN2 + (t + t)             # LN2 = float64(log 2); e as float64

Why these choices:
* nlog, not the platform's log: libm's log (NumPy, torch on CPU), CUDA's and Triton's
  differ by an ulp on ~0.1 % of inputs, so a noise built on them is identical only
  where the same library computes it. nlog uses only correctly rounded operations, in
  a fixed order and without fused multiply-adds (Triton launches with
  enable_fp_fusion=False), so the torch path (CPU and CUDA), the Triton kernels
  (compiled and interpreted) and the NumPy reference give the same bits by
  construction. It is log(x) to about an ulp (2 atanh(s) series, truncated past
  z**10 < 2e-16): the noise stays Gumbel-distributed.
* Two lanes with different keys give 64 independent-looking bits per (seed, pos, id);
  each lane is a bijection of vocab_id for a fixed row, so within one row no two tokens
  share a lane value.
* u uses 52 bits, not 53: (2m + 1) < 2**53 is exact in float64, so u is exactly an odd
  multiple of 2**-53 in [2**-53, 1 - 2**-53]. With 53 bits plus half an ulp the top
  value would round to exactly 1.0 and give g = +inf.
* The per-row part (the three nested fmix32 calls) is computed once per row; per
  token only two fmix32 and two logs remain.

PyTorch evaluation: int64 tensors hold the 32-bit words; a product of two words can
exceed 2**63 and wraps (two's complement), so masking with 0xFFFFFFFF after each
multiply recovers the exact low 32 bits. Shifts only ever see non-negative values.

Salted streams (speculative decoding). Verification draws, besides the per-token noise
above, one acceptance uniform per logit row, and a draft model samples its own tokens;
each gets its own stream by xor-ing a salt into the seed:
    acceptance_uniform(seed, pos, offset) = u(seed ^ ACCEPT_SALT, pos, vocab_id = offset)
    a draft model's noise                 = the noise above with seed ^ DRAFT_SALT
Why salts: rejection sampling needs the draft proposal, the acceptance uniform and the
recovery draw to be independent. With one stream they read the same random numbers:
the accept decision correlates with the draft token it judges, and the recovery draw
(the residual race at a rejecting row, keyed (seed, pos) like normal sampling) re-reads
the noise that chose the rejected draft, so the output leans towards the draft's
favourites (vLLM #47386: the draft's Gumbel noise was keyed by the same Philox offset as
the acceptance uniform and the recovery noise). The salts are distinct odd constants
below 2**62, so seed ^ salt stays in [0, 2**63) (the seed's domain) and changes both
32-bit words of the seed.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
FMIX_C1 = 0x85EBCA6B
FMIX_C2 = 0xC2B2AE35
LANE_KEY_HI = 0x9E3779B9
LANE_KEY_LO = 0x7F4A7C15
# u = (2m + 1) * U_SCALE with m < 2**52
U_SCALE = 2.0**-53


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 fmix32 on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * FMIX_C1) & MASK32
    h = h ^ (h >> 13)
    h = (h * FMIX_C2) & MASK32
    return h ^ (h >> 16)


def row_lanes(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row hash state of both lanes; seeds and positions broadcast together."""
    seeds = seeds.to(torch.int64)
    seed_lo = seeds & MASK32
    seed_hi = seeds >> 32  # seeds are non-negative, so this is the high word
    pos32 = positions.to(torch.int64) & MASK32

    def lane(key: int) -> torch.Tensor:
        h = fmix32(seed_lo ^ key)
        h = fmix32(h ^ seed_hi)
        return fmix32(h ^ pos32)

    return lane(LANE_KEY_HI), lane(LANE_KEY_LO)


def uniform(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_ids: torch.Tensor
) -> torch.Tensor:
    """u in (0, 1), float64; the three arguments broadcast together."""
    lane_hi, lane_lo = row_lanes(seeds, positions)
    ids = vocab_ids.to(torch.int64)
    hi = fmix32(lane_hi ^ ids)
    lo = fmix32(lane_lo ^ ids)
    m = (hi << 20) | (lo >> 12)
    return (2 * m + 1).to(torch.float64) * U_SCALE


# Salts of the speculative-decoding streams (module docstring): odd, < 2**62, both words busy.
ACCEPT_SALT = 0x2545F4914F6CDD1D
DRAFT_SALT = 0x3C6EF372FE94F82B


def torch_acceptance_uniform(
    seeds: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """The acceptance uniform in (0, 1), float64: u(seed ^ ACCEPT_SALT, pos, offset), offset
    0 by default (one per logit row); the arguments broadcast together. In torch ops."""
    seeds = seeds.to(torch.int64) ^ ACCEPT_SALT
    if offsets is None:
        offsets = torch.zeros((), dtype=torch.int64, device=seeds.device)
    return uniform(seeds, positions, offsets)


def acceptance_uniform(
    seeds: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor | None = None
) -> torch.Tensor:
    """torch_acceptance_uniform's values. On CUDA one Triton launch computes them: the torch
    ops are some seventy launches of a few elements each, host time a verify step pays in
    V1's rejection sampler (and, in a synchronous loop, the GPU waits for)."""
    if not seeds.is_cuda:
        return torch_acceptance_uniform(seeds, positions, offsets)
    from shared.sampling.noise_kernels import triton_acceptance_uniform

    if offsets is None:
        offsets = torch.zeros((), dtype=torch.int64, device=seeds.device)
    seeds, positions, offsets = (
        t.to(torch.int64).contiguous() for t in torch.broadcast_tensors(seeds, positions, offsets))
    shape = seeds.shape
    return triton_acceptance_uniform(
        seeds.reshape(-1), positions.reshape(-1), offsets.reshape(-1)).reshape(shape)


# nlog's constants, as float64 bit patterns (the Triton twin spells the same bits)
LN2_BITS = 0x3FE62E42FEFA39EF
SQRT2_FRACTION = 0x6A09E667F3BCD  # the 52 fraction bits of float64(sqrt(2))
FRACTION_MASK = (1 << 52) - 1
EXPONENT_ONE = 0x3FF0000000000000  # the exponent field of 1.0
EXPONENT_HALF = 0x3FE0000000000000  # ... and of 0.5
LOG_SERIES = tuple(1.0 / (2 * k + 1) for k in range(11))  # C[k], exactly float64(1/(2k+1))


def _bits_to_float(bits: int) -> float:
    return torch.tensor(bits, dtype=torch.int64).view(torch.float64).item()


LN2 = _bits_to_float(LN2_BITS)


def nlog(x: torch.Tensor) -> torch.Tensor:
    """The noise's log (spec above) for positive normal float64 x; every step is one
    torch op, so nothing is fused and each result is rounded once."""
    bits = x.view(torch.int64)
    e = (bits >> 52) - 1023
    f = bits & FRACTION_MASK
    big = f >= SQRT2_FRACTION
    m = (f | torch.where(big, EXPONENT_HALF, EXPONENT_ONE)).view(torch.float64)
    e = (e + big.to(torch.int64)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    p = torch.full_like(z, LOG_SERIES[10])
    for c in reversed(LOG_SERIES[:10]):  # Horner over 10 coefficients, not over tokens
        p = p * z
        p = p + c
    t = s * p
    return e * LN2 + (t + t)


def torch_exponential_noise(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """E = -nlog(u), float64 [N, vocab_size], Exponential(1)-distributed: the noise of the
    exponential race (residual sampling: argmax r_v / E_v samples v with probability
    proportional to r_v). The Gumbel noise is -nlog(E) of the same E. In torch ops."""
    assert seeds.dim() == 1 and positions.shape == seeds.shape
    ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    return -nlog(uniform(seeds[:, None], positions[:, None], ids[None, :]))


def exponential_noise(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """torch_exponential_noise's values; on CUDA one Triton kernel writes them (the torch
    ops are some forty passes over [N, vocab] float64)."""
    if seeds.is_cuda:
        from shared.sampling.noise_kernels import triton_exponential_noise

        return triton_exponential_noise(
            seeds.to(torch.int64), positions.to(torch.int64), vocab_size)
    return torch_exponential_noise(seeds, positions, vocab_size)


def torch_gumbel_noise(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Gumbel noise float64 [N, vocab_size] for rows (seeds[i], positions[i]), in torch ops."""
    return -nlog(torch_exponential_noise(seeds, positions, vocab_size))


def gumbel_noise(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Gumbel noise float64 [N, vocab_size]. On CUDA one Triton kernel writes it (the torch
    path would be some sixty elementwise passes over [N, vocab] float64); elsewhere the
    torch ops. Both give the same bits (the spec's nlog)."""
    if seeds.is_cuda:
        from shared.sampling.noise_kernels import triton_gumbel_noise

        return triton_gumbel_noise(seeds, positions.to(torch.int64), vocab_size)
    return torch_gumbel_noise(seeds, positions, vocab_size)
