"""The speculative-decoding streams of the shared noise: the salted acceptance uniform
(torch, Triton and NumPy bit-identical) and the exponential noise of residual sampling;
the salts keep seeds in range and give streams independent of the sampling noise."""

from __future__ import annotations

import numpy as np
import torch

from shared.sampling.noise import (
    ACCEPT_SALT,
    DRAFT_SALT,
    acceptance_uniform,
    exponential_noise,
    torch_gumbel_noise,
    uniform,
)
from shared.sampling.noise_kernels import triton_acceptance_uniform, triton_exponential_noise
from tests.oracles import rejection_reference
from tests.oracles.sampling_reference import reference_nlog, reference_uniform
from tests.shared.sampling.test_sampling_noise import random_rows


def test_salts() -> None:
    for salt in (ACCEPT_SALT, DRAFT_SALT):
        assert salt % 2 == 1 and 0 < salt < 2**62
        assert salt & 0xFFFFFFFF and salt >> 32  # both 32-bit words of the seed change
    assert ACCEPT_SALT != DRAFT_SALT
    seeds, _ = random_rows(64)
    for salt in (ACCEPT_SALT, DRAFT_SALT):
        salted = seeds ^ salt
        assert bool((salted >= 0).all())  # still in [0, 2**63): int64 non-negative


def test_acceptance_uniform_torch_triton_numpy_bit_identical() -> None:
    seeds, positions = random_rows(40, seed=3)
    offsets = torch.arange(40, dtype=torch.int64) % 7
    offsets[:3] = torch.tensor([0, 15, 2**20])
    got = acceptance_uniform(seeds, positions, offsets)
    assert got.dtype == torch.float64
    assert torch.equal(triton_acceptance_uniform(seeds, positions, offsets), got)
    for i in range(len(seeds)):
        want = rejection_reference.acceptance_uniform(int(seeds[i]), int(positions[i]),
                                                      int(offsets[i]))
        assert got[i].item() == want, f"row {i}"
    # the default offset is 0
    zero = torch.zeros_like(offsets)
    assert torch.equal(acceptance_uniform(seeds, positions), acceptance_uniform(seeds, positions, zero))


def test_acceptance_is_its_own_stream() -> None:
    """Not the sampling noise's uniform at vocab id 0, nor correlated with it; uniform."""
    g = torch.Generator().manual_seed(5)
    seeds = torch.randint(0, 2**63 - 1, (20000,), generator=g, dtype=torch.int64)
    positions = torch.randint(0, 2**20, (20000,), generator=g, dtype=torch.int64)
    zero = torch.zeros_like(seeds)
    acc = acceptance_uniform(seeds, positions)
    plain = uniform(seeds, positions, zero)
    draft = uniform(seeds ^ DRAFT_SALT, positions, zero)
    assert not bool((acc == plain).any()) and not bool((acc == draft).any())
    for other in (plain, draft):
        assert abs(np.corrcoef(acc.numpy(), other.numpy())[0, 1]) < 0.03  # 4 sigma at n = 20000
    # Kolmogorov-Smirnov distance to U(0, 1): 1.95 / sqrt(n) is the 0.1 % critical value
    x = np.sort(acc.numpy())
    n = len(x)
    d = max((np.arange(1, n + 1) / n - x).max(), (x - np.arange(n) / n).max())
    assert d < 1.95 / np.sqrt(n)


def test_exponential_noise() -> None:
    seeds, positions = random_rows(10, seed=9)
    vocab = 300
    e = exponential_noise(seeds, positions, vocab)
    assert e.dtype == torch.float64 and bool((e > 0).all())
    for i in range(len(seeds)):
        u = reference_uniform(int(seeds[i]), int(positions[i]), np.arange(vocab))
        assert np.array_equal(e[i].numpy(), -reference_nlog(u))
    # the Gumbel noise is -nlog(E) of the same E (so the residual race and normal
    # sampling of one row read the same uniforms, never both for one token)
    g = torch_gumbel_noise(seeds, positions, vocab)
    assert np.array_equal(g.numpy(), -reference_nlog(e.numpy()))
    # the Triton kernel exponential_noise runs on CUDA (interpreted here), a vocabulary
    # that is not a multiple of its block
    assert torch.equal(triton_exponential_noise(seeds, positions, vocab, block=128), e)
