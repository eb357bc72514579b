"""Which model runner runs this configuration, and why.

decide_runner() is a pure function of (explicit argument, env tri-state, model traits,
requested features, Triton availability, device). The order, first match wins:

1. the explicit `model_runner` argument ("v1" / "v2")              -> source "argument"
2. RUNNERLAB_USE_V2_MODEL_RUNNER (1/true, 0/false)                  -> source "env"
3. forced-on rules: a requested feature only V2 supports            -> source "forced"
4. model eligibility: attention-free -> V1; hybrid not on the allow-list -> V1;
   MoE not on DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES -> V1; dense -> V2  -> source "policy"
5. the Triton gate: V2 needs Triton (importable; on a machine without a GPU its kernels run
   under the Triton interpreter, so V2 works everywhere Triton is installed)
6. the unsupported-feature gate (the table in policy.features)

Before the gates, features that split the runners (some only V1 has, others only V2 has,
e.g. ngram speculative decoding with rejection_sample_method='block') are an error whatever
the source: no runner can honour them, and switching runners cannot help.

Where vLLM falls back silently, runnerlab is loud: a policy fallback is a warning naming
every feature and the setting that drops it; a runner forced by the argument, the env var
or a forcing rule that cannot honour the configuration is an error at config time; a
feature neither runner supports is an error whatever the source.
"""

from __future__ import annotations

import functools
from importlib.util import find_spec
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from policy import features as feature_table
from policy.envs import RUNNERLAB_USE_V2_MODEL_RUNNER

# MoE architectures opted into V2 (as in vLLM, the list exists to opt MoE models in; every
# dense model is eligible without an entry). Mixtral is deliberately absent: it is the
# project's example of a MoE model that stays on V1.
DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES = frozenset({
    "Qwen2MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "GraniteMoeForCausalLM",
})

RUNNER_CLASSES = {
    "v1": "runner_v1.model_runner:GPUModelRunner",
    "v2": "runner_v2.model_runner:GPUModelRunner",
}
_ALLOW_LIST = "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES"


class RunnerSelectionError(ValueError):
    """A forced runner cannot honour the configuration, or no runner can."""


class RunnerDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    runner: Literal["v1", "v2"]
    source: Literal["env", "argument", "forced", "policy"]
    reasons: list[str]                 # reasons[0] is the headline of the log line
    unsupported_v2: list[str]          # requested features V2 cannot honour
    unsupported_v1: list[str] = []     # requested features V1 cannot honour
    requested_features: list[str] = []
    warnings: list[str] = []
    error: str | None = None           # set only by decide_runner(strict=False), for explain
    runner_class: str

    @property
    def use_v2_model_runner(self) -> bool:
        return self.runner == "v2"

    def log_line(self) -> str:
        return (f"Model runner: {self.runner.upper()} ({self.runner_class}) — "
                f"{self.source}: {self.reasons[0]}")


def triton_available() -> bool:
    """Importable without importing it (importing triton is slow and may pick a backend)."""
    return find_spec("triton") is not None


def model_eligibility(model: Any) -> tuple[Literal["v1", "v2"], str]:
    """Rule 4: which runner the model's traits call for, and the reason in words."""
    arch = model.architecture
    listed = any(a in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES for a in model.architectures or [arch])
    if model.is_attention_free:
        return "v1", f"attention-free model {arch} ({model.model_type}) stays on V1"
    if model.is_hybrid and not listed:
        return "v1", f"hybrid attention/mamba architecture {arch} is not on {_ALLOW_LIST}"
    if model.is_hybrid:
        return "v2", f"hybrid architecture {arch} is on {_ALLOW_LIST}"
    if model.is_moe and not listed:
        names = ", ".join(sorted(DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES))
        return "v1", f"MoE architecture {arch} is not on {_ALLOW_LIST} ({names})"
    if model.is_moe:
        return "v2", f"MoE architecture {arch} is on {_ALLOW_LIST}"
    return "v2", f"dense architecture {arch} is eligible"


def _other(runner: str) -> Literal["v1", "v2"]:
    return "v1" if runner == "v2" else "v2"


def _force_hint(runner: str) -> str:
    flag = "1" if runner == "v2" else "0"
    return f"model_runner={runner!r} or {RUNNERLAB_USE_V2_MODEL_RUNNER}={flag}"


def _source_words(source: str, runner: str, env_use_v2: bool | None) -> str:
    if source == "argument":
        return f"the argument model_runner={runner!r}"
    if source == "env":
        return f"{RUNNERLAB_USE_V2_MODEL_RUNNER}={'1' if env_use_v2 else '0'}"
    return "a forcing rule" if source == "forced" else "the policy"


