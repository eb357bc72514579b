"""`runnerlab ab`: the same workloads through V1 and V2 in one process.

Both engines are built on the same model and weights (same preset and seed). Runs are
interleaved A-B-B-A so that drift (clocks, caches, allocator state) and order cannot
favour either runner; warm-up steps are excluded. Output: a table on stdout, ab.json
and ab.png in --output-dir, and a check that the runners produced identical tokens.
`--runners v1` (or `--model-runner v1`) measures one runner alone: its stage times, no
ratios. On a machine without a CUDA GPU, V2's Triton kernels run under the Triton
interpreter; the table, ab.json and ab.png say so, and the default sizes are smaller.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from policy.cli_args import (
    OneLineArgumentParser,
    bounded_int,
    cpu_noop_refusal,
    int_list,
    name_list,
    usage_error,
)
from shared.bench import workloads as wl
from shared.bench.measure import StepSamples, decode_max_tokens, measure_read_bandwidth
from shared.bench.report import print_tables, write_png
from shared.engine import LLMEngine
from shared.step_timing import STAGES, set_nvtx_enabled

logger = logging.getLogger("runnerlab")
PROG = "runnerlab ab"
RUNNERS = ("v1", "v2")
WORKLOADS = ("decode", "prefill", "churn", "throughput")
# ab's own flags that only the decode workload reads (refused without it)
DECODE_FLAGS = {"batch_sizes": "--batch-sizes", "prompt_len": "--prompt-len",
                "steps": "--steps", "warmup": "--warmup"}


@dataclass(frozen=True)
class Sizes:
    """What a run measures when no flag says otherwise."""

    batches: tuple[int, ...]  # decode batch ladder
    prompt_len: int  # decode prompt length
    steps: int  # measured decode steps per run
    warmup: int  # excluded decode warm-up steps per run
    prefill: tuple[int, int]  # prompts x prompt length
    churn: tuple[int, int]  # live requests x measured steps
    workloads: tuple[str, ...]


GPU_SIZES = Sizes((1, 8, 32, 64, 128, 256, 512, 1024), 128, 30, 5, (16, 2048), (64, 100),
                  WORKLOADS)
# Without a GPU, V2's kernels run under the Triton interpreter: a decode step of 32
# requests takes ~200 ms there (V1 ~5 ms), and V2's decode runs at 32 were ~40% of the
# old CPU default (batch sizes 1,8,32, 8 + 2 steps). Together with one torch thread
# (set_threads) these sizes keep the default run near 15 s on two cores.
CPU_SIZES = Sizes((1, 4, 16), 16, 6, 1, (4, 256), (8, 16), ("decode", "prefill", "churn"))
QUICK_SIZES = Sizes((1, 4), 16, 3, 1, (2, 64), (4, 6), ("decode", "prefill", "churn"))
RUNS_PER_RUNNER = 2  # A-B-B-A
THROUGHPUT_RUNS_PER_RUNNER = 3


class Refused(Exception):
    """A flag that cannot be honoured as given; the message names it."""


def build_parser() -> argparse.ArgumentParser:
    from policy.explain import add_engine_args

    p = OneLineArgumentParser(prog=PROG, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, require_model=False)  # `runnerlab ab` alone: the small default
    g = p.add_argument_group("A/B")
    g.add_argument("--runners", type=name_list("runner", RUNNERS), default=None,
                   help="comma list of the runners to measure (default v1,v2; one runner: "
                   "its stage times, no ratios). --model-runner v1|v2 is the same as "
                   "--runners v1|v2")
    g.add_argument("--workloads", type=name_list("workload", WORKLOADS), default=None,
                   help="comma list of " + ",".join(WORKLOADS) + " (default: decode,prefill,"
                   "churn, plus throughput on a GPU)")
    g.add_argument("--batch-sizes", type=int_list("batch size", 1), default=None,
                   help="decode batch ladder, e.g. 1,8,32,64")
    g.add_argument("--prompt-len", type=bounded_int(1), default=None, help="decode prompt length")
    g.add_argument("--steps", type=bounded_int(1), default=None,
                   help="measured decode steps per run")
    g.add_argument("--warmup", type=bounded_int(0), default=None,
                   help="excluded decode warm-up steps per run")
    g.add_argument("--repeats", type=bounded_int(1), default=None,
                   help=f"runs per runner of every workload, in alternating order (default "
                   f"{RUNS_PER_RUNNER}; throughput {THROUGHPUT_RUNS_PER_RUNNER})")
    g.add_argument("--threads", type=bounded_int(1), default=None,
                   help="torch intra-op CPU threads (default on CPU: 1, unless OMP_NUM_THREADS "
                   "is set; on CUDA: torch's default)")
    g.add_argument("--quick", action="store_true", help="a few seconds: tiny sizes (CI)")
    g.add_argument("--output-dir", default="ab-results", help="where ab.json and ab.png go")
    g.add_argument("--profile", action="store_true", help="write a torch.profiler trace per runner")
    g.add_argument("--nvtx", action="store_true", help="emit NVTX ranges (for nsys; CUDA only)")
    return p


def select_runners(args: argparse.Namespace) -> list[str]:
    """The runners to measure, in V1, V2 order: --runners, or --model-runner's one."""
    forced = getattr(args, "model_runner", None)
    if forced is not None:
        if args.runners is not None:
            raise Refused("--model-runner and --runners both name the runners; give --runners only")
        if forced == "auto":
            raise Refused("--model-runner auto: ab measures the runners it is told to; "
                          "use --runners v1,v2 (the default), --runners v1 or --runners v2")
        return [forced]
    return sorted(args.runners or RUNNERS, key=RUNNERS.index)


