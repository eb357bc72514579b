"""Measurement primitives shared by `runnerlab ab` and the scripts under scripts/.

Timing rules: warm-up steps are excluded; medians and p90 over many steps; absolute
GPU numbers only from CUDA events or after a synchronize; ratios of the two runners
come from the same process and the same run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.contract.sampling_params import RequestOutputKind, SamplingParams
from shared.runtime.step_timing import STAGES, StepStats
from shared.serving.engine import LLMEngine


def cuda_times_ms(fn, reps: int, warmup: int = 5) -> np.ndarray:
    """CUDA-event times of `reps` calls of `fn` in ms, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return np.asarray(times)


def cuda_time_ms(fn, reps: int, warmup: int = 5) -> float:
    """Median CUDA-event time of `fn` in ms, after `warmup` untimed calls."""
    return float(np.median(cuda_times_ms(fn, reps, warmup)))


def graph_time_ms(fn, reps: int, calls: int = 10) -> float:
    """Per-call time of `fn` replayed from a CUDA graph of `calls` back-to-back calls,
    so CPU launch cost (decisive for small kernels) is excluded, as under the runners'
    graphs."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time_ms(graph.replay, reps) / calls


def measure_read_bandwidth(device: torch.device, gib: float | None = None, reps: int = 10) -> float:
    """Read bandwidth in bytes/s: the median time of a float32 sum over `gib` GiB, far past
    the caches. On CUDA 16 GiB by default (capped at an eighth of the device's memory),
    timed with CUDA events; on the CPU 0.25 GiB, timed by the clock, on the torch threads
    in use (what the runners get).

    Why 16 GiB on CUDA: over 4 GiB the same measurement moved widely between three trials
    of one process on the H200, and a ratio to a floor built on it moved with it
    (docs/results/raw/8b91117/h200_read_bandwidth_4gib_measure.json); over 16 GiB it held
    steady (docs/results/raw/8b91117/h200_read_bandwidth.json). The larger buffer also
    gives the higher figure, so the floor does not get easier."""
    if device.type != "cuda":
        n = int((0.25 if gib is None else gib) * 2**30) // 4
        x = torch.ones(n, dtype=torch.float32)
        return n * 4 / _cpu_time_s(x.sum, reps=min(reps, 5))
    total = torch.cuda.get_device_properties(device).total_memory
    n = int(min((16.0 if gib is None else gib) * 2**30, total / 8)) // 4
    x = torch.ones(n, dtype=torch.float32, device=device)
    seconds = cuda_time_ms(x.sum, reps, warmup=2) / 1e3
    del x
    torch.cuda.empty_cache()
    return n * 4 / seconds


def measure_gemm_rate(device: torch.device, dtype: torch.dtype, n: int | None = None,
                      reps: int = 10) -> float:
    """Dense matmul rate in FLOP/s in the model's dtype: the median time of an n x n by
    n x n matmul (2 n^3 FLOPs). On CUDA n = 8192, large enough for the tensor cores' peak
    and timed with CUDA events; on the CPU n = 512, which keeps `runnerlab ab --quick`
    fast and still runs past the kernel's start-up cost."""
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 512)
    seconds = _matmul_seconds(device, dtype, n, reps)
    if cuda:  # the operands are gone with _matmul_seconds' frame: give their memory back
        torch.cuda.empty_cache()
    return 2 * n**3 / seconds


