"""Pinned host memory and zero-copy device views of it (UVA).

With unified virtual addressing (every 64-bit CUDA platform), page-locked host memory
from cudaHostAlloc is mapped into the device's address space, and the device pointer
that cudaHostGetDevicePointer returns for it is the host pointer itself. A kernel can
therefore read and write a pinned tensor through a CUDA tensor that wraps the same
address: no copy, coherent both ways. V2 keeps large, rarely-read state there
(all_token_ids) so it costs no device memory.

Without CUDA, pinning is impossible (torch raises), and "the device" is the CPU: the
pinned allocations (shared/runtime/host_buffers.py) and every helper here fall back to
plain CPU tensors, and the Triton kernels that read them run under the interpreter.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.runtime.host_buffers import is_pin_memory_available, pinned_empty


def is_uva_available() -> bool:
    """True when CUDA is present and host memory can be pinned (so mapped)."""
    # The same condition as pinning; a separate name keeps call sites honest about
    # what they need.
    return is_pin_memory_available()


class _CudaArrayView:
    """Exposes a pinned CPU tensor's memory through `__cuda_array_interface__`.

    It holds a reference to the CPU tensor: torch keeps this object alive as long as
    the CUDA tensor made from it, so the pinned memory outlives every view of it.
    """

    def __init__(self, cpu_tensor: torch.Tensor):
        self.cpu_tensor = cpu_tensor
        typestr = np.dtype(torch.empty(0, dtype=cpu_tensor.dtype).numpy().dtype).str
        itemsize = cpu_tensor.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(cpu_tensor.shape),
            "typestr": typestr,
            # Under UVA the device pointer of mapped pinned memory equals the host
            # pointer (what cudaHostGetDevicePointer returns for it).
            "data": (cpu_tensor.data_ptr(), False),
            "strides": tuple(s * itemsize for s in cpu_tensor.stride()),
            # None: the memory is not owned by a stream; nothing to synchronise on.
            "stream": None,
            "version": 3,
        }


def device_view_of_pinned(cpu_tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor aliasing `cpu_tensor`'s memory (zero copy).

    On CUDA, `cpu_tensor` must be pinned: kernels then read and write host memory over
    the bus through the returned `cuda` tensor. Without UVA the CPU tensor itself is
    returned (the device is the CPU).
    """
    if not is_uva_available():
        return cpu_tensor
    if not cpu_tensor.is_pinned():
        raise ValueError("device_view_of_pinned needs a pinned CPU tensor (use pinned_empty)")
    view = torch.as_tensor(_CudaArrayView(cpu_tensor), device="cuda")
    assert view.data_ptr() == cpu_tensor.data_ptr()
    return view


def async_copy_to_device(
    x: np.ndarray | torch.Tensor, device: torch.device | str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Send host data to the device through a FRESH pinned temporary, non_blocking.

    The temporary is never reused by us, so the CPU may change `x` (or the state it was
    packed from) right after this returns while the copy is still in flight: no async
    barrier. torch's pinned-memory allocator records the copy's stream and does not
    recycle the temporary's memory before the copy has finished.
    """
    src = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    if torch.device(device).type == "cpu":
        if out is None:
            return src.clone()
        out.copy_(src)
        return out
    tmp = pinned_empty(tuple(src.shape), src.dtype)
    tmp.copy_(src)
    if out is None:
        return tmp.to(device, non_blocking=True)
    out.copy_(tmp, non_blocking=True)
    return out
