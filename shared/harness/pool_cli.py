"""`runnerlab embed` / `runnerlab classify`: pool prompts with either runner.

Engine options are the EngineArgs flags (the task is set by the command: --pooling-task
is refused here); the output is one line per prompt: the vector, or with --json one
object per prompt (request_id, runner, task, prompt_token_ids, data, shape)."""

from __future__ import annotations

import json
import sys

from policy.cli_args import OneLineArgumentParser, int_list, usage_error


def pool_main(task: str, argv: list[str]) -> int:
    from policy.explain import add_engine_args, engine_args_from_namespace

    prog = f"runnerlab {task}"
    parser = OneLineArgumentParser(prog=prog, description=f"Run pooling_task={task!r} on prompts.")
    add_engine_args(parser)
    parser.add_argument("--prompt", action="append", default=None, help="a text prompt (repeatable)")
    parser.add_argument("--prompt-ids", action="append", default=None, type=int_list("token id", 0),
                        help="a prompt as comma-separated token ids (repeatable)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    given = getattr(args, "pooling_task", None)  # engine flags are absent unless given
    if given not in (None, task):
        return usage_error(prog, f"--pooling-task {given}: this command runs {task!r}")
    prompts = list(args.prompt or []) + list(args.prompt_ids or [])
    if not prompts:
        return usage_error(prog, "give at least one --prompt or --prompt-ids")

    from shared.contract.pooling import PoolingParamsError
    from shared.serving.engine import EngineInputError
    from shared.serving.llm import LLM

    try:
        engine_args = engine_args_from_namespace(args, pooling_task=task)
        llm = LLM(**engine_args.model_dump())
        outputs = llm.encode(prompts, pooling_task=task)
    except (EngineInputError, PoolingParamsError, ValueError) as exc:
        return usage_error(prog, exc)
    except OSError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    for out in outputs:
        data = out.outputs.data
        if args.json:
            print(json.dumps({"request_id": out.request_id, "runner": llm.runner_name,
                              "task": task, "prompt_token_ids": out.prompt_token_ids,
                              "shape": list(data.shape), "data": data.tolist()}))
        else:
            print(" ".join(f"{v:.6g}" for v in data.flatten().tolist()))
    return 0
