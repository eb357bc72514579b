"""The `runnerlab` console script: explain | generate | ab | diff.

Engine options are flags named after the EngineArgs fields (--model-runner v1,
--max-model-len 2048, --load-format dummy). Logs go to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

USAGE = """runnerlab <command> [options]

commands:
  explain    which runner the policy picks for a model, and why (no GPU, no weights)
  generate   generate text or token ids with either runner
  ab         the A/B step-time comparison of V1 and V2 (the main job)
  diff       the differential correctness harness: V1 vs V2 vs Hugging Face
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "explain":
        from policy.explain import explain_main

        return explain_main(rest)
    if command == "generate":
        return generate_main(rest)
    if command == "ab":
        from shared.bench.ab import ab_main

        return ab_main(rest)
    if command == "diff":
        from shared.bench.diff import diff_main

        return diff_main(rest)
    print(f"runnerlab: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)


def generate_main(argv: list[str]) -> int:
    from policy.explain import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser(prog="runnerlab generate", description="Generate with either runner.")
    add_engine_args(parser)
    parser.add_argument("--prompt", action="append", default=None, help="a text prompt (repeatable)")
    parser.add_argument(
        "--prompt-ids", action="append", default=None,
        help="a prompt as comma-separated token ids (repeatable; for models without a tokenizer)",
    )
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    _add_sampling_args(parser)
    args = parser.parse_args(argv)

    from shared.engine import EngineInputError
    from shared.llm import LLM
    from shared.sampling_params import SamplingParams, SamplingParamsError

    try:
        engine_args = engine_args_from_namespace(args)
        llm = LLM(**engine_args.model_dump())
        prompts = _collect_prompts(args, llm)
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, min_p=args.min_p, seed=args.sampling_seed,
            ignore_eos=args.ignore_eos, logprobs=args.logprobs,
        )
        outputs = llm.generate(prompts, params)
    except (EngineInputError, SamplingParamsError, ValueError) as exc:
        print(f"runnerlab generate: error: {exc}", file=sys.stderr)
        return 2
    for out in outputs:
        c = out.outputs[0]
        if args.json:
            print(json.dumps({
                "request_id": out.request_id, "runner": llm.runner_name, "text": c.text,
                "prompt_token_ids": out.prompt_token_ids, "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
            }))
        else:
            print(c.text if llm.get_tokenizer() is not None else " ".join(map(str, c.token_ids)))
    return 0


def chat_prompt_token_ids(tokenizer, text: str) -> list[int]:
    """One user turn through the model's chat template, as token ids.

    Tokenized by the template itself: the template already writes any BOS it wants, and
    encoding its text again would add a second one with a tokenizer that adds BOS. The
    return type moved across transformers releases (a list of ids; in 5.x a dict-like
    BatchEncoding by default), so every form is accepted.
    """
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
    )
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):  # a batch of one
        out = out[0]
    return [int(t) for t in out]


def _collect_prompts(args: argparse.Namespace, llm) -> list:
    prompts: list = []
    for text in args.prompt or []:
        if args.chat:
            tok = llm.get_tokenizer()
            if tok is None:
                raise ValueError("--chat needs a model with a tokenizer and chat template")
            prompts.append(chat_prompt_token_ids(tok, text))
        else:
            prompts.append(text)
    for ids in args.prompt_ids or []:
        prompts.append([int(t) for t in ids.split(",") if t.strip()])
    if not prompts:
        raise ValueError("give at least one --prompt or --prompt-ids")
    return prompts


if __name__ == "__main__":
    sys.exit(main())
