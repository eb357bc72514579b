"""Where each runner's host waits for the GPU inside its steps (GPU machine): a few steps
of a workload under torch.profiler with the Python tracer, and every blocking CUDA
runtime call charged to the line of the project's code that made it
(shared/harness/host_waits.py), beside the steps' stage times.

    python3 scripts/profile_host_waits.py [--model qwen3-0.6b] [--runners v1,v2]
        [--workload churn|decode] [--live 64] [--batch 1024] [--steps 10] [--sync]
        [--max-model-len 2048] [--stages-only] [--no-stack] [--enforce-eager] [--out FILE]

churn: about `live` requests of 2-12 tokens, new ones arriving every step (runnerlab ab's
churn); decode: `batch` requests decoding together. Async scheduling unless --sync: with
it a runner should never wait inside a step for the step before to finish. The Python
tracer slows the host, so the stage times here are inflated; the waits are GPU time.
Each runner's kernel table follows (shared/harness/gpu_work.py: GPU time and launches per
kernel, GPU busy time of the traced span); --no-stack traces without the Python tracer, so
the span's idle gaps are the real ones (the waits then have no project frame).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import tempfile

import torch


def build(args, runner: str):
    from policy import EngineArgs
    from shared.serving.engine import LLMEngine

    rows = args.batch if args.workload == "decode" else 2 * args.live
    return LLMEngine.from_engine_args(EngineArgs(
        model=args.model, load_format="dummy", dtype=args.dtype, device=args.device, seed=0,
        model_runner=runner, max_model_len=args.max_model_len, max_num_seqs=max(64, rows),
        enable_prefix_caching=False, async_scheduling=not args.sync,
        enforce_eager=args.enforce_eager))


def workload(engine, args):
    """A step function that keeps the workload going (adds requests as it needs)."""
    from shared.contract.sampling_params import SamplingParams
    from shared.harness.workloads import ChurnArrivals

    if args.workload == "decode":
        rng = random.Random(2)
        vocab = min(engine.vocab_size, 10000)
        for i in range(args.batch):
            engine.add_request(f"r{i}", [rng.randint(1, vocab - 1) for _ in range(128)],
                               SamplingParams(max_tokens=100_000, temperature=0.0,
                                              ignore_eos=True))

        def step():
            engine.step()
    else:
        arrivals = ChurnArrivals(engine, args.live, "r")

        def step():
            arrivals.top_up()
            engine.step()
    return step


def profile_runner(args, runner: str) -> dict:
    from shared.harness.ab_engines import free_engines
    from shared.harness.gpu_work import format_gpu_work, gpu_work
    from shared.harness.host_waits import format_waits, host_waits

    engine = build(args, runner)
    step = workload(engine, args)
    for _ in range(args.warmup):
        step()
    stages: dict[str, list[float]] = {}
    # a partial, not a closure: the engine is deleted below, before free_engines
    measured_steps = functools.partial(run_steps, engine, step, args.steps, stages)
    waits, work = [], None
    if args.stages_only:
        measured_steps()
    else:
        events = traced(measured_steps, args.device, with_stack=not args.no_stack)
        waits, work = host_waits(events, args.steps), gpu_work(events, args.steps)
        del events
    del measured_steps
    result = {"stage_ms_median": {k: statistics.median(v) for k, v in stages.items()},
              "waits": [w.__dict__ for w in waits],
              "gpu_work": None if work is None else {
                  "gpu_us": work.gpu_us, "busy_us": work.busy_us, "span_us": work.span_us,
                  "launch_calls": work.launch_calls,
                  "rows": [r.__dict__ for r in work.rows[:60]]}}
    print(f"== {runner} {args.workload} ({'sync' if args.sync else 'async'} loop), "
          f"stage ms (median{'' if args.stages_only else ', tracer on'}): "
          + ", ".join(f"{k} {v:.2f}" for k, v in result["stage_ms_median"].items()))
    if not args.stages_only:
        print(format_waits(waits))
        print(format_gpu_work(work), flush=True)
    engines = {runner: engine}
    del engine, step  # free_engines must hold the only reference
    free_engines(engines)
    return result


def run_steps(engine, step, steps: int, stages: dict[str, list[float]]) -> None:
    for _ in range(steps):
        step()
        for name, ms in engine.runner.step_stats.stage_ms.items():
            stages.setdefault(name, []).append(ms)


def traced(fn, device: str, with_stack: bool = True) -> list[dict]:
    """Run fn under torch.profiler (with the Python tracer unless told not); the trace's
    events."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts, with_stack=with_stack) as prof:
        fn()  # no synchronize of ours in the trace: it would read as a wait of the runner's
    if device == "cuda":
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--runners", default="v1,v2")
    p.add_argument("--workload", choices=["churn", "decode"], default="churn")
    p.add_argument("--live", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--sync", action="store_true", help="the synchronous engine loop")
    p.add_argument("--stages-only", action="store_true",
                   help="no trace: the stage times alone, without the tracer's overhead")
    p.add_argument("--no-stack", action="store_true",
                   help="trace without the Python tracer: real idle gaps, no wait sites")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = {r: profile_runner(args, r) for r in args.runners.split(",")}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
