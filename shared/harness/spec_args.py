"""`runnerlab ab --workloads spec`'s flags, default sizes and checks. The rest of ab's
command line is shared/harness/ab_args.py (which calls these); the run itself is
shared/harness/spec_workload.py.

The spec workload measures speculative decoding against the same engine without it: one
engine per (runner, speculative_config of --spec-configs) and one baseline engine per
runner (speculative_config=None), each running --spec-batch requests of --spec-prompt-len
random token ids that decode --spec-max-tokens tokens together.

Checks return the refusal's words (or None) rather than raising: ab_args turns them into
its Refused, and this module stays below it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from policy.cli_args import bounded_int, one_line

SPEC = "spec"
# ab's flags that only the spec workload reads (refused without it)
SPEC_FLAGS = {"spec_configs": "--spec-configs", "spec_batch": "--spec-batch",
              "spec_prompt_len": "--spec-prompt-len", "spec_max_tokens": "--spec-max-tokens",
              "spec_temperature": "--spec-temperature"}
# Every engine of the workload runs the sync loop, the baselines included (a speedup
# compares one loop with itself): it is the one loop both runners run with speculative
# decoding (the scheduler refuses V1 async with it: V1's drafts live on the host).
SPEC_ENGINE_LOOP = "sync"
DEFAULT_NUM_SPECULATIVE_TOKENS = (1, 2, 3, 4)
EXAMPLE = ('[{"method": "ngram", "num_speculative_tokens": 2}, {"method": "draft_model", '
           '"model": "tiny-llama-draft", "num_speculative_tokens": 2}]')


@dataclass(frozen=True)
class SpecSizes:
    prompt_len: int  # tokens per prompt
    max_tokens: int  # output tokens per request


GPU_SPEC_SIZES = SpecSizes(128, 128)
# On the CPU V2 runs under the Triton interpreter (a step of the tiny model ~50 ms):
# a short prompt and few tokens keep (1 + configs) x runners x runs near a minute.
CPU_SPEC_SIZES = SpecSizes(16, 32)
QUICK_SPEC_SIZES = SpecSizes(16, 12)


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("spec workload (--workloads spec; not in the default list)")
    g.add_argument("--spec-configs", type=parse_spec_configs, default=None, metavar="JSON",
                   help="a JSON list of speculative_config objects, one engine per runner "
                   f"each, e.g. '{EXAMPLE}' (default: method draft_model, the model's draft "
                   "preset (tiny-llama: tiny-llama-draft, llama-3-8b: llama-3.2-1b), "
                   "num_speculative_tokens 1..4)")
    g.add_argument("--spec-batch", type=bounded_int(1), default=None,
                   help="requests decoding together (default 1)")
    g.add_argument("--spec-prompt-len", type=bounded_int(1), default=None,
                   help=f"prompt tokens per request (default {CPU_SPEC_SIZES.prompt_len} on "
                   f"the CPU, {GPU_SPEC_SIZES.prompt_len} on a GPU)")
    g.add_argument("--spec-max-tokens", type=bounded_int(1), default=None,
                   help=f"output tokens per request (default {CPU_SPEC_SIZES.max_tokens} on "
                   f"the CPU, {GPU_SPEC_SIZES.max_tokens} on a GPU)")
    g.add_argument("--spec-temperature", type=_temperature, default=None,
                   help="0 (the default): greedy, and every engine's tokens must equal its "
                   "runner's baseline's; > 0: sampled, with a seed per request")


def parse_spec_configs(text: str) -> list[dict[str, Any]]:
    """--spec-configs: a JSON list of speculative_config objects (one object alone is a
    list of one), each checked by policy.SpeculativeConfig; -> their fields as resolved
    (ngram's prompt-lookup defaults filled in)."""
    from policy import SpeculativeConfig

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}); expected a list of "
                                         f"speculative_config objects, e.g. {EXAMPLE}") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        raise argparse.ArgumentTypeError(f"expected a non-empty JSON list of speculative_config "
                                         f"objects, e.g. {EXAMPLE}; got {text!r}")
    configs = []
    for i, raw in enumerate(value):
        try:
            config = SpeculativeConfig.model_validate(raw)
        except ValueError as exc:  # pydantic's ValidationError is one
            raise argparse.ArgumentTypeError(f"config {i} {json.dumps(raw)}: "
                                             f"{one_line(exc)}") from None
        configs.append(config.model_dump(mode="json", exclude_none=True))
    return configs


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not valid; expected a number >= 0 "
                                         "(0: greedy)")
    return value


