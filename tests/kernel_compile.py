"""Record the Triton launches of a CPU run (under the interpreter) and compile each
distinct one for an sm_90 GPU, on the CPU.

The interpreter runs a kernel's Python, not Triton's compiler: code that the compiler
types differently (a constant that turns a static branch into a runtime one, so that a
dummy pointer of the wrong element type reaches code the interpreter never ran) passes
every CPU test and fails at the GPU's first launch (dfdd0a1's gumbel kernel). Triton's
frontend, its GPU passes and ptxas need no GPU, so every (kernel, argument types,
constexprs) that the run launched is compiled here, in a subprocess whose kernels are
decorated for the compiler (this process's are interpreted).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from shared.runtime.triton_utils import tl  # Triton through it: it picks the interpreter on a CPU

# Triton's element-type names for the tensors the kernels take.
_POINTER = {torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16",
            torch.bfloat16: "bf16", torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16",
            torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
# Launch options a call may pass beside the kernel's parameters.
_OPTIONS = {"num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg"}
_PLAIN = (bool, int, float, str, type(None))


def _is_constexpr(p: inspect.Parameter) -> bool:
    a = p.annotation  # a string under `from __future__ import annotations`
    return "constexpr" in (a if isinstance(a, str) else getattr(a, "__name__", str(a)))


def _scalar_type(value: Any) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    return "fp32"


class LaunchRecorder:
    """Patches the interpreter's launch to note each call's specialisation (see module doc).
    Use as a context manager around the CPU run."""

    def __init__(self) -> None:
        self.launches: dict[str, dict] = {}
        self.unrecorded: set[str] = set()  # kernels with an argument this does not model

    def __enter__(self) -> LaunchRecorder:
        from triton.runtime.interpreter import InterpretedFunction

        self._cls, self._run = InterpretedFunction, InterpretedFunction.run
        recorder, run = self, self._run

        def recording_run(fn_self, *args, grid, warmup, **kwargs):
            recorder.note(fn_self.fn, args, kwargs)
            return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = recording_run
        return self

    def __exit__(self, *exc: object) -> None:
        self._cls.run = self._run

    def note(self, fn: Any, args: tuple, kwargs: dict) -> None:
        name = f"{fn.__module__}:{fn.__qualname__}"
        params = list(inspect.signature(fn).parameters.values())
        given = dict(zip((p.name for p in params), args))
        given.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
        signature, constexprs = {}, {}
        for p in params:
            value = given.get(p.name, p.default)
            if _is_constexpr(p) or value is None:
                if isinstance(value, tl.dtype):  # e.g. a dot's input type; JSON as its name
                    value = {"tl.dtype": value.name}
                elif not isinstance(value, _PLAIN):
                    self.unrecorded.add(name)
                    return
                signature[p.name], constexprs[p.name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[p.name] = "*" + _POINTER[value.dtype]
            elif isinstance(value, _PLAIN):
                signature[p.name] = _scalar_type(value)
            else:
                self.unrecorded.add(name)
                return
        options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
        entry = {"kernel": name, "signature": signature, "constexprs": constexprs,
                 "options": options}
        self.launches.setdefault(json.dumps(entry, sort_keys=True), entry)


_COMPILE = """
import importlib, json, sys
import torch
torch.cuda.is_available = lambda: True  # decorate the kernels for the compiler
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

failures = []
for entry in json.load(open(sys.argv[1])):
    module, _, qualname = entry["kernel"].partition(":")
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    while not isinstance(fn, triton.runtime.JITFunction):
        fn = fn.fn  # an autotuner or heuristics wrapper
    constexprs = {k: triton.language.dtype(v["tl.dtype"]) if isinstance(v, dict) else v
                  for k, v in entry["constexprs"].items()}
    try:
        src = ASTSource(fn=fn, signature=entry["signature"], constexprs=constexprs)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=entry["options"])
    except Exception as exc:
        failures.append(f"{entry['kernel']} {entry['constexprs']}: {type(exc).__name__}: {exc}")
print(json.dumps(failures))
"""


def compile_for_sm90(launches: list[dict], workdir: Path, timeout_s: float = 900) -> list[str]:
    """Compile every recorded launch in a subprocess; returns the failures' messages."""
    root = Path(__file__).resolve().parents[1]
    path = workdir / "launches.json"
    path.write_text(json.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(root), TRITON_CACHE_DIR=str(workdir / "cache"))
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the compile subprocess failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
