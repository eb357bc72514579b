"""Import Triton through this module in every kernel file.

On a machine without a CUDA GPU, Triton kernels can only run under the Triton
interpreter, and the interpreter is chosen when `@triton.jit` is applied (it reads
TRITON_INTERPRET then). So this module sets TRITON_INTERPRET=1 before any kernel module
decorates its kernels, and logs that once. On a GPU machine it changes nothing.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger("runnerlab")

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    logger.info("No CUDA GPU: Triton kernels run under the Triton interpreter (TRITON_INTERPRET=1).")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = [
    "HAS_CUDA", "INTERPRET", "triton", "tl", "next_power_of_2", "use_pdl", "pdl_launch",
    "pdl_wait_and_release",
]

# Programmatic dependent launch (sm_90+): kernels that call gdc_wait() before reading their
# predecessor's output may be launched while it drains. One switch for every such kernel
# (benchmarks flip it to measure the difference).
PDL_ENABLED = True


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def use_pdl(x: torch.Tensor) -> bool:
    """Launch with launch_pdl=True: a CUDA tensor on sm_90 or newer, outside the interpreter."""
    return PDL_ENABLED and x.is_cuda and not INTERPRET and _capability(x.device) >= (9, 0)


def pdl_launch(x: torch.Tensor) -> dict:
    """Launch options for a kernel with a USE_PDL constexpr that calls pdl_wait_and_release
    before it touches memory another kernel writes: {} where PDL is off or unsupported."""
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl(x) else {}


@triton.jit
def pdl_wait_and_release():
    """Inside a kernel launched with launch_pdl=True: wait until the kernels before it have
    finished and their writes are visible (griddepcontrol.wait), then let the next
    PDL-launched kernel be scheduled while this one runs. Nothing that reads another
    kernel's output, or writes memory that another kernel reads, may come before it."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)
