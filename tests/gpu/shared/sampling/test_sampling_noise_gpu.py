"""The shared Gumbel noise on CUDA (GPU machine only): torch on CUDA and compiled Triton
give the CPU's bits (tests/shared/sampling/test_sampling_noise.py has the rest)."""

from __future__ import annotations

import pytest
import torch

from shared.sampling.noise import gumbel_noise, torch_gumbel_noise
from shared.sampling.noise_kernels import triton_gumbel_noise
from tests.shared.sampling.test_sampling_noise import random_rows

pytestmark = pytest.mark.gpu


def test_torch_cuda_and_compiled_triton_bit_identical() -> None:
    seeds, positions = random_rows(64, seed=5)
    vocab = 151_936
    cpu = torch_gumbel_noise(seeds, positions, vocab)
    seeds, positions = seeds.cuda(), positions.cuda()
    # by construction: the same bits on CPU and CUDA, in torch ops and in compiled Triton
    assert torch.equal(torch_gumbel_noise(seeds, positions, vocab).cpu(), cpu)
    assert torch.equal(triton_gumbel_noise(seeds, positions, vocab).cpu(), cpu)
    assert torch.equal(gumbel_noise(seeds, positions, vocab).cpu(), cpu)  # CUDA: the kernel
