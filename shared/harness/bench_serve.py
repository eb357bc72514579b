"""`runnerlab bench serve`: online serving latency and throughput of V1 and V2.

For each runner of --runners, a `runnerlab serve` subprocess on a free local port (the
engine flags given here are forwarded to it), a wait for GET /health, then the workload
at every --request-rate (Poisson arrivals; inf: every request at once), then the server
is stopped. --base-url targets a server that is already running instead. Results: a
table on stdout, --json and --png; logs go to stderr.

Exit status: 0 when every request completed, 1 when a request or a server failed, 2 for a
refused flag (one line naming it), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

import httpx

from policy.cli_args import (
    OneLineArgumentParser,
    bounded_int,
    cpu_noop_refusal,
    name_list,
    one_line,
    usage_error,
)
from policy.config import EngineConfig
from policy.engine_args import EngineArgs, add_engine_args, engine_args_from_namespace
from policy.model_config import build_model_config
from shared.harness import bench_serve_client as client
from shared.harness import bench_serve_report as reporting
from shared.harness.bench_serve_client import LoadSettings, RequestSpec
from shared.harness.bench_serve_server import (
    PROG,
    PROJECT_ROOT,
    ServerError,
    managed_server,
    terminate_on_sigterm,
)

RUNNERS = ("v1", "v2")
NANO_VLLM_LEN = (100, 1024)  # nano-vllm's bench.py: prompt and output lengths uniform in it


class Refused(Exception):
    """A flag that cannot be honoured; its message names the flag and the fix."""


def rate_list(text: str) -> list[float]:
    """Type of --request-rate: comma-separated positive numbers or inf (duplicates dropped)."""
    rates = []
    for item in (t.strip() for t in text.split(",")):
        try:
            rate = float(item)
        except ValueError:
            rate = math.nan
        if not rate > 0:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a request rate; expected comma-separated numbers > 0 or "
                "inf, e.g. 1,4,16,inf")
        rates.append(rate)
    return list(dict.fromkeys(rates))


def length_range(text: str) -> tuple[int, int]:
    """Type of --input-len / --output-len: MIN,MAX (or one N for N,N), 1 <= MIN <= MAX."""
    items = [t.strip() for t in text.split(",")]
    try:
        values = [int(t) for t in items]
    except ValueError:
        values = []
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or not 1 <= values[0] <= values[1]:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a length range; expected MIN,MAX with 1 <= MIN <= MAX, e.g. 100,1024")
    return values[0], values[1]


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; expected seconds > 0")
    return value


def build_parser() -> OneLineArgumentParser:
    # "resolve": the benchmark's --seed (the workload's, as in vLLM) replaces the engine's,
    # which the servers then leave at its default (every request carries its own seed)
    parser = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                   conflict_handler="resolve")
    add_engine_args(parser, require_model=True)
    g = parser.add_argument_group("benchmark")
    g.add_argument("--runners", type=name_list("runner", RUNNERS), default=None,
                   help="the runners to start a server for, in order (default v1,v2)")
    g.add_argument("--base-url", default=None,
                   help="benchmark the server running at this URL instead of starting one "
                        "(--model then only folds the prompts into its vocabulary)")
    g.add_argument("--label", default=None, help="with --base-url: its row's name (default server)")
    g.add_argument("--workload", choices=("nano-vllm", "chat"), default="nano-vllm",
                   help="nano-vllm: random token-id prompts, ignore_eos; chat: English "
                        "user turns (a model with a tokenizer and chat template)")
    g.add_argument("--num-prompts", type=bounded_int(1), default=256, metavar="N",
                   help="requests per rate (default 256, as nano-vllm)")
    g.add_argument("--input-len", type=length_range, default=None,
                   help="nano-vllm: prompt lengths MIN,MAX in tokens (default 100,1024)")
    g.add_argument("--output-len", type=length_range, default=NANO_VLLM_LEN,
                   help="max_tokens MIN,MAX (default 100,1024)")
    g.add_argument("--request-rate", type=rate_list, default=[math.inf],
                   help="requests/s, comma-separated; inf: all at once (default inf)")
    g.add_argument("--max-concurrency", type=bounded_int(1), default=None,
                   help="at most this many requests in flight (default: no cap)")
    g.add_argument("--seed", dest="workload_seed", type=bounded_int(0), default=0, metavar="SEED",
                   help="seed of the prompts, lengths and arrival times (not the engine's)")
    g.add_argument("--num-warmups", type=bounded_int(0), default=1,
                   help="requests sent (with max_tokens <= 8) before each server is measured")
    g.add_argument("--timeout-s", type=positive_float, default=600.0,
                   help="a request that takes longer fails (default 600)")
    g.add_argument("--startup-timeout-s", type=positive_float, default=600.0,
                   help="seconds to wait for a started server's /health (default 600)")
    g.add_argument("--json", default=None, metavar="PATH", help="write the report here")
    g.add_argument("--save-requests", action="store_true",
                   help="put every request's raw timings in the --json report")
    g.add_argument("--png", default=None, metavar="PATH", help="draw the latency chart here")
    return parser


def engine_flag_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags given (all but --model and --model-runner), as a server's argv."""
    actions = {a.dest: a for a in build_parser()._actions}
    argv: list[str] = []
    for name in EngineArgs.model_fields:
        if name in ("model", "model_runner") or not hasattr(args, name):
            continue
        value, flag = getattr(args, name), actions[name].option_strings[0]
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def check_flags(args: argparse.Namespace) -> None:
    """Refusals that need no model: flags that conflict or would do nothing."""
    if hasattr(args, "model_runner"):
        raise Refused("--model-runner: bench serve starts one server per runner; "
                      "use --runners v1, --runners v2 or --runners v1,v2")
    if args.base_url is not None:
        if args.runners is not None:
            raise Refused("--runners: with --base-url no server is started; "
                          "name the row with --label")
        given = [f for f in engine_flag_argv(args) if f.startswith("--")]
        if given:
            raise Refused(f"{given[0]}: with --base-url the running server's engine is "
                          "already configured; drop the engine flags (--model stays: it "
                          "sizes the prompts' token ids)")
    elif args.label is not None:
        raise Refused("--label names the row of a --base-url server; the started servers "
                      "are named after their runner")
    if args.workload == "chat" and args.input_len is not None:
        raise Refused("--input-len: the chat workload's prompts are fixed English turns; "
                      "drop it, or use --workload nano-vllm")
    if args.save_requests and args.json is None:
        raise Refused("--save-requests: the raw records go into the --json report; "
                      "add --json PATH")
    for flag, path in (("--json", args.json), ("--png", args.png)):
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise Refused(f"{flag}: the directory of {path!r} does not exist; create it or "
                          "give another path")
    if args.png is not None and find_spec("matplotlib") is None:
        raise Refused("--png needs matplotlib, which is not installed; "
                      "pip install matplotlib, or drop --png")


