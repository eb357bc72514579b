"""Host/device buffer pairs for V1's CPU-side input preparation.

V1 computes every per-step input in NumPy on the host and ships it to the device with
one `non_blocking` copy per buffer. A copy is only truly asynchronous from page-locked
(pinned) host memory, so the host side is pinned whenever CUDA exists. Pinning raises on
a machine without CUDA, hence the helper instead of an unconditional `pin_memory=True`.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch


@lru_cache(maxsize=1)
def is_pin_memory_available() -> bool:
    """Pinned host memory needs a CUDA driver; `torch.zeros(..., pin_memory=True)` raises
    without one (checked on the CPU machine)."""
    return torch.cuda.is_available()


def make_cpu_tensor(
    *size: int, dtype: torch.dtype, pin_memory: bool | None = None
) -> torch.Tensor:
    """A zeroed host tensor, pinned when CUDA exists (unless told otherwise)."""
    if pin_memory is None:
        pin_memory = is_pin_memory_available()
    return torch.zeros(*size, dtype=dtype, pin_memory=pin_memory)


class CpuGpuBuffer:
    """A persistent host tensor, its NumPy view and a device tensor of the same shape.

    `np` and `cpu` share memory: NumPy code writes, torch copies. On a CPU-only run the
    device tensor is still a separate tensor, so a step on CPU moves data exactly as a
    step on GPU does (and tests can check what was copied).

    Reuse hazard: the host side is overwritten every step. With asynchronous copies the
    caller must make sure the previous step's copy out of it has finished first (V1's
    input-prep barrier); this class does not synchronise.
    """

    def __init__(
        self,
        *size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool | None = None,
    ) -> None:
        self.cpu = make_cpu_tensor(*size, dtype=dtype, pin_memory=pin_memory)
        self.np: np.ndarray = self.cpu.numpy()
        self.gpu = torch.zeros_like(self.cpu, device=device)

    @property
    def shape(self) -> torch.Size:
        return self.cpu.shape

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first `n` rows (all when None) host -> device; returns the device view."""
        if n is None:
            return self.gpu.copy_(self.cpu, non_blocking=True)
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)

    def copy_to_cpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first `n` rows device -> host (blocking, so the NumPy view is valid)."""
        if n is None:
            return self.cpu.copy_(self.gpu)
        return self.cpu[:n].copy_(self.gpu[:n])
