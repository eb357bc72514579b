"""The feature-support table: features x runners. The single source of truth for what
each runner can honour; the selection policy's gates, the error messages and `explain`
all read it, and a test enables each feature on each runner and checks the outcome.

A feature a runner does not support is refused, never silently ignored: vLLM's V1 accepts
`rejection_sample_method="block"` and never reads it (the seed's "silent config no-op"),
which is exactly what this table exists to prevent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from policy import envs, logits_processors

Runner = Literal["v1", "v2"]
Status = Literal["supported", "unsupported-yet"]

SUPPORTED: Status = "supported"
UNSUPPORTED: Status = "unsupported-yet"


@dataclass(frozen=True)
class Feature:
    label: str                         # what error messages and `explain` print
    v1: Status
    v2: Status
    drop: str                          # the setting that turns the feature off
    requested: Callable[[dict[str, Any]], bool]  # reads the flat view of _settings()
    vllm: str = ""                     # how vLLM itself behaves, for the reader

    def status(self, runner: Runner) -> Status:
        return self.v1 if runner == "v1" else self.v2

    @property
    def v2_only(self) -> bool:
        return self.v2 == SUPPORTED and self.v1 != SUPPORTED


LOGITS_PROCESSORS_V1 = "custom logits processors (V1 interface)"
LOGITS_PROCESSORS_V2 = "custom logits processors (V2 interface)"
POOLING_TASK_LABEL = "pooling task "  # + the task: "pooling task token_embed"
_V2_POOLING_REFUSAL = ("V1 only; vLLM's V2 raises at startup ('Model Runner V2 supports pooling "
                       "tasks [...], but this model selects ...', VLLM_USE_V2_MODEL_RUNNER=0)")


def _spec(s: dict[str, Any], name: str, value: str) -> bool:
    spec = s["speculative_config"]
    return spec is not None and _get(spec, name) == value


def _pooling_row(task: str, v2: Status, vllm: str) -> Feature:
    return Feature(f"{POOLING_TASK_LABEL}{task}", SUPPORTED, v2, "pooling_task=None",
                   lambda s: s["pooling_task"] == task, vllm)


FEATURES: tuple[Feature, ...] = (
    # Speculative decoding: one row per method and per rejection rule, so that a runner
    # can honour one method and not the other. The ngram + block pair has no runner (ngram
    # is V1-only, block V2-only): decide_runner refuses it whatever the source.
    Feature(
        "ngram speculative decoding", SUPPORTED, UNSUPPORTED, "speculative_config=None",
        lambda s: _spec(s, "method", "ngram"),
        "V1 only (prompt lookup on the host, NumPy); V2 has no ngram proposer",
    ),
    Feature(
        "draft_model speculative decoding", SUPPORTED, SUPPORTED, "speculative_config=None",
        lambda s: _spec(s, "method", "draft_model"),
        "V1; V2 in progress upstream (here the drafts stay on the device in V2)",
    ),
    Feature(
        "rejection_sample_method='standard'", SUPPORTED, SUPPORTED, "speculative_config=None",
        lambda s: _spec(s, "rejection_sample_method", "standard"),
        "both",
    ),
    Feature(
        "rejection_sample_method='synthetic'", SUPPORTED, SUPPORTED,
        "rejection_sample_method='standard'",
        lambda s: _spec(s, "rejection_sample_method", "synthetic"),
        "both (benchmarking: each draft position accepted at a fixed rate)",
    ),
    Feature(
        "rejection_sample_method='block'", UNSUPPORTED, SUPPORTED,
        "rejection_sample_method='standard'",
        lambda s: _spec(s, "rejection_sample_method", "block"),
        "V2 only; V1 accepts it and silently never reads it",
    ),
    # Custom logits processors: one row per interface (policy/logits_processors.py), since
    # each runner's interface follows its own state protocol and neither can run the other's.
    Feature(
        LOGITS_PROCESSORS_V1, SUPPORTED, UNSUPPORTED, "logits_processors=[]",
        lambda s: "v1" in s["logits_processor_interfaces"],
        "V1 (update_state with BatchUpdate: added / removed / moved); V2 long refused them "
        "and falls back to V1",
    ),
    Feature(
        LOGITS_PROCESSORS_V2, UNSUPPORTED, SUPPORTED, "logits_processors=[]",
        lambda s: "v2" in s["logits_processor_interfaces"],
        "newer V2 only: a slot-keyed interface (add_request / remove_request / apply with "
        "idx_mapping) that V1-style processors cannot use",
    ),
    # Pooling: one row per task (an engine runs one task for all its requests;
    # policy/pooling.py resolves its pooler). vLLM's V2 raises at model load for a task it
    # does not pool; here the table decides it at config time.
    _pooling_row("embed", SUPPORTED, "both runners"),
    _pooling_row("classify", SUPPORTED, "both runners"),
    _pooling_row("score", SUPPORTED, "both runners (built on embed or classify)"),
    _pooling_row("token_embed", UNSUPPORTED, _V2_POOLING_REFUSAL),
    _pooling_row("token_classify", UNSUPPORTED, _V2_POOLING_REFUSAL),
    Feature(
        "prompt embeds", UNSUPPORTED, UNSUPPORTED, "enable_prompt_embeds=False",
        lambda s: bool(s["enable_prompt_embeds"]),
        "V1 only",
    ),
    Feature(
        "cudagraph_mode='PIECEWISE'", SUPPORTED, SUPPORTED, "cudagraph_mode='auto'",
        lambda s: s["cudagraph_mode"] == "PIECEWISE",
        "both runners: graphs between the attention calls, attention eager (here one "
        "implementation, shared/runtime/piecewise_graphs.py; V1 dispatches implicitly, "
        "V2 explicitly)",
    ),
    Feature(
        "cudagraph_mode='FULL_AND_PIECEWISE'", SUPPORTED, SUPPORTED, "cudagraph_mode='auto'",
        lambda s: s["cudagraph_mode"] == "FULL_AND_PIECEWISE",
        "both runners' default on CUDA: FULL graphs for uniform decode, piecewise ones "
        "for the other batches that fit",
    ),
    Feature(
        "async scheduling", SUPPORTED, SUPPORTED, "async_scheduling=False",
        lambda s: bool(s["async_scheduling"]),
        "both runners: V1 scatters the previous step's device tokens into input_ids and "
        "keeps placeholders on the host until they land; V2 reads them on the device",
    ),
    Feature(
        "async scheduling with draft_model speculative decoding", SUPPORTED, SUPPORTED,
        "async_scheduling=False",
        lambda s: bool(s["async_scheduling"]) and _spec(s, "method", "draft_model"),
        "both runners plan a step before the previous one's drafts and accepted counts "
        "reach the host: V2 keeps them on the device; V1 schedules placeholder drafts "
        "and moves each row back by its rejected drafts on the device, as vLLM's V1 "
        "does with its optimistic placeholders and corrections",
    ),
    Feature(
        "async scheduling with ngram speculative decoding", UNSUPPORTED, UNSUPPORTED,
        "async_scheduling=False",
        lambda s: bool(s["async_scheduling"]) and _spec(s, "method", "ngram"),
        "V1's ngram proposer reads the landed tokens in the host token table, so it "
        "cannot run a step ahead of them (vLLM added a GPU ngram for that); V2 has no "
        "ngram proposer",
    ),
    Feature(
        "tensor parallelism > 1", SUPPORTED, SUPPORTED, "tensor_parallel_size=1",
        lambda s: s["tensor_parallel_size"] > 1,
        "both runners, on torch.distributed (shared/distributed); V1's rank 0 samples and "
        "broadcasts the tokens, every V2 rank samples the same tokens itself",
    ),
    Feature(
        "batch-invariant mode", SUPPORTED, SUPPORTED, "batch_invariant=False",
        lambda s: s["batch_invariant"],
        "both runners (VLLM_BATCH_INVARIANT=1)",
    ),
    Feature(
        "pipeline parallelism > 1", UNSUPPORTED, UNSUPPORTED, "pipeline_parallel_size=1",
        lambda s: s["pipeline_parallel_size"] > 1,
        "both runners",
    ),
)


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _settings(obj: Any) -> dict[str, Any]:
    """A flat view of the feature fields of an EngineArgs or an EngineConfig."""
    if hasattr(obj, "compilation_config"):  # EngineConfig: fields live in sub-configs
        mode = obj.compilation_config.cudagraph_mode_requested
        tp = obj.parallel_config.tensor_parallel_size
        pp = obj.parallel_config.pipeline_parallel_size
        async_scheduling = obj.scheduler_config.async_scheduling
        batch_invariant = obj.batch_invariance.enabled
    else:
        mode, tp, pp = obj.cudagraph_mode, obj.tensor_parallel_size, obj.pipeline_parallel_size
        async_scheduling = obj.async_scheduling
        batch_invariant = (obj.batch_invariant or obj.kernel_options.batch_invariant
                           or envs.batch_invariant())
    return {
        "speculative_config": obj.speculative_config,
        "logits_processors": obj.logits_processors,
        "logits_processor_interfaces": logits_processors.interfaces(obj.logits_processors),
        "pooling_task": obj.pooling_task,
        "enable_prompt_embeds": obj.enable_prompt_embeds,
        "cudagraph_mode": mode,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "async_scheduling": async_scheduling,
        "batch_invariant": batch_invariant,
    }


def feature_details(obj: Any) -> dict[str, str]:
    """Per requested feature label, what in the configuration asks for it, where a label
    alone does not say (the processors' names), for the decision's messages."""
    by_interface: dict[str, list] = {"v1": [], "v2": []}
    for spec in logits_processors.resolve_logits_processors(list(obj.logits_processors)):
        by_interface[spec.interface].append(spec.name)
    out = {}
    for label, interface in ((LOGITS_PROCESSORS_V1, "v1"), (LOGITS_PROCESSORS_V2, "v2")):
        if by_interface[interface]:
            out[label] = ", ".join(by_interface[interface])
    return out


def feature(label: str) -> Feature:
    for f in FEATURES:
        if f.label == label:
            return f
    raise KeyError(f"unknown feature {label!r}")


def requested_features(obj: Any) -> list[str]:
    """Labels of the table's features that this EngineArgs / EngineConfig asks for."""
    settings = _settings(obj)
    return [f.label for f in FEATURES if f.requested(settings)]


def unsupported_for(runner: Runner, features: list[str]) -> list[str]:
    """The subset of `features` that `runner` cannot honour, in the order given."""
    return [label for label in features if feature(label).status(runner) != SUPPORTED]


def v2_only(features: list[str]) -> list[str]:
    return [label for label in features if feature(label).v2_only]


def how_to_drop(features: list[str]) -> str:
    """'speculative_config=None, logits_processors=[]' for an error message."""
    drops: list[str] = []
    for label in features:
        if feature(label).drop not in drops:
            drops.append(feature(label).drop)
    return ", ".join(drops)


def table() -> list[dict[str, str]]:
    """The table as rows, for `explain --features` and documentation."""
    return [{"feature": f.label, "v1": f.v1, "v2": f.v2, "drop": f.drop, "vllm": f.vllm}
            for f in FEATURES]
