"""RepeatLaunch's rule, against a model of Triton's own specialisation: a call reuses the
kept compiled kernel only where that kernel runs it correctly (its arguments specialised
as the kernel was compiled, or an aligned pointer where it assumed no alignment), and it
does reuse it for calls that differ only in which tensors they pass. The kernel here is a stand-in
that records which path a call took; the real kernels run on the GPU
(tests/gpu/shared/runtime/test_triton_launch_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shared.runtime.triton_launch as triton_launch
from policy.kernel_options import KernelOptions
from shared.runtime.kernel_options import use_kernel_options
from shared.runtime.triton_launch import KeptLaunches, RepeatLaunch, kept


def _kernel_fn(x_ptr, n, scale, y_ptr, BLOCK, FLAG=True):  # noqa: N803 (Triton's names)
    pass


class _Compiled:
    def __init__(self, log: list):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("kept", grid, args))


class _Kernel:
    """`kernel[grid](*args, **kwargs)` as Triton's JIT has it: launches, returns the
    compiled kernel."""

    fn = staticmethod(_kernel_fn)

    def __init__(self):
        self.log: list = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _Compiled(self.log)
        return launch


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch):
    """As on a GPU: the JIT returns compiled kernels (under the interpreter it does not)."""
    monkeypatch.setattr(triton_launch, "INTERPRET", False)


def _triton_specialisation(args: tuple) -> tuple:
    """What Triton keys a compiled kernel on, per argument: a tensor's dtype and whether
    its pointer is 16-byte aligned; an int's type range, whether it is 1 and whether 16
    divides it; a float's type; a bool's type."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(("ptr", a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            out.append(("u1",))
        elif isinstance(a, int):
            out.append(("i32" if -2**31 <= a < 2**31 else "i64", a == 1, a % 16 == 0))
        else:
            out.append(("fp32",))
    return tuple(out)


def _runs_correctly(compiled_for: tuple, call: tuple) -> bool:
    """A kernel compiled for one specialisation runs a call of another correctly where
    every argument is specialised alike, except that a kernel that assumed nothing of a
    pointer's alignment takes an aligned one too."""
    return len(compiled_for) == len(call) and all(
        c == k or (c[0] == k[0] == "ptr" and c[1] == k[1] and not k[2])
        for k, c in zip(compiled_for, call))


def test_later_calls_launch_the_kept_kernel_with_every_parameter_in_order():
    kernel = _Kernel()
    launch = RepeatLaunch(kernel, (4, 2), BLOCK=64, num_warps=4)
    x, y = torch.zeros(8), torch.zeros(8)
    launch(x, 8, 0.5, y)
    x2, y2 = torch.zeros(8), torch.zeros(8)
    launch(x2, 8, 0.5, y2)
    assert kernel.log[0] == ("jit", (4, 2, 1), (x, 8, 0.5, y), {"BLOCK": 64, "num_warps": 4})
    # the compiled kernel's launcher takes every parameter (constexprs too, which it
    # ignores); a defaulted one its default; a launch option is not a parameter
    assert kernel.log[1] == ("kept", (4, 2, 1), (x2, 8, 0.5, y2, 64, True))


@pytest.mark.parametrize("change", ["unaligned", "dtype", "int", "int_to_bool", "float",
                                    "tensor_for_int"])
def test_a_call_specialised_otherwise_goes_through_the_jit(change):
    kernel = _Kernel()
    launch = RepeatLaunch(kernel, (1,), BLOCK=16)
    x, y = torch.zeros(64), torch.zeros(64)
    launch(x, 16, 0.5, y)
    args = {
        "unaligned": (x[1:], 16, 0.5, y),  # 4 bytes past an aligned allocation
        "dtype": (x.double(), 16, 0.5, y),
        "int": (x, 17, 0.5, y),
        "int_to_bool": (x, True, 0.5, y),
        "float": (x, 16, 0.25, y),
        "tensor_for_int": (x, y, 0.5, y),
    }[change]
    launch(*args)
    launch(x, 16, 0.5, y)  # and the kept kernel stays the first call's
    assert [e[0] for e in kernel.log] == ["jit", "jit", "kept"]


def test_a_kernel_first_kept_for_an_unaligned_pointer_takes_aligned_ones():
    kernel = _Kernel()
    launch = RepeatLaunch(kernel, (1,), BLOCK=16)
    x, y = torch.zeros(64), torch.zeros(64)
    launch(x[1:], 16, 0.5, y)
    launch(x, 16, 0.5, y)
    launch(x[1:], 16, 0.5, y)
    assert [e[0] for e in kernel.log] == ["jit", "kept", "kept"]


def test_keep_false_and_the_interpreter_launch_through_the_jit(monkeypatch):
    x, y = torch.zeros(8), torch.zeros(8)
    kernel = _Kernel()
    launch = RepeatLaunch(kernel, (1,), keep=False, BLOCK=16)
    for _ in range(3):
        launch(x, 8, 0.5, y)
    monkeypatch.setattr(triton_launch, "INTERPRET", True)
    interpreted = RepeatLaunch(kernel, (1,), BLOCK=16)
    for _ in range(3):
        interpreted(x, 8, 0.5, y)
    assert [e[0] for e in kernel.log] == ["jit"] * 6