def check_engines(args: argparse.Namespace, runners: list[str]) -> EngineConfig:
    """Every server's configuration, resolved here without starting one, so that a bad
    engine flag is refused before any server starts; -> the last one."""
    config = None
    for runner in runners:
        engine_args = engine_args_from_namespace(args, model_runner=runner)
        refusal = cpu_noop_refusal(args, engine_args.device)
        if refusal:
            raise Refused(refusal)
        config, blockers = engine_args.create_explain_config()
        if blockers:  # each names its field and flag
            raise Refused("; ".join(blockers))
        if config.runner_decision.error:
            raise Refused(f"--runners {runner}: {config.runner_decision.error}")
    return config


def local_vocab_size(model: str) -> int | None:
    """--base-url: the vocabulary of --model when runnerlab can read its config.json here
    (it folds the prompts' token ids into it); None for a model only the server knows."""
    try:
        return build_model_config(model, "auto", "cpu", None).vocab_size
    except (ValueError, OSError):
        return None


def check_lengths(input_len: tuple[int, int] | None, output_len: tuple[int, int],
                  max_model_len: int) -> None:
    longest = (input_len[1] if input_len else 0) + output_len[1]
    if longest > max_model_len:
        raise Refused(
            f"--input-len/--output-len: the longest request is {longest} tokens, more than "
            f"max_model_len={max_model_len}; lower the MAX of --input-len or --output-len, "
            "or raise --max-model-len")