def _matmul_seconds(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    run = lambda: torch.mm(a, b, out=out)
    if device.type == "cuda":
        return cuda_time_ms(run, reps, warmup=3) / 1e3
    return _cpu_time_s(run, min(reps, 5))


def _cpu_time_s(fn, reps: int, warmup: int = 1) -> float:
    """Median wall time of `fn` in seconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


@dataclass
class StepSamples:
    """Per-step samples of one measured run.

    The GPU times are read lazily, after the run (`forward_gpu_ms`, `step_gpu_ms`, the
    summary): reading a step's CUDA events waits for its GPU work, and a read per step
    would serialise an async-scheduling loop (the host could never run ahead of the GPU),
    so a run's throughput would measure a synchronous loop."""

    wall_ms: list[float] = field(default_factory=list)
    stage_ms: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    modes: list[str] = field(default_factory=list)
    _forward_gpu_ms: list[float] = field(default_factory=list)
    _step_gpu_ms: list[float] = field(default_factory=list)  # forward + LM head + sampler
    _unread: list[StepStats] = field(default_factory=list)

    def add(self, engine: LLMEngine, wall_ms: float) -> None:
        stats = engine.step_stats
        self.wall_ms.append(wall_ms)
        for s in STAGES:
            self.stage_ms[s].append(stats.stage_ms.get(s, 0.0))
        self.modes.append(stats.cudagraph_mode)
        self._unread.append(stats)  # its events are read after the run

    @property
    def forward_gpu_ms(self) -> list[float]:
        self._read_gpu()
        return self._forward_gpu_ms

    @property
    def step_gpu_ms(self) -> list[float]:
        self._read_gpu()
        return self._step_gpu_ms

    def _read_gpu(self) -> None:
        for stats in self._unread:
            gpu = stats.forward_gpu_ms()
            if gpu is not None:
                self._forward_gpu_ms.append(gpu)
            gpu = stats.step_gpu_ms()
            if gpu is not None:
                self._step_gpu_ms.append(gpu)
        self._unread.clear()

    def summary(self) -> dict:
        def q(values: list[float]) -> dict:
            if not values:
                return {}
            a = np.asarray(values)
            return {"median": float(np.median(a)), "p90": float(np.percentile(a, 90)), "n": len(a)}

        out = {"wall_ms": q(self.wall_ms), "stages_ms": {s: q(v) for s, v in self.stage_ms.items()}}
        if self.forward_gpu_ms:
            out["forward_gpu_ms"] = q(self.forward_gpu_ms)
        if self.step_gpu_ms:
            out["step_gpu_ms"] = q(self.step_gpu_ms)
        out["cudagraph_modes"] = sorted(set(self.modes))
        return out


def decode_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, min(vocab, 10000), size=(batch, prompt_len)).tolist()


def decode_max_tokens(warmup: int, steps: int) -> int:
    """Output tokens each run_decode request asks for: enough that none finishes before the
    last timed step (a request that ended early would shrink the batch being measured)."""
    return warmup + 2 * steps + 4


def run_decode(
    engine: LLMEngine, batch: int, prompt_len: int, warmup: int, steps: int, seed: int = 0,
    tag: str = "d", params: list[SamplingParams] | None = None,
) -> tuple[StepSamples, float, dict[str, list[int]]]:
    """`batch` requests prefill, then decode together; measures `steps` decode steps
    after `warmup` and returns (samples, unsynchronised steady-state ms/step, tokens).
    params: one SamplingParams per request (each with max_tokens >= decode_max_tokens);
    default greedy."""
    if params is None:
        params = [SamplingParams(max_tokens=decode_max_tokens(warmup, steps), temperature=0.0,
                                 ignore_eos=True)] * batch
    # Outputs only at the end: copying every request's cumulative output list each step
    # would add O(batch x length) work to both runners' steps.
    params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
    ids = [f"{tag}{i}" for i in range(batch)]
    prompts = decode_prompts(batch, prompt_len, engine.vocab_size, seed)
    for req_id, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(req_id, prompt, p)
    tokens: dict[str, list[int]] = {}
    # prefill until every request is decoding (None: finished already)
    while any(engine.num_output_tokens(r) == 0 for r in ids):
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    for _ in range(warmup):
        engine.step()
    samples = StepSamples()
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        samples.add(engine, (time.perf_counter() - t0) * 1e3)
        for out in outs:
            tokens[out.request_id] = out.outputs[0].token_ids
    # Steady state without per-step timing hooks: wall time over a run of steps.
    sync_engine(engine)
    t0 = time.perf_counter()
    for _ in range(steps):
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    sync_engine(engine)
    steady_ms = (time.perf_counter() - t0) * 1e3 / steps
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    for out in engine.step():  # carries the aborts to the runner; reports them
        tokens[out.request_id] = out.outputs[0].token_ids
    return samples, steady_ms, tokens


def sync_engine(engine: LLMEngine) -> None:
    """Wait for the engine's device work (a no-op off CUDA)."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


@contextlib.contextmanager
def maybe_profile(enabled: bool, output_dir: str, engine: str, label: str) -> Iterator[None]:
    """With `enabled`, a torch.profiler trace of the block (CPU, and CUDA where there is
    one) in output_dir/trace_<engine>_<label>.json."""
    if not enabled:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    prof.export_chrome_trace(os.path.join(output_dir, f"trace_{engine}_{label}.json"))


def host_us_per_call(fn, iters: int) -> float:
    """Host microseconds per call of `fn` (after 20 warm-up calls), for calls whose GPU
    work is far shorter than their launch: a loop of `iters` calls measures the host."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host / iters * 1e6
