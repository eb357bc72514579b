"""The shared Gumbel noise: PyTorch, Triton and NumPy bit-identical by construction (the
spec's nlog uses only correctly rounded operations); a pure function of (seed, pos,
vocab id); u in (0, 1); Gumbel-distributed."""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from shared.sampling.noise import (
    LN2,
    LN2_BITS,
    LOG_SERIES,
    U_SCALE,
    gumbel_noise,
    nlog,
    torch_gumbel_noise,
    uniform,
)
from shared.sampling.noise_kernels import triton_gumbel_noise
from tests.oracles.sampling_reference import reference_nlog, reference_noise

EDGE_SEEDS = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**62, 2**63 - 1]


def random_rows(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    seeds[: len(EDGE_SEEDS)] = torch.tensor(EDGE_SEEDS)
    positions = torch.randint(0, 2**31 - 1, (n,), generator=g, dtype=torch.int64)
    positions[:4] = torch.tensor([0, 1, 2**31 - 1, 2**32 + 7])  # pos uses its low 32 bits
    return seeds, positions


def test_torch_numpy_triton_bit_identical() -> None:
    seeds, positions = random_rows(12)
    vocab = 1500  # two blocks, the last one partial
    torch_noise = torch_gumbel_noise(seeds, positions, vocab)
    assert torch.equal(gumbel_noise(seeds, positions, vocab), torch_noise)  # CPU: torch path
    triton_noise = triton_gumbel_noise(seeds, positions, vocab)
    assert torch.equal(torch_noise, triton_noise)
    for i in range(len(seeds)):
        ref = reference_noise(int(seeds[i]), int(positions[i]), np.arange(vocab))
        assert np.array_equal(torch_noise[i].numpy(), ref), f"row {i}"


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def spec_nlog(x: float) -> float:
    """The docstring's nlog, written from the spec in plain Python floats (IEEE float64,
    each operation rounded once): a fourth implementation nothing else shares."""
    b = _bits(x)
    e, f = (b >> 52) - 1023, b & ((1 << 52) - 1)
    if f >= 0x6A09E667F3BCD:
        m, e = _from_bits(f | 0x3FE0000000000000), e + 1
    else:
        m = _from_bits(f | 0x3FF0000000000000)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    p = 1.0 / 21
    for k in range(9, -1, -1):
        p = p * z + 1.0 / (2 * k + 1)
    t = s * p
    return float(e) * math.log(2.0) + (t + t)


def test_nlog_is_log_to_an_ulp_and_bit_identical_everywhere() -> None:
    g = torch.Generator().manual_seed(11)
    # the domain the noise uses: u in [2**-53, 1), then -log(u) in (1e-16, 37]
    x = torch.cat([
        torch.rand(20000, generator=g, dtype=torch.float64),
        torch.exp(torch.empty(20000, dtype=torch.float64).uniform_(-37.0, 3.7, generator=g)),
        torch.tensor([2.0**-53, 1 - 2.0**-53, 1.0, 2.0, 0.5, math.sqrt(2), math.sqrt(0.5),
                      _from_bits(_bits(math.sqrt(2)) - 1), 36.7368005696771, 1.1102230246251565e-16],
                     dtype=torch.float64),
    ])
    x = x[x > 0]
    got = nlog(x)
    ref = torch.log(x)
    ulp = torch.abs(torch.nextafter(ref, torch.full_like(ref, math.inf)) - ref)
    assert (torch.abs(got - ref) <= 2 * ulp).all()  # a log, not merely a function
    assert np.array_equal(got.numpy(), reference_nlog(x.numpy()))
    for xi, gi in zip(x[::97].tolist(), got[::97].tolist()):
        assert gi == spec_nlog(xi), xi


def test_nlog_constants_are_the_float64_values() -> None:
    assert LN2 == math.log(2.0) and _bits(LN2) == LN2_BITS
    assert [_bits(c) for c in LOG_SERIES] == [_bits(1.0 / (2 * k + 1)) for k in range(11)]


def test_reference_matches_spec_on_known_values() -> None:
    """Pin a few values computed by hand from the docstring spec (plain Python ints and
    floats), so that all three implementations cannot drift together."""
    m32 = 0xFFFFFFFF

    def fmix(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & m32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & m32
        return h ^ (h >> 16)

    def spec(seed: int, pos: int, tok: int) -> float:
        def lane(key: int) -> int:
            h = fmix(fmix(fmix(key ^ (seed & m32)) ^ (seed >> 32)) ^ (pos & m32))
            return fmix(h ^ tok)

        m = (lane(0x9E3779B9) << 20) | (lane(0x7F4A7C15) >> 12)
        u = (2 * m + 1) * 2.0**-53
        return -spec_nlog(-spec_nlog(u))

    for seed, pos, tok in [(0, 0, 0), (2**63 - 1, 17, 95), (2**32 + 3, 2**31 - 1, 1234)]:
        got = gumbel_noise(torch.tensor([seed]), torch.tensor([pos]), tok + 1)[0, tok].item()
        assert got == spec(seed, pos, tok)


def test_noise_is_independent_of_batch_position_and_shape() -> None:
    seeds, positions = random_rows(12, seed=1)
    full = gumbel_noise(seeds, positions, 300)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(2))
    assert torch.equal(gumbel_noise(seeds[perm], positions[perm], 300), full[perm])
    assert torch.equal(gumbel_noise(seeds[5:6], positions[5:6], 300), full[5:6])
    assert torch.equal(gumbel_noise(seeds, positions, 1000)[:, :300], full)  # vocab size
    ids = torch.tensor([299, 0, 17])
    sub = -nlog(-nlog(uniform(seeds[:, None], positions[:, None], ids[None, :])))
    assert torch.equal(sub, full[:, ids])
    # Triton: other block sizes and batch shapes give the same values
    tri = triton_gumbel_noise(seeds[perm[:4]], positions[perm[:4]], 300, block=128)
    assert torch.equal(tri, full[perm[:4]])
    assert torch.equal(triton_gumbel_noise(seeds[3:4], positions[3:4], 300, block=256), full[3:4])


def test_noise_changes_with_every_input() -> None:
    seeds = torch.tensor([5, 5 + 2**32, 5, 5], dtype=torch.int64)  # high seed word matters
    positions = torch.tensor([9, 9, 10, 2**32 + 9], dtype=torch.int64)
    n = gumbel_noise(seeds, positions, 64)
    assert not torch.equal(n[0], n[1]) and not torch.equal(n[0], n[2])
    assert torch.equal(n[0], n[3])  # documented: pos enters through its low 32 bits
    assert len(set(n[0].tolist())) == 64  # distinct per vocab id within a row


def test_uniform_strictly_inside_unit_interval() -> None:
    seeds, positions = random_rows(64, seed=3)
    u = uniform(seeds[:, None], positions[:, None], torch.arange(4096)[None, :])
    assert (u > 0).all() and (u < 1).all()
    # the extreme values of the formula are exact and strictly inside (0, 1)
    lo, hi = (2 * 0 + 1) * U_SCALE, (2 * (2**52 - 1) + 1) * U_SCALE
    assert 0.0 < lo and hi < 1.0 and math.isfinite(-math.log(-math.log(hi)))


def test_noise_is_standard_gumbel() -> None:
    seeds, positions = random_rows(50, seed=4)
    g = gumbel_noise(seeds, positions, 4000).flatten().numpy()
    n = g.size
    assert abs(g.mean() - 0.5772156649) < 5 * math.sqrt(math.pi**2 / 6 / n)
    assert abs(g.var() - math.pi**2 / 6) < 0.02
    # Kolmogorov-Smirnov against F(x) = exp(-exp(-x)); critical value at p = 0.001
    g.sort()
    cdf = np.exp(-np.exp(-g))
    d = max((np.arange(1, n + 1) / n - cdf).max(), (cdf - np.arange(n) / n).max())
    assert d < 1.95 / math.sqrt(n)
    # ... and the statistic has teeth: it rejects Gumbel noise shifted by 0.02
    d_shift = np.abs(np.exp(-np.exp(-(g + 0.02))) - np.arange(1, n + 1) / n).max()
    assert d_shift > 1.95 / math.sqrt(n)