def _settings(args: argparse.Namespace, device: str, runners: list[str]) -> dict[str, Any]:
    sizes = _default_sizes(args, device)
    workloads = args.workloads or list(sizes.workloads)
    repeats = {w: args.repeats or (THROUGHPUT_RUNS_PER_RUNNER if w == "throughput"
                                   else RUNS_PER_RUNNER) for w in workloads}
    return {
        "runners": runners,
        "batches": sorted(set(args.batch_sizes or sizes.batches)),  # a ladder, drawn in order
        "workloads": workloads,
        "prompt_len": args.prompt_len or sizes.prompt_len,
        "steps": args.steps or sizes.steps,
        "warmup": args.warmup if args.warmup is not None else sizes.warmup,
        "prefill": sizes.prefill,
        "churn": sizes.churn,
        "repeats": repeats,
        "defaults": "quick" if args.quick else device,
        "defaults_note": _cpu_default_note(args, sizes, workloads) if sizes is CPU_SIZES else None,
    }


def _default_sizes(args: argparse.Namespace, device: str) -> Sizes:
    if args.quick:  # the GPU keeps its prompt length: kernels for its shapes
        return QUICK_SIZES if device != "cuda" else dataclasses.replace(
            QUICK_SIZES, prompt_len=GPU_SIZES.prompt_len)
    return GPU_SIZES if device == "cuda" else CPU_SIZES


def _cpu_default_note(args: argparse.Namespace, cpu: Sizes, workloads: list[str]) -> str | None:
    """What the CPU default cut from the GPU's, for the sizes no flag set."""
    gpu, cuts = GPU_SIZES, []
    if "decode" in workloads:
        if args.batch_sizes is None:
            cuts.append(f"decode batch sizes {','.join(map(str, cpu.batches))} "
                        f"(GPU {gpu.batches[0]}..{gpu.batches[-1]})")
        if args.steps is None:
            cuts.append(f"{cpu.steps} measured steps (GPU {gpu.steps})")
        if args.warmup is None:
            cuts.append(f"{cpu.warmup} warm-up step (GPU {gpu.warmup})")
        if args.prompt_len is None:
            cuts.append(f"decode prompts of {cpu.prompt_len} tokens (GPU {gpu.prompt_len})")
    if "prefill" in workloads:
        cuts.append(f"prefill {cpu.prefill[0]}x{cpu.prefill[1]} (GPU {gpu.prefill[0]}x{gpu.prefill[1]})")
    if "churn" in workloads:
        cuts.append(f"churn {cpu.churn[0]} live for {cpu.churn[1]} steps "
                    f"(GPU {gpu.churn[0]} for {gpu.churn[1]})")
    if args.workloads is None:
        cuts.append("no throughput workload (GPU: nano-vllm's 256 requests)")
    if not cuts:
        return None
    return "CPU default, smaller than a GPU's (each flag overrides its part): " + "; ".join(cuts)


