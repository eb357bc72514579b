"""RepeatLaunch: one Triton kernel launched again and again with the same grid, the same
compile-time settings and arguments of one kind (the layers of a step, each with its own
tensors), at the C launcher's cost after the first.

`kernel[grid](...)` runs Triton's JIT dispatch every time: bind the arguments, specialise
each one (dtype, 16-byte alignment of a pointer, an int's value 1 or divisibility by 16),
hash the specialisation, look the compiled kernel up. For a kernel of thirty arguments that
is most of a launch's host time (scripts/bench_attention_host.py), paid per layer by the
eager attention between piecewise graphs. The first call here goes through the JIT and
keeps the compiled kernel it returns; a later call whose arguments would specialise the
same way launches that kernel directly. "The same way" is checked, not assumed: every
tensor keeps its dtype and a 16-byte-aligned pointer when the first call's was aligned,
every other argument is equal to the first call's. A call that differs goes through the
JIT (which finds or compiles its own variant), never through the kept kernel, so a kept
kernel never sees an argument it was not specialised for; nor another GPU than the one
it was loaded on (the current device is checked too). Only tensors and plain scalars
(int, float, bool, str, None) are compared; a call with any other argument (a tuple, a
tensor descriptor) keeps nothing.

What the kept path does not repeat from the JIT's: its pre-run hooks and its check that
the globals a kernel read have not changed, and the knobs in its cache key (debug,
instrumentation) are taken as they were at the first call. The runner's kernels use
none of these; a kernel that does should not be launched through this.

Under the interpreter there is no compiled kernel: every call is a JIT call.

KeptLaunches does the same for a kernel launched once per step with a grid that follows
the batch (V2's input preparation, sampler and post-update, the shared noise): one
RepeatLaunch per (grid, compile-time arguments), made at its first call.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import torch

from shared.runtime.kernel_options import kernel_options
from shared.runtime.triton_utils import HAS_CUDA, INTERPRET


class RepeatLaunch:
    """`RepeatLaunch(kernel, grid, **kwargs)(*args)` is `kernel[grid](*args, **kwargs)`.

    kwargs (constexprs and launch options) are fixed at construction; each call passes
    the positional arguments, in the kernel's parameter order, that every call has.
    keep=False: every call is a JIT call (KernelOptions.repeat_launches, to price this).
    """

    def __init__(self, kernel: Any, grid: tuple[int, ...], keep: bool = True, **kwargs: Any):
        self.kernel = kernel
        self.keep = keep and not INTERPRET
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.kwargs = kwargs
        self._runner = None  # the kept kernel's launcher, after a JIT call that can keep it
        self._first: tuple = ()  # that call's arguments' specialisation keys
        self._tail: tuple = ()  # the kernel's remaining parameters, in order, from kwargs
        self._device = -1  # the CUDA device current at that call

    def __call__(self, *args: Any) -> None:
        if (self._runner is not None and self._specialised_alike(args)
                and _current_device() == self._device):
            self._runner(*args, *self._tail)
            return
        compiled = self.kernel[self.grid](*args, **self.kwargs)
        if self._runner is None and self.keep and compiled is not None:
            self._keep(compiled, args)

    def _keep(self, compiled: Any, args: tuple) -> None:
        if not all(isinstance(a, _KEPT_TYPES) for a in args):
            return  # an argument this rule does not model: stay on the JIT path
        params = _parameters(self.kernel.fn)[len(args):]
        tail = []
        for p in params:  # the rest as the JIT binds them: by name, else the default
            if p.name in self.kwargs:
                tail.append(self.kwargs[p.name])
            elif p.default is not inspect.Parameter.empty:
                tail.append(p.default)
            else:
                return  # not a launch the JIT accepted; stay on the JIT path
        self._first = tuple(_key(a) for a in args)
        self._tail = tuple(tail)
        self._device = _current_device()
        self._runner = compiled[self.grid]

    def _specialised_alike(self, args: tuple) -> bool:
        first = self._first
        if len(args) != len(first):
            return False
        for a, k in zip(args, first):
            if isinstance(a, torch.Tensor):
                # an unaligned pointer where the first was aligned would break the kept
                # kernel's vectorised loads; the reverse is harmless
                if (type(k) is not _TensorKey or a.dtype is not k.dtype
                        or (k.aligned and a.data_ptr() % 16)):
                    return False
            elif type(a) is not type(k) or a != k:
                return False
        return True


class KeptLaunches:
    """`KeptLaunches(kernel)(grid, *args, **kwargs)` is `kernel[grid](*args, **kwargs)`:
    positional arguments are the runtime ones, every call the same count; kwargs the
    constexprs and launch options. A per-step kernel pays Triton's dispatch (binding and
    specialising a dozen or more arguments: docs/results/README.md, mixed steps and the
    sample stage's host time) at every launch; here a grid and
    kwargs seen before launch the kernel kept for them (RepeatLaunch's rule decides, per
    call, whether the kept kernel may run it). KernelOptions.repeat_launches False: every
    call through the JIT."""

    # Distinct (grid, kwargs) kept at most: grids follow the batch size, so a long run
    # sees at most a few per batch size; past this the cache starts again.
    MAX_KEPT = 4096

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._launches: dict[tuple, RepeatLaunch] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if INTERPRET or not kernel_options().repeat_launches:
            self.kernel[grid](*args, **kwargs)
            return
        key = (tuple(grid), *kwargs.items())
        launch = self._launches.get(key)
        if launch is None:
            if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
                # a tensor bound by name would key the cache by its identity
                self.kernel[grid](*args, **kwargs)
                return
            if len(self._launches) >= self.MAX_KEPT:
                self._launches.clear()
            launch = self._launches[key] = RepeatLaunch(self.kernel, grid, **kwargs)
        launch(*args)


_KEPT: dict[int, KeptLaunches] = {}


def kept(kernel: Any) -> KeptLaunches:
    """The process's KeptLaunches of `kernel` (a module-level Triton kernel): call sites
    write `kept(kernel)(grid, *args, **constexprs)` where they wrote `kernel[grid](...)`."""
    launches = _KEPT.get(id(kernel))
    if launches is None or launches.kernel is not kernel:
        launches = _KEPT[id(kernel)] = KeptLaunches(kernel)
    return launches


# The argument types a kept kernel's calls are compared in (tensors by dtype and alignment,
# the rest by type and value); a bool is an int, listed for the reader.
_KEPT_TYPES = (torch.Tensor, bool, int, float, str, type(None))


def _current_device() -> int:
    return torch.cuda.current_device() if HAS_CUDA else -1


@functools.cache
def _parameters(fn: Any) -> tuple[inspect.Parameter, ...]:
    """A kernel function's parameters, in order (inspect.signature costs tens of us, and
    a plan's launches are set up every step)."""
    return tuple(inspect.signature(fn).parameters.values())


class _TensorKey(NamedTuple):
    dtype: torch.dtype
    aligned: bool  # a 16-byte-aligned pointer: what Triton specialises a pointer on


def _key(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return _TensorKey(arg.dtype, arg.data_ptr() % 16 == 0)
    return arg
