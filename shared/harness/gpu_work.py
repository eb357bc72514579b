"""What the GPU ran in a torch.profiler trace, per step: each kernel's time and launch
count, the copies, the host's launch calls, and how much of the traced span the GPU was
busy (issue 21: when one runner's step takes longer than the other's on the same step
sequence, a kernel table tells more kernels from slower ones from idle gaps).

    work = gpu_work(trace["traceEvents"], steps=10)
    print(format_gpu_work(work))
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# Host calls that put work on the GPU: torch's own kernels go through the runtime's
# cudaLaunchKernel*, Triton's through the driver's cuLaunchKernel*, a graph replay is one
# cudaGraphLaunch however many kernels it holds.
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


@dataclass(frozen=True)
class KernelRow:
    name: str
    category: str
    launches: float  # per step
    gpu_us: float  # per step


@dataclass(frozen=True)
class GpuWork:
    rows: tuple[KernelRow, ...]  # largest gpu_us first
    gpu_us: float  # per step, summed over every GPU event
    busy_us: float  # per step, the union of the GPU events' intervals
    span_us: float  # per step, first GPU event start to last end
    launch_calls: dict[str, float]  # host call name -> calls per step


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def gpu_work(events: list[dict], steps: int) -> GpuWork:
    """Sum `events` (a chrome trace's traceEvents) per step of `steps`."""
    sums: dict[tuple[str, str], list[float]] = defaultdict(list)
    intervals: list[tuple[float, float]] = []
    calls: dict[str, int] = defaultdict(int)
    for e in events:
        if "dur" not in e:
            continue
        cat = e.get("cat")
        if cat in GPU_CATEGORIES:
            sums[(e["name"], cat)].append(float(e["dur"]))
            intervals.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
        elif cat in ("cuda_runtime", "cuda_driver") and e["name"] in LAUNCH_CALLS:
            calls[e["name"]] += 1
    rows = sorted((KernelRow(name, cat, len(d) / steps, sum(d) / steps)
                   for (name, cat), d in sums.items()), key=lambda r: -r.gpu_us)
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    return GpuWork(tuple(rows), sum(r.gpu_us for r in rows), _busy(intervals) / steps,
                   span / steps, {k: v / steps for k, v in sorted(calls.items())})


def format_gpu_work(work: GpuWork, limit: int = 25, name_width: int = 70) -> str:
    lines = [f"GPU per step: {work.gpu_us:.1f} us of events, busy {work.busy_us:.1f} us "
             f"of a {work.span_us:.1f} us span; host launch calls per step: "
             + ", ".join(f"{k} {v:.1f}" for k, v in work.launch_calls.items()),
             f"{'us/step':>9} {'n/step':>7}  kernel"]
    for r in work.rows[:limit]:
        tag = "" if r.category == "kernel" else f"[{r.category}] "
        lines.append(f"{r.gpu_us:9.1f} {r.launches:7.1f}  {tag}{r.name[:name_width]}")
    return "\n".join(lines)
