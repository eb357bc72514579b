"""The batch-invariant matmul on the GPU (issue 26; GPU machine only), on llama-3-8b's layer
and LM-head shapes:

- bf16: a needle row alone is bitwise the same row inside M = 1, 2, 7, 17, 64, 256, 1024 at the
  first, a middle, the last position and row 7 of a tile, whatever the other rows hold
  (random, zeros as padding, large); and from CUDA graph replays of several batch sizes;
- float32 ("ieee" dots on CUDA cores) on two shapes, the same check;
- results close to the float64 product (bf16: within a rounding) and to cuBLAS's bf16;
- cuBLAS (F.linear) fails the same check on these shapes, so it has teeth.
The CPU side (the interpreter, float64): tests/shared/model/kernels/test_batch_invariant_matmul.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model.kernels.batch_invariant_matmul import invariant_linear

pytestmark = pytest.mark.gpu

SHAPES = {  # name: (N, K), llama-3-8b
    "qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
    "down": (4096, 14336), "lm_head": (128256, 4096),
}
BATCHES = (1, 2, 7, 17, 64, 256, 1024)
FILLS = ("random", "zeros", "large")


def _randn(*shape, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0):
    return (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype)


def _weight(name: str, dtype: torch.dtype, seed: int = 0):
    n, k = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # |y| ~ 1 for unit-variance rows, as a trained layer's outputs are
    return _randn(n, k, gen=gen, dtype=dtype, scale=k**-0.5), _randn(n, gen=gen, dtype=dtype)


def _batch(m: int, k: int, fill: str, gen: torch.Generator, dtype: torch.dtype):
    if fill == "zeros":  # padding rows
        return torch.zeros((m, k), dtype=dtype, device="cuda")
    return _randn(m, k, gen=gen, dtype=dtype, scale=100.0 if fill == "large" else 1.0)


def _differing(linear, name: str, dtype: torch.dtype, batches=BATCHES) -> list:
    """(M, position, fill) where the needle's row differs from the needle computed alone."""
    w, b = _weight(name, dtype)
    k = w.shape[1]
    gen = torch.Generator(device="cuda").manual_seed(1)
    needle = _randn(1, k, gen=gen, dtype=dtype)
    alone = linear(needle, w, b)[0]
    assert not alone.isnan().any() and alone.float().std() > 0.1
    differ = []
    for m in batches:
        for i, pos in enumerate(sorted({0, 7, m // 2, m - 1} & set(range(m)))):
            fill = FILLS[(m + i) % len(FILLS)]
            batch = _batch(m, k, fill, gen, dtype)
            batch[pos] = needle[0]
            if not torch.equal(linear(batch, w, b)[pos], alone):
                differ.append((m, pos, fill))
    return differ


@pytest.mark.parametrize("name", list(SHAPES))
def test_a_bf16_row_is_bitwise_the_same_in_every_batch(name):
    assert _differing(invariant_linear, name, torch.bfloat16) == []


@pytest.mark.parametrize("name", ["o_proj", "down"])
def test_a_float32_row_is_bitwise_the_same_in_every_batch(name):
    assert _differing(invariant_linear, name, torch.float32, batches=(1, 7, 64, 256)) == []


def test_cublas_fails_the_same_check():
    assert any(_differing(F.linear, name, torch.bfloat16) for name in SHAPES)


@pytest.mark.parametrize("name", ["o_proj", "down", "lm_head"])
def test_the_same_from_cuda_graph_replays(name):
    """Captured once per batch size, replayed on new rows: the needle's row equals it
    alone, eagerly. Nothing in a launch reads back to the host, so capture succeeds."""
    w, b = _weight(name, torch.bfloat16)
    k = w.shape[1]
    gen = torch.Generator(device="cuda").manual_seed(2)
    needle = _randn(1, k, gen=gen, dtype=torch.bfloat16)
    alone = invariant_linear(needle, w, b)[0]
    for m, pos in ((1, 0), (7, 3), (64, 37), (256, 255)):
        static_x = _randn(m, k, gen=gen, dtype=torch.bfloat16)
        invariant_linear(static_x, w, b)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = invariant_linear(static_x, w, b)
        static_x.copy_(_randn(m, k, gen=gen, dtype=torch.bfloat16))
        static_x[pos] = needle[0]
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out[pos], alone), (m, pos)
        # and the replay computed the whole new batch, not a stale buffer
        assert torch.equal(static_out, invariant_linear(static_x, w, b)), m


@pytest.mark.parametrize("name", list(SHAPES))
def test_close_to_float64_and_to_cublas(name):
    w, b = _weight(name, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = _randn(64, w.shape[1], gen=gen, dtype=torch.bfloat16)
    got = invariant_linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (64, w.shape[0])
    exact = F.linear(x.double(), w.double(), b.double())
    # a float32 sum rounded once to bf16: within one bf16 ulp (2^-7 relative) of exact
    torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=1e-3)
    # cuBLAS may reduce split-K partials in bf16: torch's default bf16 tolerance
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), rtol=1.6e-2, atol=1e-2)


def test_float32_is_exact_products_not_tf32():
    w, b = _weight("o_proj", torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = _randn(64, w.shape[1], gen=gen, dtype=torch.float32)
    exact = F.linear(x.double(), w.double(), b.double())
    # exact products: ~2e-6 rms off here; tf32 inputs (10-bit mantissas) would be ~4e-4
    torch.testing.assert_close(invariant_linear(x, w, b).double(), exact, rtol=1e-4, atol=1e-4)
