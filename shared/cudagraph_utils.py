"""CUDA-graph helpers both runners use: the padding ladder and the batch predicates.

The capture sizes themselves are resolved once in policy's CompilationConfig; here is
only the arithmetic on them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


def padded_size(num: int, capture_sizes: list[int]) -> int | None:
    """The smallest capture size >= num (capture_sizes sorted ascending), or None when num
    is above the largest size (the step then runs eager at its real size)."""
    i = bisect.bisect_left(capture_sizes, num)
    return capture_sizes[i] if i < len(capture_sizes) else None


def is_uniform_decode(max_query_len: int, num_tokens: int, num_reqs: int) -> bool:
    """Every request decodes exactly one token: the only batches FULL graphs cover."""
    return max_query_len == 1 and num_tokens == num_reqs


@dataclass(frozen=True)
class BatchDescriptor:
    """The key of a captured graph: the mode and the padded sizes it was captured at."""

    mode: str  # "FULL" | "PIECEWISE" | "NONE"
    num_tokens: int  # padded token count (== padded request count for FULL decode)
    num_reqs: int | None  # padded request count for FULL; None for PIECEWISE / NONE
