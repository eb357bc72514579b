"""`runnerlab ab --workloads spec`: speculative decoding against the same engine without
it, on each runner. The flags and their defaults are shared/harness/spec_args.py.

Engines. Unlike the other workloads (one engine per runner, built up front), each
speculative_config needs its own engines: for each config one engine per runner is built,
warmed up (one short run, excluded), run A-B-B-A with the other runner's, and freed (del,
gc, torch.cuda.empty_cache) before the next config's are built, so that two engines of an
8B model and its draft are all the device holds at once. The baselines
(speculative_config=None, one per runner) are measured the same way, first. Every engine
runs one loop, settings["spec"]["engine_loop"] (spec_args.spec_engine_loop: async where
every runner has it with speculative decoding, else sync).

A run: --spec-batch requests of --spec-prompt-len random token ids, --spec-max-tokens
output tokens each (ignore_eos), greedy or sampled with a seed per request. Per engine:
output_tokens_per_s (wall, from the first add to the last finish), steps (prefill
included), tokens_per_step (output tokens / (steps x batch): 1.0 for a baseline whose
prefill is one step), the times of the steps after every request's first token (wall_ms,
stages_ms; on CUDA forward_gpu_ms, the target's forward of the verify step, and
step_gpu_ms; the draft model proposes in postprocess), acceptance
(SpecDecodeStats.as_dict() over the run's requests) and, beside the runner's baseline,
speedup (tokens/s over the baseline's), baseline_output_tokens_per_s,
baseline_tokens_per_step, baseline_forward_gpu_ms and baseline_wall_ms.

A runner the policy refuses for a config (ngram on V2) gets {"refused": "<the error's
first line>"}; a spec engine that fails to build or run gets {"failed": "<Type: first
line>"} (also in report["failures"]; ab then exits 1) and the run goes on.

Tokens (entry["token_checks"], entry["mismatches"]; every request has a seed, so every
run draws the same): each engine's runs must agree with each other; greedy, each engine's
tokens must equal its runner's baseline's (speculation must not change them; synthetic
acceptance, which keeps drafts whatever the target says, is exempt) and V1's must equal
V2's for the same config. Sampled runs keep the distribution, not the tokens: they are
compared run with run only. A mismatch is reported, and ab exits 1.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from policy.cli_args import one_line
from shared.contract.outputs import SpecDecodeStats
from shared.contract.sampling_params import RequestOutputKind, SamplingParams
from shared.harness import workloads as wl
from shared.harness.ab_args import Refused, _engine_args, concurrency
from shared.harness.ab_engines import free_engines, run_order
from shared.harness.measure import StepSamples, decode_prompts, maybe_profile
from shared.harness.report import median
from shared.harness.spec_args import SPEC
from shared.serving.engine import LLMEngine

logger = logging.getLogger("runnerlab")

BASELINE = "baseline"
WARMUP_TOKENS = 8  # output tokens of the excluded first run of each engine
PROMPT_SEED = 4


class BaselineError(Exception):
    """A baseline engine could not be built: without it nothing compares (ab stops)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class _PolicyRefusal(Exception):
    """The engine configuration refused this runner for this config."""


def first_line(error: BaseException | str) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


# ------------------------------------------------------------------ checks before measuring


def check_spec_configs(args: argparse.Namespace, settings: dict) -> None:
    """Each config resolved for every runner, building nothing: a config whose draft the
    engine refuses, or one that no measured runner runs, is refused naming --spec-configs;
    a single runner's refusal is left to its entry (`refused`)."""
    if SPEC not in settings["workloads"]:
        return
    runners, spec = settings["runners"], settings[SPEC]
    loop = spec["engine_loop"]
    _, base_blockers = _engine_args(args, runners[0], loop).create_explain_config()
    for i, (label, config) in enumerate(zip(spec["labels"], spec["configs"])):
        where = f"--spec-configs config {i} ({label})"
        errors = []
        for runner in runners:
            try:
                resolved, blockers = _engine_args(
                    args, runner, loop, speculative=config).create_explain_config()
            except ValueError as exc:
                raise Refused(f"{where}: {one_line(exc)}") from None
            new = [b for b in blockers if b not in base_blockers]
            if new:
                raise Refused(f"{where}: {'; '.join(new)}")
            if resolved.runner_decision.error:
                errors.append(resolved.runner_decision.error)
        if len(errors) == len(runners):
            raise Refused(f"{where}: no runner measured here runs it: {first_line(errors[0])}")


