"""The batch-invariant matmul on the CPU: y = x W^T (+ b) over fixed 16-row tiles.

A CPU GEMM (MKL / oneDNN behind torch, OpenBLAS behind numpy) picks its kernel by the row
count: one row goes through a GEMV and many through a GEMM, with other reduction orders,
so a token's result changes with its batch (the test shows it). Here every call the
library sees has the same shape, [16, K] x [K, N] (the rows zero-padded to a multiple of
16, one batched GEMM over the tiles), so each row is computed by the same kernel whatever
M is; and torch's CPU GEMM gives a row the same result at every position of its tile and
whatever the other rows hold (checked by tests/shared/model/kernels/test_batch_invariant_cpu.py
on the GEMM it ships with). OpenBLAS's float32 GEMM does not (rows 6-11 of a 16-row tile
differ from rows 0-5), which is why a model on the CPU does not run the Triton kernel
(batch_invariant_matmul) under the interpreter: the interpreter's tl.dot is numpy's matmul.

The bias is added after the matmul, in the model dtype, as F.linear's CPU path does for a
row alone.
"""

from __future__ import annotations

import torch

TILE_ROWS = 16


def invariant_linear_cpu(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K] -> [..., N], each row's result independent of the others."""
    assert not x.is_cuda and weight.shape[-1] == x.shape[-1], (x.shape, weight.shape)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    tiles = -(-m // TILE_ROWS)
    padded = rows.new_zeros((tiles * TILE_ROWS, k))
    padded[:m] = rows
    w_t = weight.t()
    out = torch.bmm(padded.view(tiles, TILE_ROWS, k), w_t.expand(tiles, *w_t.shape))
    out = out.reshape(tiles * TILE_ROWS, weight.shape[0])[:m]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])
