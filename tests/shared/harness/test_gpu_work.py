"""gpu_work against hand-built traces: per-step sums per kernel, the busy time as the
union of overlapping GPU intervals (checked against a brute-force count over a grid), and
which host calls count as launches."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.harness.gpu_work import format_gpu_work, gpu_work


def gpu(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def host(name: str, ts: float, cat: str = "cuda_runtime") -> dict:
    return {"cat": cat, "name": name, "ts": ts, "dur": 3, "pid": 0, "tid": 1}


def test_kernels_copies_and_launches_per_step():
    events = [
        gpu("gemm", 0, 10), gpu("gemm", 20, 30), gpu("attn", 25, 10),  # attn overlaps gemm
        gpu("Memcpy HtoD", 60, 4, "gpu_memcpy"),
        host("cudaLaunchKernel", 0), host("cudaLaunchKernel", 1),
        host("cuLaunchKernel", 2, "cuda_driver"),
        host("cudaEventRecord", 3),  # not a launch
        {"cat": "kernel", "name": "instant", "ts": 5},  # no duration: ignored
    ]
    work = gpu_work(events, steps=2)
    rows = {r.name: r for r in work.rows}
    assert [r.name for r in work.rows] == ["gemm", "attn", "Memcpy HtoD"]
    assert (rows["gemm"].launches, rows["gemm"].gpu_us) == (1.0, 20.0)
    assert rows["Memcpy HtoD"].category == "gpu_memcpy"
    assert work.gpu_us == 27.0  # (10 + 30 + 10 + 4) / 2
    assert work.busy_us == 22.0  # [0,10) + [20,50) + [60,64) = 44, over 2 steps
    assert work.span_us == 32.0
    assert work.launch_calls == {"cuLaunchKernel": 0.5, "cudaLaunchKernel": 1.0}
    text = format_gpu_work(work)
    assert "[gpu_memcpy] Memcpy HtoD" in text and "busy 22.0 us of a 32.0 us span" in text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), min_size=1, max_size=12))
def test_busy_time_is_the_union_of_intervals(spans):
    events = [gpu(f"k{i}", s, d) for i, (s, d) in enumerate(spans)]
    covered = np.zeros(100, dtype=bool)  # unit cells: integer starts and durations
    for s, d in spans:
        covered[s:s + d] = True
    assert gpu_work(events, steps=1).busy_us == covered.sum()
