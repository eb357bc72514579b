"""Where a rank's parameter sits in the single-GPU (logical) parameter: the shard spec
that sharded loading and the dummy init share.

A spec is generic, not a weight-loader per layer: every parameter is read as a matrix
of logical rows, [-1, C] with C its last dim (a 1-D parameter is [n, 1], one element a
row), and this rank keeps some of those rows and one column range of each:

- `rows`: ranges of logical rows, concatenated in order = the local rows. A column-
  parallel layer keeps its slice of every fused part (q|k|v, gate|up, and per expert);
  a replicated KV head is one range; replicated and row-parallel parameters keep all rows;
- `cols`: the logical columns every local row keeps: a row-parallel layer's input slice;
- local rows past the ranges are padding (the vocab padded to a multiple of the ranks):
  zero, and never read.

Why generic: both fillers stream logical rows through one function. A checkpoint tensor
is a block of logical rows (q_proj is rows [0, q) of qkv's logical [q+2kv, H]; expert e's
down_proj is rows [e*H, (e+1)*H) of [E*H, I]), and a dummy chunk of the logical random
stream is too: `copy_logical_rows` keeps what this rank holds of either, so no whole
sharded tensor is ever put on the device. A layer states its spec once, at construction
(`set_shard_spec`); a parameter with none is replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_ATTR = "tp_shard"  # the attribute a parameter carries its spec in (vLLM's weight attrs)


@dataclass(frozen=True)
class ShardSpec:
    logical_shape: tuple[int, ...]
    rows: tuple[tuple[int, int], ...]  # logical row ranges, local order
    cols: tuple[int, int]  # logical columns kept, [start, stop)

    @property
    def num_rows(self) -> int:
        """Local rows that hold logical data (the rest is padding)."""
        return sum(stop - start for start, stop in self.rows)


def row_width(shape: tuple[int, ...] | torch.Size) -> int:
    return shape[-1] if len(shape) >= 2 else 1


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dim] ([n, 1] for a vector): a view (t must be contiguous, so that
    writes into it land in t)."""
    return t.view(-1, row_width(t.shape))


def replicated(shape: tuple[int, ...] | torch.Size) -> ShardSpec:
    shape = tuple(shape)
    width = row_width(shape)
    return ShardSpec(shape, ((0, math.prod(shape) // width),), (0, width))


def set_shard_spec(param: torch.Tensor, spec: ShardSpec) -> None:
    """Attach `spec` to the local parameter `param`, checking that the shapes agree."""
    local = as_rows(param.detach())
    rows, width = local.shape
    start, stop = spec.cols
    if stop - start != width or spec.num_rows > rows or row_width(spec.logical_shape) < stop:
        raise ValueError(f"shard spec {spec} does not fit a local parameter {tuple(param.shape)}")
    setattr(param, _ATTR, spec)


def shard_spec(param: torch.Tensor) -> ShardSpec:
    return getattr(param, _ATTR, None) or replicated(param.shape)


def logical_rows(shape: tuple[int, ...], index: tuple) -> tuple[int, int, tuple[int, ...]]:
    """The logical rows that `logical[index]` covers (index: ints / slices of the leading
    dims, as the loader's names resolve) -> (first row, stop row, its shape). Worked out
    on a meta tensor: nothing is allocated."""
    view = torch.empty(shape, device="meta")[index]
    width = row_width(shape)
    if not view.is_contiguous() or view.storage_offset() % width or view.numel() % width:
        raise ValueError(f"index {index} of a {shape} parameter is not a block of whole rows")
    start = view.storage_offset() // width
    return start, start + view.numel() // width, tuple(view.shape)


def copy_logical_rows(dst: torch.Tensor, spec: ShardSpec, start: int, src: torch.Tensor) -> None:
    """src [n, C] = logical rows [start, start + n): copy what this rank keeps of them into
    the local parameter `dst` (on any device; only the kept slice travels)."""
    local = as_rows(dst)
    c0, c1 = spec.cols
    stop = start + src.shape[0]
    offset = 0
    for first, last in spec.rows:
        lo, hi = max(first, start), min(last, stop)
        if lo < hi:
            local[offset + lo - first : offset + hi - first].copy_(
                src[lo - start : hi - start, c0:c1])
        offset += last - first


def zero_padding(dst: torch.Tensor, spec: ShardSpec) -> None:
    """Zero the local rows past the spec's ranges (the vocab padding)."""
    as_rows(dst)[spec.num_rows :].zero_()
