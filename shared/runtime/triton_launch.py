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
every int its class (_int_class: type by range, whether it is 1, whether 16 divides it),
every float or bool its type (Triton compiles neither's value in), every other argument
is equal to the first call's. A call that differs goes through the
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
the batch (V2's input preparation, sampler and post-update, the shared noise): one kept
kernel per set of compile-time arguments, made at its first call, launched on each call's
grid; `bind` gives a plan (the paged attention's per-layer launches) the same kernel, so
that a step's plan starts from the kernel an earlier step kept.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import torch

from shared.runtime.kernel_options import kernel_options
from shared.runtime.triton_utils import HAS_CUDA, INTERPRET


class _KeptKernel:
    """One kernel with its compile-time arguments fixed: after the first JIT call that can
    keep one, the compiled kernel, launched on any grid (a grid is not part of what Triton
    compiles) for every call whose arguments specialise as that first call's did."""

    # Grids whose launcher is kept at most; past this the grids start again (a runner's
    # grids follow its batch sizes, so a long run sees a few hundred at most).
    MAX_GRIDS = 4096

    def __init__(self, kernel: Any, keep: bool, kwargs: dict[str, Any]):
        self.kernel = kernel
        self.keep = keep and not INTERPRET
        self.kwargs = kwargs
        self._compiled = None  # the kept compiled kernel, after a JIT call that can keep it
        self._runners: dict[tuple[int, int, int], Any] = {}  # its launcher per grid
        self._first: tuple = ()  # that call's arguments' specialisation keys
        self._tail: tuple = ()  # the kernel's remaining parameters, in order, from kwargs
        self._device = -1  # the CUDA device current at that call

    def launch(self, grid: tuple[int, int, int], args: tuple) -> None:
        if (self._compiled is not None and self._specialised_alike(args)
                and _current_device() == self._device):
            runner = self._runners.get(grid)
            if runner is None:
                if len(self._runners) >= self.MAX_GRIDS:
                    self._runners.clear()
                runner = self._runners[grid] = self._compiled[grid]
            runner(*args, *self._tail)
            return
        compiled = self.kernel[grid](*args, **self.kwargs)
        if self._compiled is None and self.keep and compiled is not None:
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
        self._compiled = compiled

    def _specialised_alike(self, args: tuple) -> bool:
        first = self._first
        if len(args) != len(first):
            return False
        for a, k in zip(args, first):
            kind = type(k)
            if kind is _TensorKey:
                # an unaligned pointer where the first was aligned would break the kept
                # kernel's vectorised loads; the reverse is harmless
                if (not isinstance(a, torch.Tensor) or a.dtype is not k.dtype
                        or (k.aligned and a.data_ptr() % 16)):
                    return False
            elif kind is _IntKey:
                if type(a) is not int or (a != k.value and _int_class(a) != k.cls):
                    return False
            elif kind is type:  # a float or a bool: Triton compiles its type, not its value
                if type(a) is not k:
                    return False
            elif type(a) is not type(k) or a != k:
                return False
        return True


class RepeatLaunch:
    """`RepeatLaunch(kernel, grid, **kwargs)(*args)` is `kernel[grid](*args, **kwargs)`.

    kwargs (constexprs and launch options) are fixed at construction; each call passes
    the positional arguments, in the kernel's parameter order, that every call has.
    keep=False: every call is a JIT call (KernelOptions.repeat_launches, to price this).
    """

    def __init__(self, kernel: Any, grid: tuple[int, ...], keep: bool = True, **kwargs: Any):
        self._kept = _KeptKernel(kernel, keep, kwargs)
        self.grid = _grid3(grid)

    @classmethod
    def on(cls, kept: _KeptKernel, grid: tuple[int, ...]) -> RepeatLaunch:
        """A launch of `kept` (shared with other grids and other plans) on `grid`."""
        launch = cls.__new__(cls)
        launch._kept, launch.grid = kept, _grid3(grid)
        return launch

    @property
    def kernel(self) -> Any:
        return self._kept.kernel

    @property
    def kwargs(self) -> dict[str, Any]:
        return self._kept.kwargs

    def __call__(self, *args: Any) -> None:
        self._kept.launch(self.grid, args)


class KeptLaunches:
    """`KeptLaunches(kernel)(grid, *args, **kwargs)` is `kernel[grid](*args, **kwargs)`:
    positional arguments are the runtime ones, every call the same count; kwargs the
    constexprs and launch options. A per-step kernel pays Triton's dispatch (binding and
    specialising a dozen or more arguments: docs/results/README.md, mixed steps and the
    sample stage's host time) at every launch; here kwargs seen before launch the kernel
    kept for them, on whatever grid the call has (the rule of _KeptKernel decides, per
    call, whether the kept kernel may run it). Grids follow the batch, so a kernel kept
    per grid would go through the JIT again at every new batch size, which a churning
    batch meets nearly every step. KernelOptions.repeat_launches False: every call
    through the JIT."""

    # Distinct kwargs kept at most (a kernel has a handful of constexpr variants); past
    # this the cache starts again.
    MAX_KEPT = 1024

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._launches: dict[tuple, _KeptKernel] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if INTERPRET or not kernel_options().repeat_launches:
            self.kernel[grid](*args, **kwargs)
            return
        kept_kernel = self._kept_for(kwargs)
        if kept_kernel is None:
            self.kernel[grid](*args, **kwargs)
        else:
            kept_kernel.launch(_grid3(grid), args)

    def bind(self, grid: tuple[int, ...], keep: bool = True, **kwargs: Any) -> RepeatLaunch:
        """`bind(grid, **kwargs)(*args)` is `self(grid, *args, **kwargs)`, with the kwargs'
        lookup done once: for a plan that launches the kernel once per layer."""
        kept_kernel = self._kept_for(kwargs) if keep and not INTERPRET else None
        if kept_kernel is None:
            return RepeatLaunch(self.kernel, grid, False, **kwargs)
        return RepeatLaunch.on(kept_kernel, grid)

    def _kept_for(self, kwargs: dict[str, Any]) -> _KeptKernel | None:
        """The kernel kept for these kwargs, made at their first call; None where a
        tensor is bound by name (it would key the cache by its identity)."""
        key = tuple(kwargs.items())
        kept_kernel = self._launches.get(key)
        if kept_kernel is None:
            if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
                return None
            if len(self._launches) >= self.MAX_KEPT:
                self._launches.clear()
            kept_kernel = self._launches[key] = _KeptKernel(self.kernel, True, kwargs)
        return kept_kernel


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


class _IntKey(NamedTuple):
    value: int  # the first call's (equal to it: alike without computing the class)
    cls: tuple[int, bool, bool]  # _int_class(value)


def _int_class(a: int) -> tuple[int, bool, bool]:
    """What Triton compiles an int argument for: its type by range (i32, i64, u64), whether
    it is 1 (a constant) and whether 16 divides it. Ints of one class run the same compiled
    kernel (a parameter Triton does not specialise has one class for every value; telling
    its values apart here costs a JIT call, never a wrong launch)."""
    kind = 0 if -2**31 <= a < 2**31 else (2 if 2**63 <= a < 2**64 else 1)
    return kind, a == 1, a % 16 == 0


def _key(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return _TensorKey(arg.dtype, arg.data_ptr() % 16 == 0)
    if type(arg) is int:
        return _IntKey(arg, _int_class(arg))
    if type(arg) in (float, bool):
        return type(arg)
    return arg  # None, a str: alike when equal


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    return tuple(grid) + (1,) * (3 - len(grid))
