"""The gumbel kernel's variants compile for an sm_90 GPU, checked on the CPU.

The interpreter that runs the kernels in CI executes Python, not Triton's compiler: a
branch the compiler types differently (a constant that makes a test dynamic, a pointer of
the wrong element type behind a branch the interpreter never takes) passes there and
fails on the GPU at its first launch, as dfdd0a1's ALL_GREEDY variant did. Triton's
frontend and ptxas need no GPU, so each variant is compiled here ahead of time, in a
subprocess that decorates the kernels for the compiler (this process's are interpreted).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent("""
    import itertools, sys
    import torch
    torch.cuda.is_available = lambda: True  # decorate for the compiler, not the interpreter
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from runner_v2.sample.gumbel import _gumbel_sample_kernel

    base = {"logits_ptr": "*bf16", "logits_stride": "i32", "idx_mapping_ptr": "*i32",
            "temperature_ptr": "*fp32", "seeds_ptr": "*i64", "block_max_ptr": "*fp64",
            "block_arg_ptr": "*i64", "vocab_size": "i32", "num_blocks": "i32"}
    for all_greedy, has_threshold, is_fp64 in itertools.product((True, False), repeat=3):
        if all_greedy and has_threshold:
            continue  # gumbel_sample refuses it: a threshold filters random rows only
        sig = dict(base, logits_ptr="*fp64" if is_fp64 else "*bf16",
                   # all-greedy launches pass idx_mapping (int32) as the unread positions
                   pos_ptr="*i32" if all_greedy else "*i64",
                   threshold_ptr="*fp64" if is_fp64 or not has_threshold else "*fp32")
        sig.update({k: "constexpr" for k in ("BLOCK", "HAS_THRESHOLD", "IS_FP64", "ALL_GREEDY")})
        src = ASTSource(fn=_gumbel_sample_kernel, signature=sig, constexprs={
            "BLOCK": 1024, "HAS_THRESHOLD": has_threshold, "IS_FP64": is_fp64,
            "ALL_GREEDY": all_greedy})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"enable_fp_fusion": False})
        assert kernel.asm.get("ptx"), (all_greedy, has_threshold, is_fp64)
        print("compiled", all_greedy, has_threshold, is_fp64)
""")


def test_every_gumbel_variant_compiles_for_sm90(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(root), TRITON_CACHE_DIR=str(tmp_path))
    try:
        done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("compiling the gumbel variants took over 300 s")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 6
