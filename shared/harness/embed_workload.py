"""`runnerlab ab --workloads embed`: embeddings per second of V1 and V2, beside the
GEMM-rate floor. The flags and their defaults are shared/harness/embed_args.py.

Engines. One pooling engine per runner (pooling_task='embed', the policy's default pooler
settings), built after the other workloads' engines are freed, like the spec workload's,
and freed at the end; each runs settings["embed"]["engine_loop"] and at most
settings["embed"]["max_num_seqs"] prompts a step (the token budget is ab's own).

A run: --embed-prompts prompts of random token ids, lengths uniform in [--embed-min-len,
--embed-max-len] (seeded: every run and runner embeds the same prompts), all added, then
stepped until every embedding is out. Timed on the wall from before the first add to the
last embedding (on CUDA synchronised at both ends); per runner embeddings_per_s (prompts
/ seconds), prompt_tokens_per_s, seconds and steps, median/min/max/n over the runs
(A-B-B-A, after one excluded warm-up run of the same prompts), and floor_fraction (floor seconds /
median seconds; above 1 means faster than the floor, and is reported as it is).

The floor (floor.GemmFloor): prompt tokens x 2 x matmul parameters / the GEMM rate
measured at the start in the run's dtype.

Agreement (entry["agreement"]): the largest |V1 - V2| over every element of every
embedding (each runner's first run), and over each runner's runs against its first. In
float32 and float64 both must be within EMBED_TOLERANCE; otherwise the entry says so, the
difference is in report["failures"], and ab exits 1, as on a token mismatch. In bfloat16
and float16 the differences are reported only.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from policy.cli_args import one_line
from shared.harness import workloads as wl
from shared.harness.ab_args import Refused, _engine_args
from shared.harness.ab_engines import free_engines, run_order, summarize_sizes
from shared.harness.embed_args import EMBED
from shared.harness.floor import GemmFloor, matmul_params, parameter_count
from shared.harness.measure import maybe_profile, sync_engine
from shared.serving.engine import LLMEngine

EMBED_SEED = 5
EMBED_TOLERANCE = 1e-5  # max |V1 - V2| allowed in float32 / float64
CHECKED_DTYPES = (torch.float32, torch.float64)


def embed_prompts(n: int, min_len: int, max_len: int, vocab: int,
                  seed: int = EMBED_SEED) -> list[list[int]]:
    """n prompts of random token ids in [1, min(vocab, 10000)), lengths uniform in
    [min_len, max_len]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=n)
    return [rng.integers(1, min(vocab, 10000), size=int(k)).tolist() for k in lengths]


# ------------------------------------------------------------------ engines


def embed_engine_args(args: argparse.Namespace, settings: dict, runner: str):
    """ab's EngineArgs for `runner` (its token budget, memory share, no prefix caching),
    as a pooling engine: pooling_task='embed' and the --pooler-config given, if any (the
    generation engines never get it: ab_args._engine_args)."""
    from policy import EngineArgs

    s = settings[EMBED]
    base = _engine_args(args, runner, s["engine_loop"], s["max_num_seqs"],
                        num_engines=len(settings["runners"])).model_dump()
    base["pooling_task"] = EMBED
    if getattr(args, "pooler_config", None) is not None:
        base["pooler_config"] = args.pooler_config
    return EngineArgs(**base)


def check_embed_configs(args: argparse.Namespace, settings: dict) -> None:
    """Each runner's pooling engine resolved, building nothing: one the policy refuses is
    refused before anything is measured, naming the runner."""
    if EMBED not in settings["workloads"]:
        return
    for runner in settings["runners"]:
        try:
            config, _ = embed_engine_args(args, settings, runner).create_explain_config()
        except ValueError as exc:
            raise Refused(f"--workloads embed: {runner.upper()}'s pooling engine: "
                          f"{one_line(exc)}") from None
        error = config.runner_decision.error
        if error:
            others = [r for r in settings["runners"] if r != runner]
            fix = f"; measure --runners {','.join(others)}" if others else ""
            raise Refused(f"--workloads embed: {runner.upper()}'s pooling engine: "
                          f"{one_line(error)}{fix}")


