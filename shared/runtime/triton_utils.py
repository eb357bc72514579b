"""Import Triton through this module in every kernel file.

On a machine without a CUDA GPU, Triton kernels can only run under the Triton
interpreter, and the interpreter is chosen when `@triton.jit` is applied (Triton reads
TRITON_INTERPRET then). So this module sets TRITON_INTERPRET=1 before any kernel module
decorates its kernels, and logs that once. On a GPU machine it changes nothing.

Import order: when something imported `triton` before this module (the user, or a
library), Triton's own library functions (`tl.zeros`, `tl.sum`'s combiner, `tl.rand`,
...) were already decorated for the compiler, and an interpreted kernel that calls them
fails with "Cannot call @triton.jit'd outside of the scope of a kernel". Triton has no
switch that re-decorates them, so `_reinterpret_triton_library` does what importing
Triton under TRITON_INTERPRET=1 would have done: wrap each of those functions for the
interpreter, once, then checks with a probe kernel and fails at once with what to do
if that did not work.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from policy.logging_setup import configure_logging

# The runnerlab handler must exist before the interpreter line below is logged: this
# module can be imported before `policy` (a kernel test, a script).
logger = configure_logging()

HAS_CUDA = torch.cuda.is_available()
_TRITON_IMPORTED_BEFORE = "triton" in sys.modules
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    logger.info("No CUDA GPU: Triton kernels run under the Triton interpreter (TRITON_INTERPRET=1).")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from shared.runtime.kernel_options import kernel_options  # noqa: E402

__all__ = [
    "HAS_CUDA", "INTERPRET", "triton", "tl", "next_power_of_2", "use_pdl", "pdl_launch",
    "pdl_wait_and_release",
]

# Programmatic dependent launch (sm_90+): kernels that call gdc_wait() before reading their
# predecessor's output may be launched while it drains. KernelOptions.pdl is the one switch
# for every such kernel (benchmarks turn it off to measure the difference).


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def use_pdl(x: torch.Tensor) -> bool:
    """Launch with launch_pdl=True: a CUDA tensor on sm_90 or newer, outside the interpreter."""
    return (x.is_cuda and not INTERPRET and kernel_options().pdl
            and _capability(x.device) >= (9, 0))


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


class TritonImportOrderError(RuntimeError):
    """Triton was imported before runnerlab in a way the interpreter cannot recover from."""


def _reinterpret_triton_library() -> int:
    """Wrap every compiler-decorated function of triton.language.* for the interpreter
    (one wrapper per function, so the names that alias it keep pointing at one object).
    Returns how many were wrapped."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, object] = {}
    modules = [m for name, m in list(sys.modules.items())
               if m is not None and (name == "triton.language" or name.startswith("triton.language."))]
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in wrapped:
                    wrapped[id(value)] = InterpretedFunction(value.fn)
                setattr(module, name, wrapped[id(value)])
    return len(wrapped)


@triton.jit
def _probe_kernel(out_ptr, BLOCK: tl.constexpr):
    x = tl.zeros([BLOCK], dtype=tl.float32) + tl.arange(0, BLOCK).to(tl.float32)
    r = tl.rand(0, tl.arange(0, BLOCK))
    tl.store(out_ptr, tl.sum(x, 0) + tl.argmax(x, 0) + tl.cdiv(BLOCK, 2) + tl.max(r * 0.0, 0))


def _check_interpreter() -> None:
    out = torch.zeros(1, dtype=torch.float32)
    try:
        _probe_kernel[(1,)](out, BLOCK=4)
        ok = out.item() == 6.0 + 3.0 + 2.0
    except Exception as exc:  # the interpreter's own error says little: replace it
        ok = False
        logger.debug("Triton interpreter probe failed: %r", exc)
    if not ok:
        raise TritonImportOrderError(
            "Triton was imported before runnerlab without TRITON_INTERPRET=1 on a machine "
            "without CUDA, and its library could not be switched to the interpreter. Set "
            "TRITON_INTERPRET=1 in the environment (or import shared before triton)."
        )


if INTERPRET and _TRITON_IMPORTED_BEFORE:
    from triton.runtime.jit import JITFunction as _JITFunction

    if isinstance(tl.standard.zeros, _JITFunction):
        _n = _reinterpret_triton_library()
        logger.info(
            "triton was imported before runnerlab: switched %d Triton library functions to the "
            "interpreter.", _n,
        )
        _check_interpreter()
