"""Host tensors in page-locked (pinned) memory, wherever pinning is possible.

A host <-> device copy is truly asynchronous (`non_blocking=True`) only from or into
pinned memory, and only pinned memory can be mapped into the device's address space
(V2's UVA views). Pinning needs a CUDA driver: `pin_memory=True` raises on a machine
without one. So every pinned allocation of both runners goes through these helpers,
which pin when they can and otherwise return an ordinary host tensor (on a CPU-only
run "the device" is the CPU and nothing needs pinning).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def is_pin_memory_available() -> bool:
    """True when CUDA is present and host memory can be pinned."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError:
        return False
    return True


def pinned_empty(shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when pinning is possible."""
    return torch.empty(shape, dtype=dtype, pin_memory=is_pin_memory_available())


def pinned_zeros(shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor, page-locked when pinning is possible."""
    return torch.zeros(shape, dtype=dtype, pin_memory=is_pin_memory_available())
