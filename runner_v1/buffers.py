"""Host/device buffer pairs for V1's CPU-side input preparation.

V1 computes every per-step input in NumPy on the host and ships it to the device with
one `non_blocking` copy per buffer. A copy is only truly asynchronous from page-locked
(pinned) host memory, so the host side is pinned wherever pinning is possible
(shared/runtime/host_buffers.py; it is not without CUDA).
"""

from __future__ import annotations

import numpy as np
import torch

from shared.runtime.host_buffers import pinned_zeros


class CpuGpuBuffer:
    """A persistent host tensor, its NumPy view and a device tensor of the same shape.

    `np` and `cpu` share memory: NumPy code writes, torch copies. On a CPU-only run the
    device tensor is still a separate tensor, so a step on CPU moves data exactly as a
    step on GPU does (and tests can check what was copied).

    Reuse hazard: the host side is overwritten every step. With asynchronous copies the
    caller must make sure the previous step's copy out of it has finished first (V1's
    input-prep barrier); this class does not synchronise.
    """

    def __init__(self, *size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.cpu = pinned_zeros(size, dtype)
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