def _build_engines(args: argparse.Namespace, settings: dict) -> dict[str, LLMEngine]:
    engines: dict[str, LLMEngine] = {}
    try:
        for runner in settings["runners"]:
            engines[runner] = LLMEngine(embed_engine_args(args, settings, runner)
                                        .create_engine_config())
    except BaseException:
        free_engines(engines)
        raise
    return engines


def engine_info(engine: LLMEngine) -> dict[str, Any]:
    """What a pooling engine runs with, read back from it (graph mode and sizes: a pooling
    engine captures no FULL graphs)."""
    cc = engine.config.compilation_config
    pooler = getattr(engine.config, "pooler_config", None)
    return {
        "pooler": None if pooler is None else pooler.model_dump(mode="json"),
        "engine_loop": "async" if engine.async_scheduling else "sync",
        "cudagraph_mode": cc.cudagraph_mode,
        "capture_sizes": summarize_sizes(cc.cudagraph_capture_sizes),
        "max_num_seqs": engine.config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": engine.config.scheduler_config.max_num_batched_tokens,
        "kv_blocks": engine.num_total_kv_blocks(),
        "startup_s": round(engine.startup_s, 3),
        "graph_capture_s": round(engine.capture_s, 3),
    }


# ------------------------------------------------------------------ one run


@dataclass
class EmbedRun:
    seconds: float
    steps: int
    embeddings: dict[str, torch.Tensor]  # request index -> its embedding (on the CPU)

    def result(self, prompt_tokens: int) -> wl.RunResult:
        n = len(self.embeddings)
        return wl.RunResult(None, {}, {
            "seconds": self.seconds, "steps": self.steps,
            "embeddings_per_s": n / self.seconds,
            "prompt_tokens_per_s": prompt_tokens / self.seconds,
        })


def embed_run(engine: LLMEngine, prompts: list[list[int]], tag: str) -> EmbedRun:
    """Every prompt added at once, stepped until every embedding is out."""
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    out: dict[str, torch.Tensor] = {}
    steps = 0  # (a pooling request reports once, when its embedding is complete)
    sync_engine(engine)
    t0 = time.perf_counter()
    for req_id, prompt in zip(ids, prompts):
        engine.add_request(req_id, prompt, None)
    while len(out) < len(ids):
        for o in engine.step():
            out[o.request_id.rsplit("-", 1)[-1]] = o.outputs.data
        steps += 1
    sync_engine(engine)
    seconds = time.perf_counter() - t0
    while engine.has_unfinished_requests():  # an empty step carries the finishes to
        engine.step()  # the runner: not one of the run's steps
    return EmbedRun(seconds, steps, out)


# ------------------------------------------------------------------ agreement


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest |a - b| over every element of every embedding; inf when the two do not
    hold the same requests or shapes."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    keys = sorted(a)
    x = torch.stack([a[k] for k in keys]).to(torch.float64)
    y = torch.stack([b[k] for k in keys]).to(torch.float64)
    return float((x - y).abs().max()) if x.numel() else 0.0


def agreement(runs: dict[str, list[dict[str, torch.Tensor]]], dtype: torch.dtype) -> dict:
    """{"v1_vs_v2": max |V1 - V2| (None with one runner), "runs": {runner: max over its
    runs against its first}, "dtype", "tolerance" (None: reported only), "agree" (None:
    reported only)}."""
    within = {r: max((max_abs_diff(rs[0], x) for x in rs[1:]), default=0.0)
              for r, rs in runs.items()}
    across = max_abs_diff(runs["v1"][0], runs["v2"][0]) if {"v1", "v2"} <= set(runs) else None
    checked = dtype in CHECKED_DTYPES
    diffs = list(within.values()) + ([] if across is None else [across])
    return {"v1_vs_v2": across, "runs": within, "dtype": str(dtype).removeprefix("torch."),
            "tolerance": EMBED_TOLERANCE if checked else None,
            "agree": all(d <= EMBED_TOLERANCE for d in diffs) if checked else None}


def disagreements(check: dict) -> list[str]:
    """The lines for report["failures"] when the check failed."""
    if check["agree"] is not False:
        return []
    tol, lines = check["tolerance"], []
    if check["v1_vs_v2"] is not None and check["v1_vs_v2"] > tol:
        lines.append(f"embed: V1 and V2 embeddings differ by up to {check['v1_vs_v2']:.3g} "
                     f"(> {tol:g} in {check['dtype']})")
    lines += [f"embed: {r.upper()}'s runs differ by up to {d:.3g} (> {tol:g} in {check['dtype']})"
              for r, d in check["runs"].items() if d > tol]
    return lines


