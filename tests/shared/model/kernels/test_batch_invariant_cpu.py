"""The CPU batch-invariant matmul: correct against a NumPy float64 product, and a row's
result bitwise the same alone and at every position of batches of 2..64 whatever the other
rows hold; F.linear fails the same check on this CPU (the check has teeth)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shared.model.kernels.batch_invariant_cpu import invariant_linear_cpu

SHAPES = [(64, 192), (64, 512), (128, 256), (576, 1536)]  # (K, N): tiny presets, SmolLM2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_numpy(dtype, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((3, 7, 48), generator=gen, dtype=dtype)
    w = torch.randn((33, 48), generator=gen, dtype=dtype)
    b = torch.randn(33, generator=gen, dtype=dtype) if bias else None
    want = x.double().numpy() @ w.double().numpy().T + (0 if b is None else b.double().numpy())
    got = invariant_linear_cpu(x, w, b)
    assert got.shape == (3, 7, 33) and got.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    np.testing.assert_allclose(got.double().numpy(), want, rtol=tol, atol=tol)


def _row_positions_that_differ(linear, k: int, n: int, dtype) -> list:
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn((n, k), generator=gen, dtype=dtype)
    needle = torch.randn((1, k), generator=gen, dtype=dtype)
    alone = linear(needle, w)[0]
    differ = []
    for m in (2, 3, 16, 17, 64):
        for pos in sorted({0, m // 2, m - 1}):
            batch = torch.randn((m, k), generator=gen, dtype=dtype)
            batch[pos] = needle[0]
            if not torch.equal(linear(batch, w)[pos], alone):
                differ.append((m, pos))
    return differ


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k, n", SHAPES)
def test_a_row_is_bitwise_the_same_in_every_batch(k, n, dtype):
    assert _row_positions_that_differ(invariant_linear_cpu, k, n, dtype) == []


def test_f_linear_is_not_invariant_here():
    # the reason the mode exists on the CPU: one row takes another kernel than many
    assert any(_row_positions_that_differ(F.linear, k, n, torch.float32) for k, n in SHAPES)


def test_zero_rows():
    w = torch.randn(8, 4)
    assert invariant_linear_cpu(torch.empty(0, 4), w).shape == (0, 8)
