"""The speculative-decoding noise streams on CUDA (GPU machine only): torch on CUDA and
compiled Triton give the CPU's bits (tests/shared/sampling/test_acceptance_noise.py has
the rest)."""

from __future__ import annotations

import pytest
import torch

from shared.sampling.noise import (
    acceptance_uniform,
    exponential_noise,
    torch_acceptance_uniform,
    torch_exponential_noise,
)
from shared.sampling.noise_kernels import triton_acceptance_uniform
from tests.shared.sampling.test_sampling_noise import random_rows

pytestmark = pytest.mark.gpu


def test_acceptance_uniform_cuda_and_compiled_triton_bit_identical() -> None:
    seeds, positions = random_rows(4096, seed=6)
    offsets = torch.arange(4096, dtype=torch.int64) % 17
    cpu = acceptance_uniform(seeds, positions, offsets)
    seeds, positions, offsets = seeds.cuda(), positions.cuda(), offsets.cuda()
    assert torch.equal(acceptance_uniform(seeds, positions, offsets).cpu(), cpu)
    assert torch.equal(torch_acceptance_uniform(seeds, positions, offsets).cpu(), cpu)
    assert torch.equal(triton_acceptance_uniform(seeds, positions, offsets).cpu(), cpu)
    # the default offset and broadcasting (one seed for a row's positions) on the kernel path
    want = acceptance_uniform(seeds[:1].cpu(), positions.cpu())
    assert torch.equal(acceptance_uniform(seeds[:1], positions).cpu(), want)


def test_exponential_noise_cuda_bit_identical() -> None:
    seeds, positions = random_rows(16, seed=7)
    cpu = exponential_noise(seeds, positions, 32_000)
    seeds, positions = seeds.cuda(), positions.cuda()
    assert torch.equal(exponential_noise(seeds, positions, 32_000).cpu(), cpu)  # Triton
    assert torch.equal(torch_exponential_noise(seeds, positions, 32_000).cpu(), cpu)
