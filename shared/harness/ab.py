"""`runnerlab ab`: the same workloads through V1 and V2 in one process.

Both engines are built on the same model and weights (same preset and seed). Runs are
interleaved A-B-B-A so that drift (clocks, caches, allocator state) and order cannot
favour either runner; warm-up steps are excluded. Output: a table on stdout, ab.json
and ab.png in --output-dir, and a check that the runners produced identical tokens.
`--runners v1` (or `--model-runner v1`) measures one runner alone: its stage times, no
ratios. Every runner runs the same engine loop (--engine-loop; `both`: each workload
under each loop, engines v1-sync, v2-sync, v1-async, v2-async). The throughput workload
is set beside its floor (shared/harness/floor.py) at the read bandwidth and matmul rate
measured at the start. `--workloads spec` (shared/harness/spec_workload.py) measures
speculative decoding against the same engines without it; `--workloads embed`
(shared/harness/embed_workload.py) embeddings per second of pooling engines beside the
GEMM-rate floor. On a machine without a CUDA GPU, V2's Triton kernels run under the Triton
interpreter; the table, ab.json and ab.png say so, and the default sizes are smaller.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Mapping
from types import SimpleNamespace

import torch

from policy.cli_args import usage_error
from shared.harness import workloads as wl
from shared.harness.ab_args import (
    PROG,
    Refused,
    _engine_args,
    _settings,
    build_parser,
    check_flags,
    check_lengths,
    check_output_dir,
    select_runners,
    set_threads,
)
from shared.harness.ab_engines import (
    OneEngineAtATime,
    build_engines,
    describe_engines,
    difference_warnings,
    free_engines,
    run_order,
)
from shared.harness.ab_loops import resolve_engine_loops
from shared.harness.chart import write_png
from shared.harness.embed_args import EMBED
from shared.harness.embed_workload import check_embed_configs, run_embed
from shared.harness.floor import Floor, Rates, engine_shape, throughput_floor
from shared.harness.measure import maybe_profile, measure_gemm_rate, measure_read_bandwidth
from shared.harness.report import print_tables
from shared.harness.spec_args import SPEC
from shared.harness.spec_workload import BaselineError, check_spec_configs, run_spec
from shared.serving.engine import LLMEngine

logger = logging.getLogger("runnerlab")


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
        loops = resolve_engine_loops(args, runners)
        # The device (and so the defaults) and max_model_len, from the first runner's
        # configuration resolved without logging: a refusal stays the only line printed.
        # The engines' own configurations check everything again, strictly.
        config, _ = _engine_args(args, runners[0], loops.loops[0]).create_explain_config()
        device = config.device_config.device
        settings = _settings(args, device, runners, loops)
        check_flags(args, settings, device)
        check_lengths(settings, config.scheduler_config.max_model_len)
        check_spec_configs(args, settings)
        check_embed_configs(args, settings)
        check_output_dir(args.output_dir)
    except (Refused, ValueError) as exc:  # ValueError: the engine configuration's own
        return usage_error(PROG, exc)
    threads = torch.get_num_threads()
    try:  # the thread count is the process's: restored for a caller that goes on (tests)
        settings["threads"] = set_threads(args.threads, device)
        return _measure(args, argv, settings)
    finally:
        torch.set_num_threads(threads)


def _measure(args: argparse.Namespace, argv: list[str], settings: dict) -> int:
    """The workloads of the engines built up front, then (those freed first) the spec
    workload, which builds its own engines config by config, then the embed workload,
    which builds a pooling engine per runner."""
    report = None
    if any(w not in (SPEC, EMBED) for w in settings["workloads"]):
        try:
            engines = build_engines(args, settings)
        except (ValueError, OSError) as exc:
            return _build_error(exc)
        report = run_ab(engines, settings, args, next(iter(engines.values())).device)
        free_engines(engines)
    if SPEC in settings["workloads"]:
        try:
            report = run_spec(args, settings, report, lambda engines: _report_head(
                engines, settings, next(iter(engines.values())).device))
        except BaselineError as exc:  # a spec engine's own failure is its entry's
            return _build_error(exc.error)
    if EMBED in settings["workloads"]:
        try:
            report = run_embed(args, settings, report, lambda engines: _report_head(
                engines, settings, next(iter(engines.values())).device))
        except (ValueError, OSError) as exc:
            return _build_error(exc)
    report["command"] = " ".join([PROG, *map(shlex.quote, argv)])
    try:
        paths = write_results(report, args.output_dir)
    except OSError as exc:  # the directory was checked; it can still fill up or vanish
        print(f"{PROG}: error: writing the results to {args.output_dir!r}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 1
    print_tables(report)
    print("\nwrote " + " and ".join(paths))
    # (a spec engine that failed is in its entry and in "failures": the run goes on; so
    # are embeddings that differ. The embed workload alone compares no tokens.)
    return 0 if report.get("tokens_identical", True) and not report.get("failures") else 1


def _build_error(exc: Exception) -> int:
    if isinstance(exc, ValueError):  # the engine configuration's own checks
        return usage_error(PROG, exc)
    print(f"{PROG}: error: {exc}", file=sys.stderr)  # OSError: reading the model
    return 1


def write_results(report: dict, output_dir: str) -> list[str]:
    path = os.path.join(output_dir, "ab.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    png = write_png(report, os.path.join(output_dir, "ab.png"))
    return [path] + ([png] if png else [])


def interpreter_caveats(engines: dict[str, LLMEngine]) -> tuple[bool, list[str]]:
    """(whether V2 ran under the Triton interpreter, the caveats for the report)."""
    from shared.runtime import triton_utils

    if not triton_utils.INTERPRET:
        return False, []
    caveats = []
    v2 = any(e.runner_name == "v2" for e in engines.values())
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

    report = _report_head(engines, settings, device)
    floor = _throughput_floor(engines, report) if "throughput" in settings["workloads"] else None
    start = time.perf_counter()
    identical = True
    jobs = _jobs(settings)
    grouped = isinstance(engines, OneEngineAtATime)
    if grouped:
        report["warnings"].append(
            "tensor parallelism: the engines were built one at a time (a process joins one "
            "torch.distributed group at a time), so each workload ran A-A-A-B-B-B, not "
            "interleaved A-B-B-A")
    orders = {label: run_order(list(engines), settings["repeats"][name], grouped, i % 2 == 1)
              for i, (name, label, _) in enumerate(jobs)}
    bar = tqdm(total=sum(len(o) for o in orders.values()), desc="ab", unit="run", file=sys.stderr)
    for name, label, fn in jobs:
        per_engine: dict[str, list[wl.RunResult]] = {e: [] for e in engines}
        run_s: dict[str, list[float]] = {e: [] for e in engines}
        for engine in orders[label]:
            t0 = time.perf_counter()
            with maybe_profile(args.profile, args.output_dir, engine, label):
                per_engine[engine].append(fn(engines[engine], f"{engine}-{label}-{len(per_engine[engine])}-"))
            run_s[engine].append(round(time.perf_counter() - t0, 3))
            bar.update(1)
        same = _same_tokens(per_engine)
        identical &= same
        entry = {"label": label, "tokens_identical": same, "run_s": run_s}
        for engine, results in per_engine.items():
            entry[engine] = wl.summarise(results)
        if name == "decode":
            _decode_floor(entry, report)
        elif name == "throughput":
            _set_beside_floor(entry, floor, list(engines))
        report["workloads"].setdefault(name, []).append(entry)
    bar.close()
    report["tokens_identical"] = identical
    report["measure_s"] = round(time.perf_counter() - start, 2)
    return report


def _snapshots(engines: Mapping[str, LLMEngine]) -> dict[str, SimpleNamespace]:
    """What the head reads of each engine, each engine visited once (ab's engines may be
    built one at a time: visiting one can replace the live one)."""
    return {label: SimpleNamespace(
        config=e.config, runner_name=e.runner_name, async_scheduling=e.async_scheduling,
        startup_s=e.startup_s, capture_s=e.capture_s) for label, e in engines.items()}


def _report_head(engines: Mapping[str, LLMEngine], settings: dict, device: torch.device) -> dict:
    """What ran where and with what, and the rates the floors divide by."""
    first = next(iter(engines.values()))
    dtype = first.model_config.torch_dtype
    weight_bytes = first.runner.executor.weight_bytes(include_embedding=False)
    bandwidth = measure_read_bandwidth(device)
    gemm = measure_gemm_rate(device, dtype)
    seen = _snapshots(engines)
    interpreted, caveats = interpreter_caveats(seen)
    described = describe_engines(seen, settings)
    warnings = [settings["engine_loop_warning"]] if settings["engine_loop_warning"] else []
    return {
        "command": PROG,
        "model": first.model_config.preset or first.model_config.model,
        "dtype": first.model_config.dtype,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runners": list(settings["runners"]),
        "engine_loops": list(settings["engine_loops"]),
        "engines": described,
        "warnings": warnings + difference_warnings(described),
        "v2_triton_interpreter": interpreted,
        "caveats": caveats,
        "settings": settings,
        "weight_bytes": weight_bytes,
        "read_bandwidth_GBps": bandwidth / 1e9,
        "gemm_TFLOPs": gemm / 1e12,
        "gemm_dtype": str(dtype).removeprefix("torch."),
        "startup_s": {r: e.startup_s for r, e in seen.items()},
        "graph_capture_s": {r: e.capture_s for r, e in seen.items()},
        "async_scheduling": {r: e.async_scheduling for r, e in seen.items()},
        "workloads": {},
    }


def _decode_floor(entry: dict, report: dict) -> None:
    """Weight bytes / read bandwidth beside a decode step, and the bandwidth each runner's
    forward reached on the GPU."""
    weight_bytes, bandwidth = report["weight_bytes"], report["read_bandwidth_GBps"] * 1e9
    entry["floor_ms"] = weight_bytes / bandwidth * 1e3
    for engine in report["engines"]:
        gpu = entry[engine].get("forward_gpu_ms", {}).get("median")
        if gpu:
            entry[engine]["achieved_GBps"] = weight_bytes / (gpu / 1e3) / 1e9


def _throughput_floor(engines: dict[str, LLMEngine], report: dict) -> Floor:
    """The floor of the workload _throughput_job runs, for the engines' max_num_seqs (the
    same in every engine: ab_args._engine_args)."""
    prompts, max_tokens = wl.nano_vllm_workload()
    first = next(iter(engines.values()))
    rates = Rates(report["read_bandwidth_GBps"] * 1e9, report["gemm_TFLOPs"] * 1e12)
    return throughput_floor(engine_shape(first), [len(p) for p in prompts], max_tokens,
                            first.config.scheduler_config.max_num_seqs, rates)


def _set_beside_floor(entry: dict, floor: Floor, engines: list[str]) -> None:
    """The floor, and the fraction of it each engine reached: floor time / its median time."""
    entry["floor"] = floor.to_json()
    for engine in engines:
        entry[engine]["floor_fraction"] = floor.seconds / entry[engine]["seconds"]["median"]


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


def _same_tokens(per_engine: dict[str, list[wl.RunResult]]) -> bool:
    """Whether every run of every engine (each runner, each loop) produced the same tokens."""
    def strip(tokens: dict[str, list[int]]) -> dict[str, list[int]]:
        # request ids carry the engine and run index; compare by the request's suffix
        return {k.rsplit("-", 1)[-1]: v for k, v in tokens.items()}

    ref = strip(next(iter(per_engine.values()))[0].tokens)
    return all(strip(r.tokens) == ref for rs in per_engine.values() for r in rs)


