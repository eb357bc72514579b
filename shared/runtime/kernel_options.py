"""The engine's KernelOptions, where the kernel launchers find them.

The engine installs its options (`use_kernel_options`) around each step and around its
set-up (model load, memory profiling, CUDA-graph capture); a launcher asks
`kernel_options()`. A contextvar, not a module global: two engines in one process each
see their own, and a launcher called outside any engine (a kernel test, a script) gets
the defaults unless the caller installs others.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from policy.kernel_options import KernelOptions

DEFAULT_KERNEL_OPTIONS = KernelOptions()

_OPTIONS: contextvars.ContextVar[KernelOptions] = contextvars.ContextVar(
    "runnerlab_kernel_options", default=DEFAULT_KERNEL_OPTIONS
)


def kernel_options() -> KernelOptions:
    return _OPTIONS.get()


@contextlib.contextmanager
def use_kernel_options(options: KernelOptions) -> Iterator[KernelOptions]:
    token = _OPTIONS.set(options)
    try:
        yield options
    finally:
        _OPTIONS.reset(token)