def bench_target(base_url: str, label: str, specs: list[RequestSpec], args: argparse.Namespace,
                 check_alive: Callable[[], None] = lambda: None) -> tuple[str, list[dict]]:
    """Warm-up, then every rate against one server; -> (served model name, rows)."""
    try:
        name = client.served_model_name(base_url)
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
        check_alive()
        raise ServerError(f"{label} at {base_url}: GET /v1/models failed: "
                          f"{one_line(exc) or type(exc).__name__}") from exc
    settings = LoadSettings(base_url=base_url, model_name=name,
                            endpoint=client.CHAT if args.workload == "chat"
                            else client.COMPLETIONS,
                            max_concurrency=args.max_concurrency, timeout_s=args.timeout_s)
    warm = [dataclasses.replace(s, max_tokens=min(s.max_tokens, 8))
            for s in specs[:args.num_warmups]]
    for record in client.run_load(warm, [0.0] * len(warm), settings):
        if not record.ok:
            check_alive()
            raise ServerError(f"{label} at {base_url}: a warm-up request failed: {record.error}")
    rows = []
    for rate in args.request_rate:
        print(f"{PROG}: {label}: {len(specs)} requests at rate {rate:g}", file=sys.stderr)
        arrivals = client.arrival_offsets(len(specs), rate, args.workload_seed)
        records = client.run_load(specs, arrivals, settings)
        check_alive()  # a server that died mid-run: its log says why, not N failed requests
        rows.append(reporting.result_entry(label, rate, records, args.save_requests))
    return settings.model_name, rows


def bench_serve_main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 0 for --help, 2 for a usage error (one line)
        return int(exc.code or 0)
    runners = args.runners or list(RUNNERS)
    try:
        check_flags(args)
        # a running server's configuration is its own: it refuses what does not fit it
        config = check_engines(args, runners) if args.base_url is None else None
        if args.workload == "nano-vllm":
            input_len = args.input_len or NANO_VLLM_LEN
            if config is not None:
                check_lengths(input_len, args.output_len, config.scheduler_config.max_model_len)
            vocab = config.model_config.vocab_size if config else local_vocab_size(args.model)
            specs = client.nano_vllm_requests(args.num_prompts, input_len, args.output_len,
                                              args.workload_seed, vocab)
        else:
            specs = client.chat_requests(args.num_prompts, args.output_len, args.workload_seed)
    except (Refused, ValueError) as exc:  # ValueError: the engine configuration's own
        return usage_error(PROG, exc)
    report = report_head(args, argv, runners)
    if config is not None:
        report["device"] = config.device_config.device
    try:
        with terminate_on_sigterm():
            report["results"] = run_all(args, runners, specs, report)
    except ServerError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; every server it started is stopped", file=sys.stderr)
        return 130
    return reporting.finish(report, args.json, args.png, PROG)


def run_all(args: argparse.Namespace, runners: list[str], specs: list[RequestSpec],
            report: dict) -> list[dict]:
    if args.base_url is not None:
        label = args.label or "server"
        report["served_model"][label], rows = bench_target(args.base_url, label, specs, args)
        return rows
    rows: list[dict] = []
    for runner in runners:
        with managed_server(args.model, runner, report["engine_flags"],
                            args.startup_timeout_s) as (base_url, check_alive):
            name, runner_rows = bench_target(base_url, runner, specs, args, check_alive)
        report["served_model"][runner] = name
        rows += runner_rows
    return rows


def report_head(args: argparse.Namespace, argv: list[str], runners: list[str]) -> dict:
    return {
        "command": " ".join([PROG, *map(shlex.quote, argv)]),
        "model": args.model, "served_model": {},
        "runners": [args.label or "server"] if args.base_url else runners,
        "base_url": args.base_url, "engine_flags": engine_flag_argv(args),
        "git_commit": reporting.git_commit(str(PROJECT_ROOT)),
        "workload": {
            "name": args.workload, "num_prompts": args.num_prompts,
            "input_len": list(args.input_len or NANO_VLLM_LEN)
            if args.workload == "nano-vllm" else None,
            "output_len": list(args.output_len), "seed": args.workload_seed,
            "request_rates": ["inf" if math.isinf(r) else r for r in args.request_rate],
            "max_concurrency": args.max_concurrency, "num_warmups": args.num_warmups,
            "timeout_s": args.timeout_s,
        },
    }


if __name__ == "__main__":
    sys.exit(bench_serve_main(sys.argv[1:]))
