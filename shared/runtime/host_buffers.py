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
from collections.abc import Sequence

import numpy as np
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


# Packed arrays start at multiples of this many bytes: every dtype's view of its slice is
# aligned (torch's view(dtype) needs it), and so is every pointer a Triton kernel gets
# (it specialises on 16-byte divisibility: one compiled variant, not two).
_PACK_ALIGN = 16


def copy_packed_to_device(arrays: Sequence[np.ndarray],
                          device: torch.device | str) -> list[torch.Tensor]:
    """Several small host arrays to the device in ONE non_blocking copy: packed into a
    fresh pinned byte buffer, copied, and handed back as device views of their own dtype
    and shape. A step's index arrays are a few hundred bytes each; one copy per array
    costs a launch and a pinned allocation each on the host, which is most of their cost.

    Fresh buffer: the caller may change the arrays as soon as this returns, while the copy
    is still in flight (torch's pinned allocator keeps the buffer until the copy is done).
    Without CUDA the result is a host tensor that shares nothing with the arrays."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _PACK_ALIGN) * _PACK_ALIGN
    host = pinned_empty(max(total, _PACK_ALIGN), torch.uint8)
    packed = host.numpy()
    for a, start in zip(arrays, offsets):
        packed[start : start + a.nbytes] = a.reshape(-1).view(np.uint8)
    dev = host if torch.device(device).type == "cpu" else host.to(device, non_blocking=True)
    out = []
    for a, start in zip(arrays, offsets):
        t = dev[start : start + a.nbytes].view(_torch_dtype(a.dtype))
        out.append(t if a.ndim == 1 else t.view(a.shape))
    return out


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
