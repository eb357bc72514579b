"""`runnerlab diff`, the command line: the scenario library through V1, V2, Hugging Face and a solo run.

    runnerlab diff [--model M] [--dtype float64] [--device cpu|cuda] [--scenarios a,b]
                   [--seeds 0,1] [--engines v1,v2,v1-async,v2-async,hf,solo] [--quick] [--json]
                   [--tensor-parallel-size N] [--batch-invariant]

Engines: `v1`, `v2` (the runners, forced by argument), `v1-async`, `v2-async` (the runner
with the engine's async scheduling: step N+1 launched before step N's tokens are read
back), `hf` (transformers greedy on the
same weights; greedy scenarios of a supported model only) and `solo` (each request
alone through the first listed runner; scenarios that declare a solo reference). With
--tensor-parallel-size N > 1 every runner engine gets a twin `<engine>-tpN` running on N
ranks (torch.distributed), compared exactly with the rest. With --batch-invariant every
engine runs the batch-invariant kernels and the runners, solo included, must agree
bitwise (logprob tolerance 0 unless --logprob-tol says otherwise). A
random-weight preset is materialised as a seeded HF checkpoint (one per seed) whenever
`hf` is asked for, and every engine then runs on that directory.

Pairs: every two runners compare exactly (tokens, finish reasons, logprob dicts; against
an async engine, an aborted request may lack the one token that was in flight); a
runner against `hf` or `solo` compares each reference request over the runner's tokens
(an aborted request's prefix; `hf` only where the request is plain greedy).

--json prints one document: {model, dtype, device, seeds, engines,
scenarios: [{name, seed, summary, greedy, seeded, engines, skipped, expects, events,
missing_events, leaked_blocks, error, agrees, pairs: [{a, b, identical,
first_divergence: {request_id, position} | null, max_logprob_diff, logprob_tol,
requests_compared, detail}]}], all_agree, wall_s}.

Exit status: 0 when everything agrees; 1 on any divergence, logprob difference above
tolerance, missing scenario event, leaked KV block or engine error (each named on
stderr with its scenario and position); 2 on usage errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from policy.cli_args import OneLineArgumentParser, usage_error
from shared.harness.diff import (
    DEFAULT_ENGINES,
    ENGINES,
    RUNNERS,
    ScenarioReport,
    run_diff,
    with_tp_twins,
)
from shared.harness.scenarios import QUICK_SCENARIOS, SCENARIOS


def _csv(kind: str, choices: tuple[str, ...] | None = None):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{kind}: give at least one")
        bad = [t for t in items if choices is not None and t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {kind} {', '.join(bad)}; known: {', '.join(choices or ())}")
        return list(dict.fromkeys(items))
    return parse


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(t) for t in _csv("seeds")(text)]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"seeds must be integers >= 0: {text!r}") from err
    if any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(f"seeds must be integers >= 0: {text!r}")
    return seeds


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{value} is not valid; expected a number >= 0")
    return value


PROG = "runnerlab diff"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog=PROG,
        description="V1 vs V2 vs Hugging Face vs solo runs over the differential scenarios. "
        f"Scenarios: {', '.join(SCENARIOS)}.",
    )
    p.add_argument("--model", default="tiny-llama", help="preset or checkpoint directory")
    p.add_argument("--dtype", default="float64",
                   choices=["float64", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--scenarios", type=_csv("scenario", tuple(SCENARIOS)), default=None,
                   help="comma-separated (default: all; --quick: a subset)")
    p.add_argument("--seeds", type=_seeds, default=[0], help="comma-separated, default 0")
    p.add_argument("--engines", type=_csv("engine", ENGINES), default=DEFAULT_ENGINES.split(","),
                   help=f"comma-separated from {', '.join(ENGINES)} (default {DEFAULT_ENGINES})")
    p.add_argument("--quick", action="store_true",
                   help=f"only {', '.join(QUICK_SCENARIOS)} (tiny-llama float64 CPU by default)")
    p.add_argument("--logprob-tol", type=_tolerance, default=None,
                   help="max |logprob diff| between runners and vs solo (default by dtype)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="N > 1: every runner engine also runs with N ranks (engine <name>-tpN) "
                        "and is compared with the others")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every engine with batch-invariant kernels; runners must then agree "
                        "bitwise (--logprob-tol 0 by default)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    return p


def diff_main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 0 for --help, 2 for a usage error
        return int(exc.code or 0)
    refusal = _refusal(args)
    if refusal:
        return usage_error(PROG, refusal)
    scenarios = args.scenarios or list(QUICK_SCENARIOS if args.quick else SCENARIOS)
    start = time.perf_counter()
    try:
        engines = with_tp_twins(args.engines, args.tensor_parallel_size)
        reports = run_diff(args.model, args.dtype, args.device, scenarios, args.seeds,
                           engines, args.logprob_tol, batch_invariant=args.batch_invariant)
    except ValueError as exc:  # a bad model, dtype or device
        return usage_error(PROG, exc)
    except OSError as exc:  # a model file that cannot be read, a full temporary directory
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    doc = _document(args, reports, time.perf_counter() - start)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_table(doc)
    for line in _problems(reports):
        print(f"runnerlab diff: {line}", file=sys.stderr)
    return 0 if doc["all_agree"] else 1


def _refusal(args: argparse.Namespace) -> str | None:
    """Flags that conflict or would be accepted and do nothing."""
    runners = [e for e in args.engines if e in RUNNERS]
    if not runners:
        return "--engines needs v1, v2, v1-async or v2-async (hf and solo are references)"
    if args.tensor_parallel_size < 1:
        return f"--tensor-parallel-size {args.tensor_parallel_size}: give an integer >= 1"
    if args.quick and args.scenarios:
        return ("--quick picks the scenarios (" + ",".join(QUICK_SCENARIOS) + "), and so does "
                "--scenarios; give one of them")
    if args.logprob_tol is not None and len(runners) < 2 and "solo" not in args.engines:
        return ("--logprob-tol is the tolerance between two runners and against solo; "
                f"--engines {','.join(args.engines)} has neither pair (hf has its own)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--device cuda, but no CUDA GPU is available here"
    return None


def _document(args: argparse.Namespace, reports: list[ScenarioReport], wall_s: float) -> dict:
    scenarios = []
    for r in reports:
        d = dataclasses.asdict(r)
        d["agrees"] = r.agrees
        for p, pd in zip(r.pairs, d["pairs"]):
            pd["agrees"] = p.agrees
        scenarios.append(d)
    return {
        "model": args.model, "dtype": args.dtype, "device": args.device, "seeds": args.seeds,
        "engines": args.engines, "batch_invariant": args.batch_invariant,
        "scenarios": scenarios,
        "all_agree": bool(reports) and all(r.agrees for r in reports),
        "wall_s": round(wall_s, 2),
    }


def _print_table(doc: dict) -> None:
    mode = ", batch-invariant kernels (runners compared bitwise)" if doc["batch_invariant"] else ""
    print(f"runnerlab diff: model {doc['model']}, {doc['dtype']} on {doc['device']}, "
          f"seeds {','.join(map(str, doc['seeds']))}{mode}")
    print(f"{'scenario':<22} {'seed':>4}  {'pair':<16} {'identical':<9} "
          f"{'first divergence':<22} {'max |dlogprob|':>14}")
    for s in doc["scenarios"]:
        for p in s["pairs"]:
            fd = p["first_divergence"]
            where = "-" if fd is None else f"{fd['request_id']}@{fd['position']}"
            lp = p["max_logprob_diff"]
            lp_text = "-" if lp is None else f"{lp:.2e}"
            flag = "" if p["agrees"] else f"  <-- {p['detail']}"
            print(f"{s['name']:<22} {s['seed']:>4}  {p['a'] + '-' + p['b']:<16} "
                  f"{'yes' if p['identical'] else 'NO':<9} {where:<22} {lp_text:>14}{flag}")
        notes = [f"skipped {k}: {v}" for k, v in s["skipped"].items()]
        notes += [f"MISSING EVENT {e}" for e in s["missing_events"]]
        notes += [f"LEAKED {n} KV blocks ({k})" for k, n in s["leaked_blocks"].items() if n]
        notes += [f"ERROR {s['error']}"] if s["error"] else []
        for note in notes:
            print(f"{s['name']:<22} {s['seed']:>4}  {note}")
    print(f"all agree: {'yes' if doc['all_agree'] else 'NO'} ({doc['wall_s']:.1f} s)")


def _problems(reports: list[ScenarioReport]) -> list[str]:
    lines = []
    for r in reports:
        where = f"scenario {r.name} (seed {r.seed})"
        if r.error:
            lines.append(f"{where}: engine error: {r.error}")
        lines += [f"{where}: expected event {e!r} did not occur" for e in r.missing_events]
        lines += [f"{where}: {n} KV blocks not freed by {k}"
                  for k, n in r.leaked_blocks.items() if n]
        for p in r.pairs:
            if not p.agrees:
                fd = p.first_divergence
                lines.append(f"{where}: {p.a} vs {p.b} diverge at request {fd.request_id!r} "
                             f"position {fd.position}: {p.detail}")
    return lines
