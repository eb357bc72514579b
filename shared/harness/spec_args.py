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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from policy import features
from policy.cli_args import bounded_int, one_line

SPEC = "spec"
# ab's flags that only the spec workload reads (refused without it)
SPEC_FLAGS = {"spec_configs": "--spec-configs", "spec_batch": "--spec-batch",
              "spec_prompt_len": "--spec-prompt-len", "spec_max_tokens": "--spec-max-tokens",
              "spec_temperature": "--spec-temperature"}
# Every engine of the workload runs one loop, the baselines included (a speedup compares
# a loop with itself): async where every runner measured has it with the speculative
# methods of the run (these policy.features rows), else sync.
ASYNC_FEATURE = "async scheduling"
ASYNC_SPEC_FEATURE = "async scheduling with {} speculative decoding"  # .format(method)


def async_features(methods: Sequence[str]) -> tuple[str, ...]:
    """The feature rows a runner needs to run the spec workload's configs async."""
    return (ASYNC_FEATURE, *(ASYNC_SPEC_FEATURE.format(m) for m in sorted(set(methods))))
DEFAULT_NUM_SPECULATIVE_TOKENS = (1, 2, 3, 4)
EXAMPLE = ('[{"method": "ngram", "num_speculative_tokens": 2}, {"method": "draft_model", '
           '"model": "tiny-llama-draft", "num_speculative_tokens": 2}]')
# A config's own KernelOptions changes (over --kernel-options), e.g. one run comparing the
# draft's FULL graphs with its piecewise ones: not a speculative_config field, taken off
# before the config is checked and given to that config's engines only.
KERNEL_OPTIONS_KEY = "kernel_options"


@dataclass(frozen=True)
class SpecSizes:
    prompt_len: int  # tokens per prompt
    max_tokens: int  # output tokens per request


GPU_SPEC_SIZES = SpecSizes(128, 128)
# On the CPU V2 runs under the Triton interpreter (a step of the tiny model costs tens
# of milliseconds): a short prompt and few tokens keep (1 + configs) x runners x runs
# to about a minute.
CPU_SPEC_SIZES = SpecSizes(16, 32)
QUICK_SPEC_SIZES = SpecSizes(16, 12)


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("spec workload (--workloads spec; not in the default list)")
    g.add_argument("--spec-configs", type=parse_spec_configs, default=None, metavar="JSON",
                   help="a JSON list of speculative_config objects, one engine per runner "
                   f"each, e.g. '{EXAMPLE}' (default: method draft_model, the model's draft "
                   "preset (tiny-llama: tiny-llama-draft, llama-3-8b: llama-3.2-1b), "
                   "num_speculative_tokens 1..4); an object may carry "
                   f'"{KERNEL_OPTIONS_KEY}": {{...}}, KernelOptions changes for its engines '
                   'only, e.g. {"draft_full_graphs": false} or {"gemv_max_tokens": 4}')
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
        fields = {k: v for k, v in raw.items() if k != KERNEL_OPTIONS_KEY}
        try:
            config = SpeculativeConfig.model_validate(fields)
            options = _kernel_options(raw.get(KERNEL_OPTIONS_KEY))
        except ValueError as exc:  # pydantic's ValidationError is one
            raise argparse.ArgumentTypeError(f"config {i} {json.dumps(raw)}: "
                                             f"{one_line(exc)}") from None
        resolved = config.model_dump(mode="json", exclude_none=True)
        if options:
            resolved[KERNEL_OPTIONS_KEY] = options
        configs.append(resolved)
    return configs


def _kernel_options(changes: Any) -> dict[str, Any]:
    """A config's KernelOptions changes, checked by KernelOptions (-> the given fields,
    as validated)."""
    from policy.kernel_options import KernelOptions

    if changes is None:
        return {}
    if not isinstance(changes, dict):
        raise ValueError(f"{KERNEL_OPTIONS_KEY} must be a JSON object of KernelOptions fields, "
                         f"got {json.dumps(changes)}")
    options = KernelOptions.model_validate(changes)
    return options.model_dump(mode="json", include=set(changes))


def split_kernel_options(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A resolved config -> (its speculative_config fields, its KernelOptions changes)."""
    fields = {k: v for k, v in config.items() if k != KERNEL_OPTIONS_KEY}
    return fields, dict(config.get(KERNEL_OPTIONS_KEY) or {})


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
    k=4 synthetic [0.8,0.6,0.4,0.2]', 'draft_model k=3 {gemv_max_tokens=4}' (its own
    kernel options); the draft's name too where the configs use several."""
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
    options = config.get(KERNEL_OPTIONS_KEY)
    if options:
        words.append("{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(options.items()))
                     + "}")
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


def spec_settings(args: argparse.Namespace, device: str, loop: SpecLoop) -> dict[str, Any]:
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
        "engine_loop": loop.loop,
        "engine_loop_note": loop.note,
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


@dataclass(frozen=True)
class SpecLoop:
    """The spec workload's one engine loop; or the refusal of the loop asked for."""

    loop: str | None  # "sync" | "async"; None when refused
    note: str | None = None  # why it is not the loop the run's other engines run
    refusal: str | None = None


def spec_engine_loop(requested: str | None, runners: list[str], alone: bool,
                     methods: Sequence[str] = ("draft_model",)) -> SpecLoop:
    """The loop of the spec workload's engines from the loop asked for (None: the
    default) and what each runner can run with the configs' speculative methods.
    `alone`: no other workload runs (the run's loop is then this one)."""
    blocked = {r: next((f for f in async_features(methods)
                        if features.feature(f).status(r) != features.SUPPORTED), None)
               for r in runners}
    unable = [r for r in runners if blocked[r]]
    why = "" if not unable else (
        f"{' and '.join(r.upper() for r in unable)} cannot run async scheduling with "
        f"speculative decoding (policy.features '{blocked[unable[0]]}': "
        f"{features.feature(blocked[unable[0]]).status(unable[0])})")
    if requested == "async" and unable:
        able = [r for r in runners if r not in unable]
        return SpecLoop(None, refusal=(
            f"the async engine loop (--engine-loop async or --async-scheduling): {why}, and "
            "the spec workload runs every runner under one loop; use --engine-loop sync"
            + (f", or --runners {','.join(able)}" if able else "")))
    if requested == "both":
        if alone:
            return SpecLoop(None, refusal=(
                "--engine-loop both: the spec workload runs one loop (its engines are built "
                "config by config); give --engine-loop sync or async, or leave it out"))
        return SpecLoop("sync", note="the spec workload ran its engines once, under the sync "
                                     "loop (--engine-loop both runs the others under each)")
    if requested is None and unable:
        return SpecLoop("sync", note=f"the spec workload's engines, baselines included, ran "
                                     f"the sync loop: {why}")
    return SpecLoop(requested or "async")
