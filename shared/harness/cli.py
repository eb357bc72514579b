"""The `runnerlab` console script: explain | generate | serve | bench serve | ab | diff |
embed | classify.

Engine options are flags named after the EngineArgs fields (--model-runner v1,
--max-model-len 2048, --load-format dummy). Logs go to stderr, results to stdout.
Every flag is honoured or refused: a refusal is one line on stderr naming the flag
(`runnerlab <command>: error: --flag: why`), exit status 2; a file that cannot be read
or written is one line too, exit status 1; neither prints a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from policy.cli_args import OneLineArgumentParser, cpu_noop_refusal, int_list, usage_error

USAGE = """runnerlab <command> [options]

commands:
  explain    which runner the policy picks for a model, and why (no GPU, no weights)
  generate   generate text or token ids with either runner
  serve      an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)
  bench      `bench serve`: TTFT / TPOT / ITL of V1 and V2 servers under Poisson arrivals
  ab         the A/B step-time comparison of V1 and V2 (the main job)
  diff       the differential correctness harness: V1 vs V2 vs Hugging Face
  embed      embeddings of prompts (a pooling engine, pooling_task='embed')
  classify   class probabilities of prompts (a sequence-classification model)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        from importlib.metadata import version

        print(f"runnerlab {version('runnerlab')}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "explain":
        from policy.explain import explain_main

        return explain_main(rest, prog="runnerlab explain")
    if command == "generate":
        return generate_main(rest)
    if command == "serve":
        from shared.harness.serve_cli import serve_main

        return serve_main(rest)
    if command == "bench":
        if rest[:1] != ["serve"]:
            print("runnerlab bench: error: the benchmark is `runnerlab bench serve ...`",
                  file=sys.stderr)
            return 2
        from shared.harness.bench_serve import bench_serve_main

        return bench_serve_main(rest[1:])
    if command == "ab":
        from shared.harness.ab import ab_main

        return ab_main(rest)
    if command == "diff":
        from shared.harness.diff_cli import diff_main

        return diff_main(rest)
    if command in ("embed", "classify"):
        from shared.harness.pool_cli import pool_main

        return pool_main(command, rest)
    print(f"runnerlab: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    # SamplingParams checks every range and names the field; argparse only the types
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None,
                   help="top log-probabilities per generated token (printed with --json)")


GENERATE = "runnerlab generate"


def generate_main(argv: list[str]) -> int:
    from policy.explain import add_engine_args, engine_args_from_namespace

    parser = OneLineArgumentParser(prog=GENERATE, description="Generate with either runner.")
    add_engine_args(parser)
    parser.add_argument("--prompt", action="append", default=None, help="a text prompt (repeatable)")
    parser.add_argument(
        "--prompt-ids", action="append", default=None, type=int_list("token id", 0),
        help="a prompt as comma-separated token ids (repeatable; for models without a tokenizer)",
    )
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    _add_sampling_args(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 0 for --help, 2 for a usage error (one line)
        return int(exc.code or 0)
    refusal = _generate_refusal(args)
    if refusal:
        return usage_error(GENERATE, refusal)

    from shared.contract.sampling_params import SamplingParams, SamplingParamsError
    from shared.serving.engine import EngineInputError
    from shared.serving.llm import LLM

    try:
        engine_args = engine_args_from_namespace(args)
        refusal = cpu_noop_refusal(args, engine_args.device)
        if refusal:
            return usage_error(GENERATE, refusal)
        llm = LLM(**engine_args.model_dump())
        prompts = _collect_prompts(args, llm)
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, min_p=args.min_p, seed=args.sampling_seed,
            ignore_eos=args.ignore_eos, logprobs=args.logprobs,
        )
        outputs = llm.generate(prompts, params)
    except (EngineInputError, SamplingParamsError, ValueError) as exc:
        return usage_error(GENERATE, exc)
    except OSError as exc:  # a model file that cannot be read
        print(f"{GENERATE}: error: {exc}", file=sys.stderr)
        return 1
    for out in outputs:
        c = out.outputs[0]
        if args.json:
            record = {
                "request_id": out.request_id, "runner": llm.runner_name, "text": c.text,
                "prompt_token_ids": out.prompt_token_ids, "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
            }
            if args.logprobs is not None:  # JSON keys are strings: token id -> logprob
                record["logprobs"] = [{str(t): lp.logprob for t, lp in d.items()}
                                      for d in c.logprobs or []]
            print(json.dumps(record))
        else:
            print(c.text if llm.get_tokenizer() is not None else " ".join(map(str, c.token_ids)))
    return 0


def _generate_refusal(args: argparse.Namespace) -> str | None:
    """Flags that would be accepted and then do nothing."""
    if args.chat and not args.prompt:
        return "--chat applies the chat template to --prompt text; --prompt-ids are token ids already"
    if args.logprobs is not None and not args.json:
        return "--logprobs: the log-probabilities are printed only with --json"
    return None


def _collect_prompts(args: argparse.Namespace, llm) -> list:
    from shared.serving.chat import chat_prompt_token_ids

    prompts: list = []
    for text in args.prompt or []:
        if args.chat:
            prompts.append(chat_prompt_token_ids(llm.get_tokenizer(),
                                                 [{"role": "user", "content": text}]))
        else:
            prompts.append(text)
    prompts += args.prompt_ids or []  # lists of ints: parsed and checked by argparse
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-ids")
    return prompts


if __name__ == "__main__":
    sys.exit(main())
