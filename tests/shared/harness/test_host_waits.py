"""host_waits against hand-built traces: which runtime calls count as waits, and which
frame each is charged to (the innermost enclosing frame of the project's code)."""

from __future__ import annotations

import torch

from shared.harness.host_waits import format_waits, host_waits


def frame(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"cat": "python_function", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def call(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


STEP = "shared/serving/engine.py(300): step"
PREP = "runner_v1/model_runner.py(127): synchronize_input_prep"
LAND = "runner_v1/async_tokens.py(40): land"
TORCH = "torch/cuda/streams.py(220): synchronize"  # library frame: never the site


def test_waits_go_to_the_innermost_enclosing_project_frame():
    events = [
        frame(STEP, 0, 1000),
        frame(PREP, 10, 300),
        frame(TORCH, 20, 250),
        call("cudaEventSynchronize", 30, 200),  # inside PREP (via a library frame)
        frame(LAND, 400, 100),  # ends before the next call: does not enclose it
        call("cudaStreamSynchronize", 600, 50),  # inside STEP only
        call("cudaStreamSynchronize", 700, 10, tid=2),  # another thread: no frame
        call("cudaLaunchKernel", 800, 500),  # not a wait, however long
    ]
    waits = {(w.call, w.site): w for w in host_waits(events, steps=2)}
    assert set(waits) == {("cudaEventSynchronize", PREP), ("cudaStreamSynchronize", STEP),
                          ("cudaStreamSynchronize", "?")}
    w = waits[("cudaEventSynchronize", PREP)]
    assert (w.count, w.total_us, w.max_us) == (0.5, 100.0, 200.0)  # per step of 2


def test_a_copy_or_allocation_counts_only_when_it_blocked_long_enough():
    events = [frame(LAND, 0, 1000), call("cudaMemcpyAsync", 10, 5),
              call("cudaMemcpyAsync", 100, 80), call("cudaMemcpyAsync", 300, 120),
              call("cudaHostAlloc", 500, 10), call("cudaHostAlloc", 600, 300)]
    waits = host_waits(events, steps=1, min_copy_us=50)
    assert [(w.call, w.site, w.count, w.total_us) for w in waits] == [
        ("cudaHostAlloc", LAND, 1, 300.0), ("cudaMemcpyAsync", LAND, 2, 200.0)]
    assert host_waits(events, steps=1, min_copy_us=500) == []


def test_sorted_by_total_and_formatted():
    events = [frame(PREP, 0, 1000), call("cudaEventSynchronize", 10, 10),
              frame(LAND, 2000, 1000), call("cudaStreamSynchronize", 2010, 90)]
    waits = host_waits(events, steps=1)
    assert [w.site for w in waits] == [LAND, PREP]
    text = format_waits(waits)
    assert text.splitlines()[1].endswith(f"cudaStreamSynchronize  <- {LAND}")


def test_the_tracer_names_project_frames_as_host_waits_matches_them(tmp_path):
    """A real profiler trace (CPU): the Python tracer's frame names for this project's
    code are the ones the site attribution looks for, and a library's are not."""
    import json

    from shared.harness import host_waits as module

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                with_stack=True) as prof:
        format_waits([])
        torch.ones(8).sum().item()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    names = [e["name"] for frames in module._frames_by_thread(events).values()
             for e in frames[1]]
    assert any("shared/harness/host_waits.py" in n and "format_waits" in n for n in names)
    assert not any("torch/" in n for n in names)