# ------------------------------------------------------------------ one run


def spec_run(engine: LLMEngine, s: dict, tag: str, max_tokens: int | None = None) -> wl.RunResult:
    """One run of the spec workload on `engine` (settings s = settings["spec"])."""
    batch, temperature = s["batch"], s["temperature"]
    ids = [f"{tag}{i}" for i in range(batch)]
    prompts = decode_prompts(batch, s["prompt_len"], engine.vocab_size, PROMPT_SEED)
    for i, (req_id, prompt) in enumerate(zip(ids, prompts)):
        # A seed per request even when greedy: synthetic acceptance draws from it too, so
        # every run of every engine draws the same (the engine's own seeds follow arrivals).
        # outputs only at the finish: no per-step copies of every request's tokens
        params = SamplingParams(max_tokens=max_tokens or s["max_tokens"], temperature=temperature,
                                ignore_eos=True, seed=i, output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(req_id, prompt, params)
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    stats, samples, steps = SpecDecodeStats(), StepSamples(), 0
    t0 = time.perf_counter()
    # prefill, until every request has its first token (None: finished already)
    while any(engine.num_output_tokens(r) == 0 for r in ids):
        _collect(engine.step(), tokens, finished, stats)
        steps += 1
    prefill_steps = steps
    # decode (verify) steps, timed
    while len(finished) < batch:
        t = time.perf_counter()
        outs = engine.step()
        samples.add(engine, (time.perf_counter() - t) * 1e3)
        _collect(outs, tokens, finished, stats)
        steps += 1
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished_requests():  # an empty step carries the finishes to
        engine.step()  # the runner: not one of the run's steps
    total = sum(len(t) for t in tokens.values())
    return wl.RunResult(samples if samples.wall_ms else None, tokens, {
        "seconds": elapsed, "output_tokens": total, "steps": steps,
        "prefill_steps": prefill_steps, "output_tokens_per_s": total / elapsed,
        "tokens_per_step": total / (steps * batch), "spec_decode_stats": stats,
    })


def _collect(outs: list, tokens: dict[str, list[int]], finished: set[str],
             stats: SpecDecodeStats) -> None:
    for out in outs:
        tokens[out.request_id] = out.outputs[0].token_ids
        if out.finished:
            finished.add(out.request_id)
            if out.spec_decode_stats is not None:
                stats.merge(out.spec_decode_stats)


# ------------------------------------------------------------------ engines per config


def _build(args: argparse.Namespace, settings: dict, runner: str,
           config: dict | None) -> LLMEngine:
    try:
        engine_config = _engine_args(
            args, runner, settings[SPEC]["engine_loop"], concurrency(settings),
            num_engines=len(settings["runners"]), speculative=config).create_engine_config()
    except ValueError as exc:
        if config is None:
            raise
        raise _PolicyRefusal(first_line(exc)) from exc
    return LLMEngine(engine_config)


def _engines_for(args: argparse.Namespace, settings: dict,
                 config: dict | None) -> tuple[dict[str, LLMEngine], dict[str, dict]]:
    """(the engines built, {runner: {"refused" | "failed": why}} for the others)."""
    engines: dict[str, LLMEngine] = {}
    status: dict[str, dict] = {}
    for runner in settings["runners"]:
        try:
            engines[runner] = _build(args, settings, runner, config)
        except _PolicyRefusal as exc:
            status[runner] = {"refused": str(exc)}
        except Exception as exc:  # noqa: BLE001 (one config's failure must not end the run)
            if config is None:
                free_engines(engines)
                raise BaselineError(exc) from exc
            status[runner] = _failed(exc, runner, config)
    return engines, status


def _failed(exc: Exception, runner: str, config: dict | None) -> dict:
    """The failure for the entry: its type, first line and, where the message runs on
    (a Triton CompilationError's first line is only a source position), its last."""
    logger.error("spec workload: %s with speculative_config=%s failed", runner.upper(), config,
                 exc_info=exc)
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    words = first_line(exc) + (f" ... {lines[-1]}" if len(lines) > 1 else "")
    return {"failed": f"{type(exc).__name__}: {words}"}


def _run_config(args: argparse.Namespace, settings: dict, label: str, config: dict | None,
                bar: Any, built: tuple[dict[str, LLMEngine], dict[str, dict]] | None = None,
                ) -> tuple[dict, dict[str, list[dict[str, list[int]]]]]:
    """One config's (or the baselines') entry, and each engine's tokens run by run; the
    engines (`built`, or built here) are freed before it returns."""
    s, runners = settings[SPEC], settings["runners"]
    engines, status = built or _engines_for(args, settings, config)
    results: dict[str, list[wl.RunResult]] = {r: [] for r in engines}
    run_s: dict[str, list[float]] = {r: [] for r in engines}
    slug = re.sub(r"[^A-Za-z0-9.=_-]+", "_", label)
    built_with = {r: _engine_info(e) for r, e in engines.items()}
    try:
        for runner in list(engines):
            try:
                spec_run(engines[runner], s, f"{runner}-{slug}-warm-", WARMUP_TOKENS)
            except Exception as exc:  # noqa: BLE001
                status[runner] = _failed(exc, runner, config)
        for runner in run_order(runners, settings["repeats"][SPEC]):
            bar.update(1)
            if runner in status:
                continue
            t0 = time.perf_counter()
            try:
                with maybe_profile(args.profile, args.output_dir, runner, f"spec-{slug}"):
                    results[runner].append(spec_run(
                        engines[runner], s, f"{runner}-{slug}-{len(results[runner])}-"))
            except Exception as exc:  # noqa: BLE001
                status[runner] = _failed(exc, runner, config)
            run_s[runner].append(round(time.perf_counter() - t0, 3))
    finally:
        free_engines(engines)
    entry: dict[str, Any] = {"label": label, "speculative_config": config,
                             "engine_loop": s["engine_loop"], "run_s": run_s}
    tokens = {}
    for runner in runners:
        if runner in status:
            entry[runner] = status[runner]
            continue
        entry[runner] = _summary(results[runner], config is not None)
        entry[runner]["engine"] = built_with[runner]
        tokens[runner] = [{k.rsplit("-", 1)[-1]: v for k, v in r.tokens.items()}
                          for r in results[runner]]
    return entry, tokens


def _engine_info(engine: LLMEngine) -> dict:
    """What the engine was built with: set-up times, and the KV blocks it found room for
    (a shortfall beside the baseline's would show memory the freed engines kept)."""
    return {"startup_s": round(engine.startup_s, 3), "graph_capture_s": round(engine.capture_s, 3),
            "kv_blocks": len(engine.scheduler.kv_cache_manager.blocks)}


def _summary(results: list[wl.RunResult], speculative: bool) -> dict:
    out = wl.summarise(results)
    if speculative:
        stats = SpecDecodeStats()
        for r in results:
            stats.merge(r.extra["spec_decode_stats"])
        out["acceptance"] = stats.as_dict()
    return out


def _beside_baseline(entry: dict, baseline: dict, runners: list[str]) -> None:
    """Each engine's speedup over its runner's baseline, and the baseline's figures."""
    for runner in runners:
        stats, base = entry[runner], baseline[runner]
        tps, base_tps = median(stats, "output_tokens_per_s"), median(base, "output_tokens_per_s")
        if tps is None or not base_tps:
            continue  # refused or failed, here or in the baseline
        stats["speedup"] = tps / base_tps
        stats["baseline_output_tokens_per_s"] = base_tps
        stats["baseline_tokens_per_step"] = median(base, "tokens_per_step")
        stats["baseline_forward_gpu_ms"] = median(base, "forward_gpu_ms")
        stats["baseline_wall_ms"] = median(base, "wall_ms")


# ------------------------------------------------------------------ tokens


def token_checks(label: str, tokens: dict[str, list[dict[str, list[int]]]],
                 baseline: dict[str, list[dict[str, list[int]]]] | None,
                 lossless: bool, across: bool) -> tuple[dict, list[str]]:
    """(checks, mismatch lines). tokens[runner]: one {request index: ids} per run.
    checks: "runs" {runner: every run alike (seeded: always expected)}, "vs_baseline"
    {runner: equal to the runner's baseline; None unless `lossless`}, "v1_vs_v2" (None
    unless `across` and both ran)."""
    checks: dict[str, Any] = {"runs": {}, "vs_baseline": {}, "v1_vs_v2": None}
    lines: list[str] = []
    for runner, runs in tokens.items():
        diff = next((d for d in (_diff(runs[0], run) for run in runs[1:]) if d), None)
        checks["runs"][runner] = diff is None
        if diff:
            lines.append(f"{runner.upper()} {label}: its runs differ ({diff})")
        if baseline is None:
            continue
        base = baseline.get(runner)
        if not lossless or base is None:  # (a failed baseline: nothing to compare)
            checks["vs_baseline"][runner] = None
            continue
        diff = _diff(base[0], runs[0])
        checks["vs_baseline"][runner] = diff is None
        if diff:
            lines.append(f"{runner.upper()} {label}: differs from {runner.upper()}'s baseline ({diff})")
    if across and {"v1", "v2"} <= set(tokens):
        diff = _diff(tokens["v1"][0], tokens["v2"][0])
        checks["v1_vs_v2"] = diff is None
        if diff:
            lines.append(f"{label}: V2 differs from V1 ({diff})")
    return checks, lines


def _diff(a: dict[str, list[int]], b: dict[str, list[int]]) -> str | None:
    """None when alike, else how many requests differ and where the first does."""
    differ = sorted((k for k in a.keys() | b.keys() if a.get(k) != b.get(k)), key=str)
    if not differ:
        return None
    x, y = a.get(differ[0], []), b.get(differ[0], [])
    at = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return (f"{len(differ)} of {len(a.keys() | b.keys())} requests; request {differ[0]} first at "
            f"output token {at} of {max(len(x), len(y))}")


def _checked(checks: dict) -> bool:
    values = list(checks["runs"].values()) + list(checks["vs_baseline"].values())
    values.append(checks["v1_vs_v2"])
    return all(v is not False for v in values)


# ------------------------------------------------------------------ the workload


def run_spec(args: argparse.Namespace, settings: dict, report: dict | None,
             make_head: Callable[[dict[str, LLMEngine]], dict]) -> dict:
    """The spec workload into report["workloads"]["spec"]: the baselines' entry, then one
    entry per config. Without a report (spec alone), make_head makes its head from the
    baseline engines."""
    from tqdm import tqdm

    s, runners = settings[SPEC], settings["runners"]
    start = time.perf_counter()
    total = (1 + len(s["configs"])) * len(runners) * settings["repeats"][SPEC]
    bar = tqdm(total=total, desc="ab spec", unit="run", file=sys.stderr)
    built = None
    if report is None:  # the head from the baselines, built (and measured) first anyway
        built = _engines_for(args, settings, None)
        report = make_head(built[0])
    note = s["engine_loop_note"]
    if note and note not in report.setdefault("warnings", []):  # (alone: in the head already)
        report["warnings"].append(note)
    baseline, base_tokens = _run_config(args, settings, BASELINE, None, bar, built)
    # the runners' plain samplers are bit-identical, seeded or greedy
    baseline["token_checks"], baseline["mismatches"] = token_checks(
        BASELINE, base_tokens, None, lossless=True, across=True)
    entries = [baseline]
    for label, config in zip(s["labels"], s["configs"]):
        entry, tokens = _run_config(args, settings, label, config, bar)
        _beside_baseline(entry, baseline, runners)
        # Greedy: the target's own tokens whatever was drafted, unless synthetic acceptance
        # keeps drafts the target would not have chosen (then V1 and V2 still agree: the
        # same drafts, the same seeded draws). Sampled: the same distribution, not tokens.
        greedy = s["temperature"] == 0
        lossless = greedy and config.get("rejection_sample_method") != "synthetic"
        entry["token_checks"], entry["mismatches"] = token_checks(
            label, tokens, base_tokens, lossless=lossless, across=greedy)
        entries.append(entry)
    bar.close()
    for entry in entries:
        entry["tokens_identical"] = _checked(entry["token_checks"])
    report["workloads"][SPEC] = entries
    report["tokens_identical"] = report.get("tokens_identical", True) and all(
        e["tokens_identical"] for e in entries)
    report.setdefault("failures", []).extend(
        f"{r.upper()} {e['label']}: {e[r]['failed']}" for e in entries for r in runners
        if "failed" in e[r])
    report["spec_measure_s"] = round(time.perf_counter() - start, 2)
    report["measure_s"] = round(report.get("measure_s", 0) + report["spec_measure_s"], 2)
    return report