# ------------------------------------------------------------------ the workload


def _measure(args: argparse.Namespace, settings: dict, engines: dict[str, LLMEngine],
             prompts: list[list[int]]) -> tuple[dict, dict, dict]:
    """(results per runner, embeddings per runner run by run, run_s per runner)."""
    from tqdm import tqdm

    runners, repeats = settings["runners"], settings["repeats"][EMBED]
    results: dict[str, list[wl.RunResult]] = {r: [] for r in runners}
    embeddings: dict[str, list[dict[str, torch.Tensor]]] = {r: [] for r in runners}
    run_s: dict[str, list[float]] = {r: [] for r in runners}
    tokens = sum(len(p) for p in prompts)
    for runner in runners:  # the same steps as the timed runs: every shape compiled
        embed_run(engines[runner], prompts, f"{runner}-embed-warm-")
    bar = tqdm(total=len(runners) * repeats, desc="ab embed", unit="run", file=sys.stderr)
    for runner in run_order(runners, repeats):
        t0 = time.perf_counter()
        with maybe_profile(args.profile, args.output_dir, runner, "embed"):
            run = embed_run(engines[runner], prompts, f"{runner}-embed-{len(results[runner])}-")
        run_s[runner].append(round(time.perf_counter() - t0, 3))
        results[runner].append(run.result(tokens))
        embeddings[runner].append(run.embeddings)
        bar.update(1)
    bar.close()
    return results, embeddings, run_s


def _workload(engine: LLMEngine, s: dict, gemm_tflops: float) -> tuple:
    """(prompts, GEMM floor, dtype) of the embed run on `engine`'s model. A function of
    its own so that no local of run_embed names an engine or its model when
    free_engines collects them."""
    prompts = embed_prompts(s["prompts"], s["min_len"], s["max_len"], engine.vocab_size)
    model = engine.runner.executor.model
    floor = GemmFloor(len(prompts), sum(len(p) for p in prompts), matmul_params(model),
                      parameter_count(model), gemm_tflops * 1e12)
    return prompts, floor, engine.model_config.torch_dtype


def run_embed(args: argparse.Namespace, settings: dict, report: dict | None,
              make_head: Callable[[dict[str, LLMEngine]], dict]) -> dict:
    """The embed workload into report["workloads"]["embed"] (a list of one entry).
    Without a report (embed alone), make_head makes its head from the pooling engines."""
    s, runners = settings[EMBED], settings["runners"]
    start = time.perf_counter()
    engines = _build_engines(args, settings)
    try:
        if report is None:
            report = make_head(engines)
        prompts, floor, dtype = _workload(engines[runners[0]], s, report["gemm_TFLOPs"])
        info = {r: engine_info(e) for r, e in engines.items()}
        results, embeddings, run_s = _measure(args, settings, engines, prompts)
    finally:
        free_engines(engines)
    entry = _entry(s, floor, info, results, run_s, agreement(embeddings, dtype))
    if s["engine_loop_note"] and s["engine_loop_note"] not in report.setdefault("warnings", []):
        report["warnings"].append(s["engine_loop_note"])
    report["workloads"][EMBED] = [entry]
    report.setdefault("failures", []).extend(disagreements(entry["agreement"]))
    report["embed_measure_s"] = round(time.perf_counter() - start, 2)
    report["measure_s"] = round(report.get("measure_s", 0) + report["embed_measure_s"], 2)
    return report


def _entry(s: dict, floor: GemmFloor, info: dict, results: dict, run_s: dict,
           check: dict) -> dict:
    entry: dict[str, Any] = {
        "label": f"{s['prompts']}x{s['min_len']}..{s['max_len']}",
        "prompts": floor.prompts, "prompt_tokens": floor.prompt_tokens,
        "min_len": s["min_len"], "max_len": s["max_len"], "seed": EMBED_SEED,
        "engine_loop": s["engine_loop"], "engines": info, "run_s": run_s,
        "floor": floor.to_json(), "agreement": check,
    }
    for runner, rs in results.items():
        stats = wl.summarise(rs)
        stats["floor_fraction"] = floor.seconds / stats["seconds"]["median"]
        entry[runner] = stats
    return entry
