"""Where the host waits for the GPU: CUDA runtime calls that block in a torch.profiler trace
(recorded with the Python tracer, `with_stack=True`), each attributed to the innermost
frame of this project's code that made it.

A runner that overlaps its host work with the GPU must not block inside a step, but a
sync can hide anywhere: an event or stream synchronize, a device-to-host copy, a copy from
pageable host memory (the driver may synchronise with the stream before staging it), a
tensor read back for a Python value. The GPU's kernel timeline shows the gap such a wait
leaves, not the line that caused it; this table names the line.

    waits = host_waits(trace["traceEvents"], steps=10)
    print(format_waits(waits))
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

# Runtime calls that block the calling host thread until GPU work is done (the
# synchronize calls), or may (copies: a device-to-host copy waits for the stream; a
# copy from pageable memory may synchronise with the stream before it is staged). A copy
# counts only when it took at least `min_copy_us`: a short one did not wait.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
# Copies, and the allocations and frees that synchronise implicitly (a fresh pinned
# temporary's cudaHostAlloc, a cache miss's cudaMalloc, cudaFree): like copies, counted
# only when long enough to have waited.
COPY_CALLS = ("cudaMemcpyAsync", "cudaMemcpy", "cudaHostAlloc", "cudaFreeHost", "cudaMalloc",
              "cudaFree")
# Paths (as the Python tracer names frames) of the code whose lines are reported.
PROJECT_DIRS = ("runner_v1/", "runner_v2/", "shared/", "policy/")


@dataclass(frozen=True)
class Wait:
    """One (runtime call, project frame) site, summed over the trace's steps."""

    call: str
    site: str  # the tracer's frame name: "path(line): function", or "?" (no project frame)
    count: int
    total_us: float
    max_us: float


def _is_project_frame(name: str) -> bool:
    return any(d in name for d in PROJECT_DIRS) and ".venv" not in name


def _frames_by_thread(events: list[dict]) -> dict[tuple, tuple[list[float], list[dict]]]:
    """The project's Python frames per (pid, tid), sorted by start time."""
    frames: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function" and "dur" in e and _is_project_frame(e["name"]):
            frames[(e.get("pid"), e.get("tid"))].append(e)
    out = {}
    for key, evs in frames.items():
        evs.sort(key=lambda e: e["ts"])
        out[key] = ([e["ts"] for e in evs], evs)
    return out


def _innermost_site(frames: tuple[list[float], list[dict]] | None, call: dict) -> str:
    """The latest-starting project frame that encloses the call, or "?"."""
    if frames is None:
        return "?"
    starts, evs = frames
    end = call["ts"] + call["dur"]
    for i in range(bisect.bisect_right(starts, call["ts"]) - 1, -1, -1):
        frame = evs[i]
        if frame["ts"] + frame["dur"] >= end:
            return frame["name"]
    return "?"


def host_waits(events: list[dict], steps: int, min_copy_us: float = 50.0) -> list[Wait]:
    """The blocking runtime calls of `events` (a chrome trace's traceEvents) by (call,
    site), per step of `steps`, largest total first."""
    frames = _frames_by_thread(events)
    sums: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") != "cuda_runtime" or "dur" not in e:
            continue
        name = e["name"]
        blocking = name in SYNC_CALLS or (name in COPY_CALLS and e["dur"] >= min_copy_us)
        if not blocking:
            continue
        site = _innermost_site(frames.get((e.get("pid"), e.get("tid"))), e)
        sums[(name, site)].append(float(e["dur"]))
    waits = [Wait(call, site, round(len(d) / steps, 3), sum(d) / steps, max(d))
             for (call, site), d in sums.items()]
    return sorted(waits, key=lambda w: -w.total_us)


def format_waits(waits: list[Wait], limit: int = 20) -> str:
    lines = [f"{'us/step':>9} {'calls/step':>10} {'max us':>8}  call  <- project frame"]
    for w in waits[:limit]:
        lines.append(f"{w.total_us:9.1f} {w.count:10.2f} {w.max_us:8.1f}  {w.call}  <- {w.site}")
    return "\n".join(lines)