def needed_len(settings: dict, workload: str) -> int:
    """The longest request (prompt + output tokens) a workload adds."""
    if workload == "decode":
        return settings["prompt_len"] + decode_max_tokens(settings["warmup"], settings["steps"])
    if workload == "prefill":
        return settings["prefill"][1] + 1
    if workload == "churn":
        return wl.CHURN_PROMPT_LEN[1] + wl.CHURN_MAX_TOKENS[1]
    return wl.THROUGHPUT_MAX_LEN


def concurrency(settings: dict) -> int:
    """How many requests must run together for the workloads to be what they say."""
    needs = [1]
    if "decode" in settings["workloads"]:
        needs.append(max(settings["batches"]))
    if "churn" in settings["workloads"]:
        needs.append(settings["churn"][0])
    return max(needs)


def check_flags(args: argparse.Namespace, settings: dict, device: str) -> None:
    """Refuse what would be ignored or would quietly change what is measured."""
    workloads, runners = settings["workloads"], settings["runners"]
    if "decode" not in workloads:
        for name, flag in DECODE_FLAGS.items():
            if getattr(args, name) is not None:
                raise Refused(f"{flag} sets the decode workload, which --workloads "
                              f"{','.join(workloads)} leaves out")
    if getattr(args, "async_scheduling", False) and "v2" not in runners:
        raise Refused("--async-scheduling applies to V2 only (V1 has none), and "
                      f"--runners {','.join(runners)} does not run V2")
    if device != "cuda":
        if args.nvtx:
            raise Refused("--nvtx: NVTX ranges need a CUDA device; this run is on the CPU")
        refusal = cpu_noop_refusal(args, device)
        if refusal:
            raise Refused(refusal)
    seqs = getattr(args, "max_num_seqs", None)
    if seqs is not None and seqs < concurrency(settings):
        raise Refused(f"--max-num-seqs {seqs} is below the {concurrency(settings)} requests the "
                      "workloads run together (the largest --batch-sizes, or churn's live "
                      "requests); raise it or leave it out")


def check_lengths(settings: dict, max_model_len: int) -> None:
    for workload in settings["workloads"]:
        need = needed_len(settings, workload)
        if need > max_model_len:
            raise Refused(
                f"the {workload} workload needs requests of {need} tokens (prompt + output), "
                f"more than max_model_len={max_model_len}; raise --max-model-len"
                + (", or lower --prompt-len / --steps" if workload == "decode" else
                   f", or drop {workload} from --workloads"))


def set_threads(requested: int | None, device: str) -> int:
    """Set torch's intra-op threads; returns the number in use.

    The CPU default is one thread: with two, every OpenMP region waits for its other
    thread, and when another process holds a core that thread is descheduled — on a
    shared two-core machine V1's 3 ms decode step then took 30-400 ms and the default run
    took 54 s instead of 17 s. One thread per runner keeps the A/B steady and fair."""
    if requested is None and device != "cuda" and "OMP_NUM_THREADS" not in os.environ:
        requested = 1
    if requested is not None:
        torch.set_num_threads(requested)
    return torch.get_num_threads()


