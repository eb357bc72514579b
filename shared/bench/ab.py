"""`runnerlab ab`: the same workloads through V1 and V2 in one process.

Both engines are built on the same model and weights (same preset and seed). Runs are
interleaved A-B-B-A so that drift (clocks, caches, allocator state) and order cannot
favour either runner; warm-up steps are excluded. Output: a table on stdout, ab.json
and ab.png in --output-dir, and a check that both runners produced identical tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from shared.bench import workloads as wl
from shared.bench.measure import StepSamples, measure_read_bandwidth
from shared.bench.report import print_tables, write_png
from shared.engine import LLMEngine
from shared.step_timing import STAGES, set_nvtx_enabled

logger = logging.getLogger("runnerlab")
WORKLOADS = ("decode", "prefill", "churn", "throughput")


def build_parser() -> argparse.ArgumentParser:
    from policy.explain import add_engine_args

    p = argparse.ArgumentParser(prog="runnerlab ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, require_model=False)  # `runnerlab ab` alone: the small default
    g = p.add_argument_group("A/B")
    g.add_argument("--workloads", default=None, help="comma list of " + ",".join(WORKLOADS))
    g.add_argument("--batch-sizes", default=None, help="decode batch ladder, e.g. 1,8,32,64")
    g.add_argument("--prompt-len", type=int, default=None, help="decode prompt length")
    g.add_argument("--steps", type=int, default=None, help="measured decode steps per run")
    g.add_argument("--warmup", type=int, default=None, help="excluded warm-up steps per run")
    g.add_argument("--repeats", type=int, default=3, help="throughput repeats per runner")
    g.add_argument("--quick", action="store_true", help="a few seconds: tiny sizes (CI)")
    g.add_argument("--output-dir", default="ab-results")
    g.add_argument("--profile", action="store_true", help="write a torch.profiler trace per runner")
    g.add_argument("--nvtx", action="store_true", help="emit NVTX ranges (for nsys)")
    return p


def _settings(args: argparse.Namespace, device: str) -> dict[str, Any]:
    gpu = device == "cuda"
    quick = args.quick
    batches = [1, 8, 32, 64, 128, 256, 512, 1024] if gpu else [1, 8, 32]
    if quick:
        batches = [1, 4]
    if args.batch_sizes:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    workloads = ["decode", "prefill", "churn"] + (["throughput"] if gpu and not quick else [])
    if args.workloads:
        workloads = [w.strip() for w in args.workloads.split(",")]
        unknown = set(workloads) - set(WORKLOADS)
        if unknown:
            raise ValueError(f"--workloads: unknown {sorted(unknown)}; accepted: {', '.join(WORKLOADS)}")
    return {
        "batches": batches,
        "workloads": workloads,
        "prompt_len": args.prompt_len or (128 if gpu else 16),
        "steps": args.steps or (3 if quick else 30 if gpu else 8),
        "warmup": args.warmup if args.warmup is not None else (1 if quick else 5 if gpu else 2),
        "prefill": (2, 64) if quick else ((16, 2048) if gpu else (4, 256)),
        "churn": (4, 6) if quick else ((64, 100) if gpu else (8, 16)),
    }


def _engine_args(args: argparse.Namespace, runner: str, max_batch: int):
    from policy.explain import engine_args_from_namespace

    base = engine_args_from_namespace(args).model_dump()
    base["model_runner"] = runner
    if runner == "v1" and base.get("async_scheduling"):
        # V1 has no async scheduling (policy.features): with --async-scheduling the A/B
        # compares V1's synchronous engine with V2's overlapped one, and says so.
        base["async_scheduling"] = False
    if getattr(args, "max_num_seqs", None) is None:
        base["max_num_seqs"] = max(max_batch, 16)
    if getattr(args, "enable_prefix_caching", None) is None:
        # Runs repeat the same prompts (A-B-B-A): a warm prefix cache would make later runs
        # cheaper and run different kernels (other GEMM shapes) than the first.
        base["enable_prefix_caching"] = False
    if getattr(args, "gpu_memory_utilization", None) is None:
        # two engines share the device: each sizes its KV cache from its own share
        base["gpu_memory_utilization"] = 0.42
    if getattr(args, "max_num_batched_tokens", None) is None:
        base["max_num_batched_tokens"] = max(base["max_num_seqs"], 2048 if args.quick else 8192)
    from policy import EngineArgs

    return EngineArgs(**base)


def ab_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "model", None):
        args.model = "tiny-llama"
    set_nvtx_enabled(args.nvtx)
    os.makedirs(args.output_dir, exist_ok=True)
    engines = {}
    try:
        for runner in ("v1", "v2"):
            ea = _engine_args(args, runner, 0)
            cfg = ea.create_engine_config()
            settings = _settings(args, cfg.device_config.device)
            ea = _engine_args(args, runner, max(settings["batches"]))
            engines[runner] = LLMEngine.from_engine_args(ea)
    except ValueError as exc:
        print(f"runnerlab ab: error: {exc}", file=sys.stderr)
        return 2
    device = engines["v1"].device
    report = run_ab(engines, settings, args, device)
    path = os.path.join(args.output_dir, "ab.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    png = write_png(report, os.path.join(args.output_dir, "ab.png"))
    print_tables(report)
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))
    return 0 if report["tokens_identical"] else 1


def run_ab(engines: dict[str, LLMEngine], settings: dict, args, device: torch.device) -> dict:
    from tqdm import tqdm

    v1 = engines["v1"]
    weight_bytes = v1.runner.executor.weight_bytes(include_embedding=False)
    bandwidth = measure_read_bandwidth(device)
    report: dict[str, Any] = {
        "command": "runnerlab ab " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["ab"] else sys.argv[1:]),
        "model": v1.model_config.preset or v1.model_config.model,
        "dtype": v1.model_config.dtype,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "settings": settings,
        "weight_bytes": weight_bytes,
        "read_bandwidth_GBps": bandwidth / 1e9 if bandwidth == bandwidth else None,
        "startup_s": {r: e.startup_s for r, e in engines.items()},
        "graph_capture_s": {r: e.capture_s for r, e in engines.items()},
        "async_scheduling": {r: e.async_scheduling for r, e in engines.items()},
        "workloads": {},
    }
    identical = True
    jobs = _jobs(settings)
    orders = {name: _order(args.repeats if name == "throughput" else 2) for name, _, _ in jobs}
    bar = tqdm(total=sum(len(orders[n]) for n, _, _ in jobs), desc="ab", unit="run", file=sys.stderr)
    for name, label, fn in jobs:
        per_runner = {"v1": [], "v2": []}
        for runner in orders[name]:
            with _maybe_profile(args, runner, label):
                per_runner[runner].append(fn(engines[runner], f"{runner}-{label}-{len(per_runner[runner])}-"))
            bar.update(1)
        same = _same_tokens(per_runner)
        identical &= same
        entry = {"label": label, "tokens_identical": same}
        for runner, results in per_runner.items():
            entry[runner] = _summarise(results)
        if name == "decode" and bandwidth == bandwidth:
            floor_ms = weight_bytes / bandwidth * 1e3
            entry["floor_ms"] = floor_ms
            for runner in ("v1", "v2"):
                gpu = entry[runner].get("forward_gpu_ms", {}).get("median")
                if gpu:
                    entry[runner]["achieved_GBps"] = weight_bytes / (gpu / 1e3) / 1e9
        report["workloads"].setdefault(name, []).append(entry)
    bar.close()
    report["tokens_identical"] = identical
    return report


def _order(pairs: int) -> list[str]:
    """A-B-B-A-A-B...: `pairs` runs of each runner, alternating which goes first."""
    order: list[str] = []
    for i in range(pairs):
        order += ["v1", "v2"] if i % 2 == 0 else ["v2", "v1"]
    return order


def _jobs(s: dict) -> list:
    jobs = []
    for w in s["workloads"]:
        if w == "decode":
            for b in s["batches"]:
                jobs.append(("decode", f"b{b}", lambda e, t, b=b: wl.decode(
                    e, b, s["prompt_len"], s["warmup"], s["steps"], t)))
        elif w == "prefill":
            n, length = s["prefill"]
            jobs.append(("prefill", f"{n}x{length}",
                         lambda e, t, n=n, length=length: wl.prefill(e, n, length, t)))
        elif w == "churn":
            live, steps = s["churn"]
            jobs.append(("churn", f"live{live}",
                         lambda e, t, live=live, steps=steps: wl.churn(e, live, steps, t)))
        elif w == "throughput":
            jobs.append(("throughput", "nano-vllm", _throughput_job))
    return jobs


def _throughput_job(engine: LLMEngine, tag: str) -> wl.RunResult:
    prompts, max_tokens = wl.nano_vllm_workload()
    if engine.vocab_size <= 10000:  # tiny presets: fold ids into the vocabulary
        prompts = [[t % engine.vocab_size for t in p] for p in prompts]
    max_len = engine.max_model_len
    if any(len(p) + n > max_len for p, n in zip(prompts, max_tokens)):
        raise ValueError(f"the throughput workload needs max_model_len >= 2048 (got {max_len})")
    # warm-up on workload-shaped requests (excluded), then the timed run
    wl.throughput(engine, prompts[:16], [8] * 16, tag + "warm-")
    result = wl.throughput(engine, prompts, max_tokens, tag)
    expected = sum(max_tokens)
    assert result.extra["output_tokens"] == expected, (result.extra["output_tokens"], expected)
    result.extra["expected_output_tokens"] = expected
    return result


def _same_tokens(per_runner: dict[str, list[wl.RunResult]]) -> bool:
    def strip(tokens: dict[str, list[int]]) -> dict[str, list[int]]:
        # request ids carry the runner and run index; compare by the request's suffix
        return {k.rsplit("-", 1)[-1]: v for k, v in tokens.items()}

    ref = strip(per_runner["v1"][0].tokens)
    return all(strip(r.tokens) == ref for rs in per_runner.values() for r in rs)


def _summarise(results: list[wl.RunResult]) -> dict:
    merged = StepSamples()
    for r in results:
        if r.samples is not None:
            merged.wall_ms += r.samples.wall_ms
            merged.forward_gpu_ms += r.samples.forward_gpu_ms
            merged.modes += r.samples.modes
            for s in STAGES:
                merged.stage_ms[s] += r.samples.stage_ms[s]
    out = merged.summary() if merged.wall_ms else {}
    extras = [r.extra for r in results]
    for key in extras[0]:
        values = [e[key] for e in extras if isinstance(e.get(key), (int, float))]
        if values:
            out[key] = {"median": float(np.median(values)), "min": float(np.min(values)),
                        "max": float(np.max(values)), "n": len(values)}
    return out


@contextlib.contextmanager
def _maybe_profile(args, runner: str, label: str):
    if not args.profile:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    prof.export_chrome_trace(os.path.join(args.output_dir, f"trace_{runner}_{label}.json"))