def decide_runner(
    model: Any,
    requested: list[str],
    *,
    model_runner: str = "auto",
    env_use_v2: bool | None = None,
    device: str = "cpu",
    strict: bool = True,
    details: dict[str, str] | None = None,
) -> RunnerDecision:
    """Decide the runner. `model` is a ModelConfig (or anything with its trait attributes).

    strict=True raises RunnerSelectionError where the configuration cannot run; strict=False
    (explain) records the message in `decision.error` instead. details: label -> what asks
    for that feature (e.g. the processors' names), printed after the label in messages."""
    named = functools.partial(_named, details=details or {})
    unsupported = {r: feature_table.unsupported_for(r, requested) for r in ("v1", "v2")}
    eligible, eligibility_reason = model_eligibility(model)
    reasons: list[str] = []
    warnings: list[str] = []

    if model_runner in ("v1", "v2"):
        runner, source = model_runner, "argument"
        reasons.append(f"model_runner={model_runner!r}")
    elif env_use_v2 is not None:
        runner, source = ("v2" if env_use_v2 else "v1"), "env"
        reasons.append(f"{RUNNERLAB_USE_V2_MODEL_RUNNER}={'1' if env_use_v2 else '0'}")
    elif feature_table.v2_only(requested):
        runner, source = "v2", "forced"
        reasons.append(f"{named(feature_table.v2_only(requested))} is supported only by V2")
    else:
        runner, source = eligible, "policy"
    if source == "argument" and env_use_v2 is not None:
        reasons.append(f"{RUNNERLAB_USE_V2_MODEL_RUNNER}={'1' if env_use_v2 else '0'} "
                       "is overridden by the argument")
    if source == "policy":
        reasons.append(eligibility_reason)
    else:
        reasons.append(f"without it the policy would choose {eligible.upper()}: {eligibility_reason}")
    if not model.supported_by_runnerlab:
        reasons.append(f"runnerlab implements neither runner for {model.architecture}")

    error = _split_error(requested, named)
    if error is None and runner == "v2":
        runner, error = _triton_gate(runner, source, device, env_use_v2, reasons, warnings)

    blocked = unsupported[runner]
    if error is None and blocked:
        fallback_ok = source == "policy" and runner == "v2" and not unsupported["v1"]
        if fallback_ok:
            drop = feature_table.how_to_drop(blocked)
            message = (f"V2 does not yet support {named(blocked)}; using V1 "
                       f"(set {drop} to use V2)")
            warnings.append(f"Model runner {message}")
            reasons.insert(0, message)
            runner = "v1"
        else:
            error = _feature_error(runner, source, env_use_v2, blocked, unsupported, named)
    if error is not None and strict:
        raise RunnerSelectionError(error)
    return RunnerDecision(
        runner=runner, source=source, reasons=reasons, unsupported_v2=unsupported["v2"],
        unsupported_v1=unsupported["v1"], requested_features=list(requested),
        warnings=warnings, error=error, runner_class=RUNNER_CLASSES[runner],
    )


def _triton_gate(runner: str, source: str, device: str, env_use_v2: bool | None,
                 reasons: list[str], warnings: list[str]) -> tuple[Literal["v1", "v2"], str | None]:
    """Rule 5. Returns the runner after the gate and an error message (forced V2, no Triton)."""
    if triton_available():
        where = "on the GPU" if device == "cuda" else "under the Triton interpreter (no CUDA GPU)"
        reasons.append(f"Triton is importable: V2's kernels run {where}")
        return "v2", None
    if source == "policy":
        message = "V2 requires Triton, which is not importable; using V1 (pip install triton)"
        warnings.append(f"Model runner {message}")
        reasons.insert(0, message)
        return "v1", None
    return "v2", (f"Model runner V2 was chosen by {_source_words(source, 'v2', env_use_v2)} "
                  f"but requires Triton, which is not importable: pip install triton, or "
                  f"choose V1 with {_force_hint('v1')}")


def _named(labels: list[str], details: dict[str, str]) -> str:
    return ", ".join(f"{label} [{details[label]}]" if label in details else label
                     for label in labels)


def _split_error(requested: list[str], named) -> str | None:
    """Requested features that only V1 has together with ones that only V2 has."""
    def only_by(runner: str) -> list[str]:
        return [f for f in requested if _supports(runner, f) and not _supports(_other(runner), f)]

    only = {r: only_by(r) for r in ("v1", "v2")}
    if not (only["v1"] and only["v2"]):
        return None
    v1_only, v2_only = named(only["v1"]), named(only["v2"])
    return (f"No model runner supports {v1_only} together with {v2_only}: {v1_only} is "
            f"supported only by V1, {v2_only} only by V2; drop one side: set "
            f"{feature_table.how_to_drop(only['v1'])} or {feature_table.how_to_drop(only['v2'])}.")


def _supports(runner: str, label: str) -> bool:
    return feature_table.feature(label).status(runner) == feature_table.SUPPORTED


def _switch_hint(runner: str, source: str) -> str:
    # The argument beats the env var, so after an argument only another argument helps.
    return f"model_runner={runner!r}" if source == "argument" else _force_hint(runner)


def _feature_error(runner: str, source: str, env_use_v2: bool | None, blocked: list[str],
                   unsupported: dict[str, list[str]], named) -> str:
    other = _other(runner)
    if source == "policy" and all(f in unsupported[other] for f in blocked):
        return (f"No model runner supports {named(blocked)} yet; "
                f"set {feature_table.how_to_drop(blocked)}.")
    head = (f"Model runner {runner.upper()} (chosen by {_source_words(source, runner, env_use_v2)}) "
            f"does not support: {named(blocked)}.")
    if not unsupported[other]:
        return (f"{head} {other.upper()} supports them: use {_switch_hint(other, source)}, "
                f"or set {feature_table.how_to_drop(blocked)}.")
    # (_split_error has refused the case where the other runner lacks only features this
    # one has, so some blocked feature is missing from both)
    neither = [f for f in blocked if f in unsupported[other]]
    return (f"{head} No runner supports {named(neither)} yet; "
            f"set {feature_table.how_to_drop(neither)}.")
