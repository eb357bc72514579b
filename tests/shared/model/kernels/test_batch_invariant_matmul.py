"""The Triton batch-invariant matmul (shared.model.kernels.batch_invariant_matmul) under the
interpreter.

- Correct against NumPy's float64 product on ragged shapes (M, N, K off the tiles, M = 1,
  K below one tile), with and without bias, leading dims, strided views; bf16 rounded once.
- Invariant: in float64 a row is bitwise the same alone and at the first, a middle (row 7
  of its tile among them) and the last position of batches of 2..64, whatever the other
  rows hold (random, zeros as padding, large). F.linear fails the same check on this CPU,
  so the check has teeth. float64 only: the interpreter's tl.dot is numpy's matmul, and
  OpenBLAS's float32 GEMM gives rows 6-11 of a 16-row tile other bits than rows 0-5 (see
  the module docstring); the bf16 and float32 forms run on the GPU
  (tests/gpu/shared/model/kernels/test_batch_invariant_matmul_gpu.py).
- The launch-config rule (BLOCK_N from the SM count) on llama-3-8b's shapes.
- The 64-row tiles the GPU takes from 17 to 512 rows, launched here with their configs:
  correct against NumPy where rows, columns and K end inside a tile (their bits against
  the 16-row tiles' are a GPU question: the interpreter's dot sums a whole K block in one
  NumPy call, so its bits follow BLOCK_K, where the GPU's MMA k-steps do not).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shared.model.kernels import batch_invariant_matmul as bim
from shared.model.kernels.batch_invariant_matmul import invariant_linear

# (M, N, K): one row, K below a 64-wide tile, partial N and K tiles, a tile and one row
SHAPES = [(1, 33, 40), (1, 70, 200), (5, 16, 8), (17, 130, 200), (40, 72, 129), (64, 256, 256)]


def _randn(*shape, gen: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _numpy_ref(x, w, b) -> np.ndarray:
    y = np.matmul(x.double().numpy(), w.double().numpy().T)
    return y if b is None else y + b.double().numpy()


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_numpy(m, n, k, bias, dtype):
    gen = torch.Generator().manual_seed(m * n + k)
    x, w = _randn(m, k, gen=gen, dtype=dtype), _randn(n, k, gen=gen, dtype=dtype)
    b = _randn(n, gen=gen, dtype=dtype) if bias else None
    got = invariant_linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 2e-5 * k**0.5
    np.testing.assert_allclose(got.double().numpy(), _numpy_ref(x, w, b), rtol=tol, atol=tol)


# (M, N, K) and the width medium_config gives them: each of its three is launched
MEDIUM_SHAPES = [(17, 40, 200, 32), (100, 8192, 136, 64), (300, 6656, 72, 128)]


@pytest.mark.parametrize("m, n, k, block_n", MEDIUM_SHAPES)
def test_medium_tiles_match_numpy(m, n, k, block_n):
    config = bim.medium_config(m, n, k)
    assert config[0] == block_n  # the case covers the width it was written for
    gen = torch.Generator().manual_seed(m + n + k)
    x, w, b = _randn(m, k, gen=gen), _randn(n, k, gen=gen), _randn(n, gen=gen)
    out = torch.empty((m, n), dtype=torch.float64)
    bim._launch(x, w, b, out, config, bim.MEDIUM_BLOCK_M)
    np.testing.assert_allclose(out.numpy(), _numpy_ref(x, w, b), rtol=1e-12, atol=1e-12)


def test_bf16_is_rounded_once_to_nearest():
    """float32 sum + bias, one round-to-nearest: nearly every element equals the exact
    result rounded (a truncating store, the interpreter's own, misses about half)."""
    gen = torch.Generator().manual_seed(3)
    x, w = _randn(17, 200, gen=gen, dtype=torch.bfloat16), _randn(70, 200, gen=gen, dtype=torch.bfloat16)
    b = _randn(70, gen=gen, dtype=torch.bfloat16)
    got = invariant_linear(x, w, b)
    want = torch.from_numpy(_numpy_ref(x, w, b)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-5)


def test_leading_dims_and_strided_views():
    gen = torch.Generator().manual_seed(4)
    x = _randn(2, 3, 20, gen=gen)[..., :12]  # rows 20 apart: a view, not copied
    w_wide = _randn(9, 30, gen=gen)
    w = w_wide[:, 5:17]  # a weight view with unit last stride
    got = invariant_linear(x, w)
    assert got.shape == (2, 3, 9)
    np.testing.assert_allclose(got.numpy(), x.numpy() @ w.numpy().T, rtol=1e-12, atol=1e-12)
    x_t = _randn(12, 4, gen=gen).t()  # unit stride on the rows' axis: copied
    np.testing.assert_allclose(invariant_linear(x_t, w).numpy(), x_t.numpy() @ w.numpy().T,
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(AssertionError, match="unit last stride"):
        invariant_linear(x_t, _randn(12, 9, gen=gen).t())


def test_zero_rows_and_refused_tiles():
    w = torch.randn(8, 4, dtype=torch.float64)
    assert invariant_linear(torch.empty(0, 4, dtype=torch.float64), w).shape == (0, 8)
    assert invariant_linear(torch.empty(2, 0, 4, dtype=torch.float64), w).shape == (2, 0, 8)
    with pytest.raises(AssertionError):
        invariant_linear(torch.randn(3, 4, dtype=torch.float64), w, block_m=24)
    with pytest.raises(AssertionError):
        invariant_linear(torch.randn(3, 4), w)  # dtypes differ


def _positions_that_differ(linear, k: int, n: int, with_bias: bool = False) -> list:
    """(M, position, fill) where the needle row's result differs from the needle alone."""
    gen = torch.Generator().manual_seed(k + n)
    w = _randn(n, k, gen=gen)
    b = _randn(n, gen=gen) if with_bias else None
    needle = _randn(1, k, gen=gen)
    alone = linear(needle, w, b)[0]
    differ = []
    for m in (2, 3, 17, 64):
        for i, pos in enumerate(sorted({0, 7, m // 2, m - 1} & set(range(m)))):
            fill = ("random", "zeros", "large")[(m + i) % 3]  # zeros: padding rows
            batch = _randn(m, k, gen=gen) * (1e6 if fill == "large" else 1.0)
            if fill == "zeros":
                batch.zero_()
            batch[pos] = needle[0]
            if not torch.equal(linear(batch, w, b)[pos], alone):
                differ.append((m, pos, fill))
    return differ


@pytest.mark.parametrize("k, n, with_bias", [(40, 48, False), (200, 130, True)])
def test_a_row_is_bitwise_the_same_in_every_batch(k, n, with_bias):
    assert _positions_that_differ(invariant_linear, k, n, with_bias) == []


def test_f_linear_fails_the_same_check():
    # one row takes MKL's GEMV, many its GEMM: the check sees the difference
    assert _positions_that_differ(F.linear, 200, 130, True) != []


def test_config_rule_on_llama_and_qwen_shapes(monkeypatch):
    """BLOCK_N: the widest of 64/32/16 giving >= 64 column blocks, else 16; BLOCK_K from
    the dtype (clipped to K); one config under the interpreter. No M anywhere in the
    signature: the row count cannot pick the config."""
    monkeypatch.setattr(bim, "INTERPRET", False)
    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16
    block_ns = {n: bim.invariant_config(n, 4096, bf16, cuda)[0]
                for n in (6144, 4096, 28672, 128256, 2048, 2016, 1024, 64)}
    assert block_ns == {6144: 64, 4096: 64, 28672: 64, 128256: 64, 2048: 32, 2016: 16,
                        1024: 16, 64: 16}
    assert bim.invariant_config(4096, 14336, bf16, cuda) == (64, 128, 4, 6)
    assert bim.invariant_config(4096, 14336, torch.float32, cuda) == (64, 32, 4, 3)
    assert bim.invariant_config(4096, 40, bf16, cuda)[1] == 64
    assert bim.invariant_config(4096, 14336, bf16, "cpu") == bim._INTERPRETER_CONFIG