def test_a_missing_parameter_never_keeps_a_kernel():
    kernel = _Kernel()
    launch = RepeatLaunch(kernel, (1,))  # BLOCK neither passed nor defaulted
    x, y = torch.zeros(8), torch.zeros(8)
    launch(x, 8, 0.5, y)
    launch(x, 8, 0.5, y)
    assert [e[0] for e in kernel.log] == ["jit", "jit"]


_POOL = torch.zeros(256, dtype=torch.float32)
# aligned (offsets 0, 16, 32 bytes) and unaligned (4, 8 bytes) views; another dtype
_TENSORS = [_POOL[i:i + 8] for i in (0, 1, 2, 4, 8)] + [torch.zeros(8, dtype=torch.float64)]
_arg = st.one_of(st.sampled_from(_TENSORS), st.sampled_from([1, 2, 16, 32, True, 2**40]),
                 st.sampled_from([0.5, 1.0]))


@settings(max_examples=300, deadline=None)
@given(first=st.tuples(_arg, _arg, _arg, _arg), later=st.lists(st.tuples(_arg, _arg, _arg, _arg),
                                                               min_size=1, max_size=6))
def test_the_kept_kernel_runs_only_where_triton_would_pick_it(first, later):
    kernel = _Kernel()
    launch = RepeatLaunch(kernel, (1,), BLOCK=16)
    launch(*first)
    for args in later:
        launch(*args)
    spec = _triton_specialisation(first)
    for args, entry in zip(later, kernel.log[1:]):
        if entry[0] == "kept":
            assert _runs_correctly(spec, _triton_specialisation(args)), (first, args)
        if all(b is a if isinstance(a, torch.Tensor) else type(a) is type(b) and a == b
               for a, b in zip(args, first)):
            assert entry[0] == "kept"  # the same arguments again always reuse it


@pytest.mark.parametrize("first_n, later_n", [(1, True), (True, 1), (1, 1.0)])
def test_equal_values_of_another_type_go_through_the_jit(first_n, later_n):
    """1 == True == 1.0 in Python, but Triton compiles an int, a bool and a float apart."""
    kernel = _Kernel()
    launch = RepeatLaunch(kernel, (1,), BLOCK=16)
    x, y = torch.zeros(8), torch.zeros(8)
    launch(x, first_n, 0.5, y)
    launch(x, later_n, 0.5, y)
    assert [e[0] for e in kernel.log] == ["jit", "jit"]


def test_arguments_the_rule_does_not_model_keep_nothing():
    """A tuple (Triton takes them) is neither compared nor kept: the JIT every time."""
    kernel = _Kernel()
    launch = RepeatLaunch(kernel, (1,), BLOCK=16)
    x, y = torch.zeros(8), torch.zeros(8)
    for pair in ((x, y), (torch.zeros(8, dtype=torch.float64), y)):
        launch(x, 8, pair, y)
    launch(x, 8, 0.5, y)  # and a later call of plain arguments is compared against...
    launch(x, 8, 0.5, y)  # ...the first call that kept a kernel
    assert [e[0] for e in kernel.log] == ["jit", "jit", "jit", "kept"]


def test_another_current_device_goes_through_the_jit(monkeypatch):
    kernel = _Kernel()
    launch = RepeatLaunch(kernel, (1,), BLOCK=16)
    x, y = torch.zeros(8), torch.zeros(8)
    launch(x, 8, 0.5, y)
    monkeypatch.setattr(triton_launch, "_current_device", lambda: 1)
    launch(x, 8, 0.5, y)
    assert [e[0] for e in kernel.log] == ["jit", "jit"]


def test_kept_launches_keep_one_kernel_per_grid_and_constexprs():
    """A per-step kernel whose grid follows the batch: each (grid, kwargs) keeps its own
    compiled kernel after its first (JIT) call; a new grid or constexpr is a JIT call."""
    kernel = _Kernel()
    launches = KeptLaunches(kernel)
    x, y = torch.zeros(8), torch.zeros(8)
    calls = [((4,), 64), ((4,), 64), ((8,), 64), ((4,), 64), ((8,), 64), ((4,), 32),
             ((4,), 32)]
    for grid, block in calls:
        launches(grid, x, 8, 0.5, y, BLOCK=block)
    assert [(e[0], e[1]) for e in kernel.log] == [
        ("jit", (4, 1, 1)), ("kept", (4, 1, 1)), ("jit", (8, 1, 1)), ("kept", (4, 1, 1)),
        ("kept", (8, 1, 1)), ("jit", (4, 1, 1)), ("kept", (4, 1, 1))]
    # the kept launches pass each grid's own constexprs
    assert kernel.log[-1][2] == (x, 8, 0.5, y, 32, True)
    assert kernel.log[3][2] == (x, 8, 0.5, y, 64, True)


def test_kept_launches_take_the_jit_when_told_or_for_a_tensor_by_name():
    kernel = _Kernel()
    launches = KeptLaunches(kernel)
    x, y = torch.zeros(8), torch.zeros(8)
    with use_kernel_options(KernelOptions(repeat_launches=False)):
        for _ in range(2):
            launches((1,), x, 8, 0.5, y, BLOCK=16)
    for _ in range(2):  # y bound by name: never a cache key
        launches((1,), x, 8, 0.5, y_ptr=y, BLOCK=16)
    assert [e[0] for e in kernel.log] == ["jit"] * 4
    assert not launches._launches


def test_kept_returns_one_kept_launches_per_kernel():
    a, b = _Kernel(), _Kernel()
    assert kept(a) is kept(a) and kept(a) is not kept(b) and kept(b).kernel is b