def check_output_dir(path: str) -> None:
    """Before measuring anything: a run that cannot write its results is refused at once."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise Refused(f"--output-dir {path!r} is not a writable directory "
                      f"({exc.strerror or exc})") from None


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
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 0 for --help, 2 for a usage error (one line)
        return int(exc.code or 0)
    if not getattr(args, "model", None):
        args.model = "tiny-llama"
    try:
        runners = select_runners(args)
        # The device (and so the defaults) and max_model_len, from the first runner's
        # configuration resolved without logging: a refusal stays the only line printed.
        # The engines' own configurations check everything again, strictly.
        config, _ = _engine_args(args, runners[0], 0).create_explain_config()
        device = config.device_config.device
        settings = _settings(args, device, runners)
        check_flags(args, settings, device)
        check_lengths(settings, config.scheduler_config.max_model_len)
        check_output_dir(args.output_dir)
    except (Refused, ValueError) as exc:  # ValueError: the engine configuration's own
        return usage_error(PROG, exc)
    threads = torch.get_num_threads()
    try:  # the thread count is the process's: restored for a caller that goes on (tests)
        settings["threads"] = set_threads(args.threads, device)
        return _measure(args, argv, settings, runners)
    finally:
        torch.set_num_threads(threads)


def _measure(args: argparse.Namespace, argv: list[str], settings: dict, runners: list[str]) -> int:
    set_nvtx_enabled(args.nvtx)
    try:
        engines = {r: LLMEngine.from_engine_args(_engine_args(args, r, concurrency(settings)))
                   for r in runners}
    except ValueError as exc:  # the engine configuration's own checks
        return usage_error(PROG, exc)
    except OSError as exc:  # reading the model
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    report = run_ab(engines, settings, args, engines[runners[0]].device)
    report["command"] = " ".join([PROG, *map(shlex.quote, argv)])
    try:
        paths = write_results(report, args.output_dir)
    except OSError as exc:  # the directory was checked; it can still fill up or vanish
        print(f"{PROG}: error: writing the results to {args.output_dir!r}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 1
    print_tables(report)
    print("\nwrote " + " and ".join(paths))
    return 0 if report["tokens_identical"] else 1


def write_results(report: dict, output_dir: str) -> list[str]:
    path = os.path.join(output_dir, "ab.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    png = write_png(report, os.path.join(output_dir, "ab.png"))
    return [path] + ([png] if png else [])


def interpreter_caveats(engines: dict[str, LLMEngine]) -> tuple[bool, list[str]]:
    """(whether V2 ran under the Triton interpreter, the caveats for the report)."""
    from shared import triton_utils

    if not triton_utils.INTERPRET:
        return False, []
    caveats = []
    v2 = "v2" in engines
    if v2:
        caveats.append(
            "V2 ran under the Triton interpreter (no CUDA GPU): its Triton kernels (input "
            "preparation, sampling, state updates) run as interpreted Python, so V2's times "
            "and the V2/V1 ratios measure the interpreter, not V2's design; compare the "
            "runners on a GPU")
    if any(e.config.attention_backend == "TRITON" for e in engines.values()):
        caveats.append("attention_backend TRITON under the interpreter: every runner's "
                       "attention is interpreted too")
    return v2, caveats


def run_ab(engines: dict[str, LLMEngine], settings: dict, args, device: torch.device) -> dict:
    from tqdm import tqdm

    first = next(iter(engines.values()))
    weight_bytes = first.runner.executor.weight_bytes(include_embedding=False)
    bandwidth = measure_read_bandwidth(device)
    interpreted, caveats = interpreter_caveats(engines)
    start = time.perf_counter()
    report: dict[str, Any] = {
        "command": PROG,
        "model": first.model_config.preset or first.model_config.model,
        "dtype": first.model_config.dtype,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runners": list(engines),
        "v2_triton_interpreter": interpreted,
        "caveats": caveats,
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
    orders = {name: _order(list(engines), settings["repeats"][name]) for name, _, _ in jobs}
    bar = tqdm(total=sum(len(orders[n]) for n, _, _ in jobs), desc="ab", unit="run", file=sys.stderr)
    for name, label, fn in jobs:
        per_runner: dict[str, list[wl.RunResult]] = {r: [] for r in engines}
        run_s: dict[str, list[float]] = {r: [] for r in engines}
        for runner in orders[name]:
            t0 = time.perf_counter()
            with _maybe_profile(args, runner, label):
                per_runner[runner].append(fn(engines[runner], f"{runner}-{label}-{len(per_runner[runner])}-"))
            run_s[runner].append(round(time.perf_counter() - t0, 3))
            bar.update(1)
        same = _same_tokens(per_runner)
        identical &= same
        entry = {"label": label, "tokens_identical": same, "run_s": run_s}
        for runner, results in per_runner.items():
            entry[runner] = _summarise(results)
        if name == "decode" and bandwidth == bandwidth:
            floor_ms = weight_bytes / bandwidth * 1e3
            entry["floor_ms"] = floor_ms
            for runner in engines:
                gpu = entry[runner].get("forward_gpu_ms", {}).get("median")
                if gpu:
                    entry[runner]["achieved_GBps"] = weight_bytes / (gpu / 1e3) / 1e9
        report["workloads"].setdefault(name, []).append(entry)
    bar.close()
    report["tokens_identical"] = identical
    report["measure_s"] = round(time.perf_counter() - start, 2)
    return report


def _order(runners: list[str], runs: int) -> list[str]:
    """A-B-B-A-A-B...: `runs` runs of each runner, alternating which goes first."""
    order: list[str] = []
    for i in range(runs):
        order += runners if i % 2 == 0 else runners[::-1]
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
    # (ab_main has checked that max_model_len holds the longest request)
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

    ref = strip(next(iter(per_runner.values()))[0].tokens)
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