def default_draft(model: str) -> str | None:
    """The draft preset made for `model` (policy.presets.DRAFT_PRESETS), if any."""
    from policy import presets

    drafts = getattr(presets, "DRAFT_PRESETS", {})
    return next((draft for draft, target in drafts.items() if target == model), None)


def default_spec_configs(model: str) -> list[dict[str, Any]]:
    """draft_model with the model's draft preset, k = 1..4: the one method both runners
    run (ngram is V1's only, block V2's only)."""
    draft = default_draft(model)
    if draft is None:
        raise ValueError(f"--workloads spec: the model {model!r} has no draft preset for the "
                         "default configs; give them with --spec-configs, e.g. "
                         '\'[{"method": "ngram", "num_speculative_tokens": 2}]\'')
    return parse_spec_configs(json.dumps([
        {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
        for k in DEFAULT_NUM_SPECULATIVE_TOKENS]))


def spec_label(config: dict[str, Any], name_draft: bool = False) -> str:
    """A config's name in the table: 'draft_model k=2', 'ngram k=3 n=2..4', 'draft_model
    k=4 synthetic [0.8,0.6,0.4,0.2]'; the draft's name too where the configs use several."""
    words = [config["method"], f"k={config['num_speculative_tokens']}"]
    if config["method"] == "ngram":
        words.append(f"n={config['prompt_lookup_min']}..{config['prompt_lookup_max']}")
    elif name_draft:
        words.append(str(config["model"]))
    rule = config.get("rejection_sample_method", "standard")
    if rule != "standard":
        words.append(rule)
    rates = config.get("synthetic_acceptance_rates")
    if rates:
        words.append("[" + ",".join(f"{r:g}" for r in rates) + "]")
    return " ".join(words)


def unique_labels(configs: list[dict[str, Any]]) -> list[str]:
    """One label per config; a repeated config gets ' #2', ' #3' ..."""
    drafts = {c.get("model") for c in configs if c["method"] == "draft_model"}
    labels: list[str] = []
    for config in configs:
        label = spec_label(config, name_draft=len(drafts) > 1)
        n = sum(1 for seen in labels if seen == label or seen.startswith(label + " #"))
        labels.append(label if n == 0 else f"{label} #{n + 1}")
    return labels


def spec_settings(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """The spec workload's part of ab's settings (ab.json's settings["spec"])."""
    sizes = CPU_SPEC_SIZES if device != "cuda" else GPU_SPEC_SIZES
    if args.quick:  # the GPU keeps its prompt length, as the decode workload does
        sizes = QUICK_SPEC_SIZES if device != "cuda" else dataclasses.replace(
            QUICK_SPEC_SIZES, prompt_len=GPU_SPEC_SIZES.prompt_len)
    configs = args.spec_configs or default_spec_configs(args.model)
    return {
        "configs": configs,
        "labels": unique_labels(configs),
        "default_configs": args.spec_configs is None,
        "batch": args.spec_batch or 1,
        "prompt_len": args.spec_prompt_len or sizes.prompt_len,
        "max_tokens": args.spec_max_tokens or sizes.max_tokens,
        "temperature": args.spec_temperature or 0.0,
        "engine_loop": SPEC_ENGINE_LOOP,
    }


def spec_flag_refusal(args: argparse.Namespace, workloads: list[str]) -> str | None:
    """A spec flag without the spec workload, or the engine flag --speculative-config
    beside it (it would give the baselines speculation too)."""
    if SPEC not in workloads:
        for name, flag in SPEC_FLAGS.items():
            if getattr(args, name, None) is not None:
                return (f"{flag} sets the spec workload, which --workloads "
                        f"{','.join(workloads)} leaves out")
        return None
    if getattr(args, "speculative_config", None) is not None:
        return ("--speculative-config would give every engine of the run, the spec "
                "workload's baselines included, speculative decoding; give the configs to "
                "compare with --spec-configs")
    return None


def spec_loop_refusal(requested: str, workloads: list[str]) -> str | None:
    """The spec workload runs the sync loop only (SPEC_ENGINE_LOOP): refuse an async loop
    asked for by name, and `both` when nothing else would run under async."""
    if SPEC not in workloads:
        return None
    why = ("the spec workload runs only under the sync loop (the one loop both runners run "
           "with speculative decoding, so that V1, V2 and their baselines compare alike)")
    if requested == "async":
        return (f"the async engine loop (--engine-loop async or --async-scheduling): {why}; "
                "use --engine-loop sync or both, or leave it out")
    if requested == "both" and workloads == [SPEC]:
        return f"--engine-loop both: {why} and no other workload was asked for; leave it out"
    return None
