"""Pooling: what a user asks for (PoolerConfig, EngineArgs.pooler_config) and what the
engine gets (PoolerSettings, EngineConfig.pooler_config).

As in vLLM, an engine runs one pooling task for all its requests (EngineArgs.pooling_task);
here every choice vLLM makes when the model is built (which pooler, which defaults, whether
the runner can pool that task at all) is made at config time, before any weight is loaded.

Defaults per task (vLLM's):
- embed: the last token's hidden state, L2-normalised; token_embed: every token's, normalised;
- classify: the sequence-classification head on the last token, softmax; token_classify:
  the token-classification head on every token, softmax;
- score: on a model with a sequence-classification head, as classify (a cross-encoder:
  the class probability); otherwise as embed (a bi-encoder: cosine similarity).

The head comes from the architecture's name (transformers' naming): *ForSequenceClassification,
*ForTokenClassification, anything else has only hidden states. The embedding tasks run on
any model (on a classifier they pool the base model's hidden states); a classification task
needs its head. Which runner can pool which task is the feature table's business
(policy.features: one row per task).

policy imports nothing of shared, so the task names are restated here; a test checks them
against shared.contract.pooling.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, computed_field

from policy.errors import field_error

PoolingTask = Literal["embed", "classify", "score", "token_embed", "token_classify"]
POOLING_TASKS: tuple[str, ...] = typing.get_args(PoolingTask)
TOKEN_TASKS = ("token_embed", "token_classify")
Head = Literal["hidden", "sequence_classifier", "token_classifier"]

# The head each classification task applies, and the architecture suffix that carries it.
_HEAD_OF_TASK: dict[str, Head] = {"classify": "sequence_classifier",
                                  "token_classify": "token_classifier"}
_SUFFIX: dict[Head, str] = {"sequence_classifier": "ForSequenceClassification",
                            "token_classifier": "ForTokenClassification"}
_HEAD_WORDS: dict[Head, str] = {
    "hidden": "no classification head (hidden states only)",
    "sequence_classifier": "a sequence-classification head",
    "token_classifier": "a token-classification head",
}


class PoolerConfig(BaseModel):
    """The user's pooler overrides (EngineArgs.pooler_config; JSON on the command line:
    --pooler-config '{"pooling_type": "MEAN", "normalize": false}'). None: the task's default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # CLS: the first token. For embed / classify / score only: the token tasks use every token.
    pooling_type: Literal["LAST", "MEAN", "CLS"] | None = None
    normalize: bool | None = None        # embedding tasks: L2-normalise the pooled vector
    use_activation: bool | None = None   # classification tasks: softmax over the labels


class PoolerSettings(BaseModel):
    """The resolved pooler. normalize / use_activation are None where the task has no such
    step (a classification task never normalises, an embedding task has no activation), so
    a request's PoolingParams can be checked against what applies."""

    model_config = ConfigDict(frozen=True)

    task: PoolingTask
    pooling_type: Literal["LAST", "MEAN", "CLS", "ALL"]  # ALL: one row per prompt token
    normalize: bool | None
    use_activation: bool | None
    head: Head                         # the model's head, from its architecture
    num_labels: int | None             # the classifier head's output size; None for hidden

    @computed_field  # type: ignore[prop-decorator]
    @property
    def applies_head(self) -> bool:
        """True: the output is the classifier head's (classify, token_classify, score on a
        sequence classifier); False: the pooled hidden states."""
        return self.task in _HEAD_OF_TASK or (self.task == "score"
                                              and self.head == "sequence_classifier")


def model_head(architecture: str) -> Head:
    """The head an architecture carries, by transformers' naming."""
    for head, suffix in _SUFFIX.items():
        if architecture.endswith(suffix):
            return head
    return "hidden"


def resolve_pooler(task: str | None, pooler_config: PoolerConfig | None,
                   model: Any) -> PoolerSettings | None:
    """The pooler for `task` on `model` (a ModelConfig, or anything with `architecture` and
    `hf_config`); None without a task. Raises ValueError naming the field at fault."""
    if task is None:
        if pooler_config is not None:
            raise field_error("pooler_config", pooler_config.model_dump(exclude_none=True),
                              "None, or set pooling_task",
                              "pooler_config configures the pooler of a pooling_task, and "
                              "pooling_task=None")
        return None
    if task not in POOLING_TASKS:
        raise field_error("pooling_task", task, f"None or one of {', '.join(POOLING_TASKS)}")
    user = pooler_config or PoolerConfig()
    head = model_head(model.architecture)
    _check_head(task, head, model.architecture)
    # score is classify on a sequence classifier (a cross-encoder), embed anywhere else
    kind = task if task != "score" else ("classify" if head == "sequence_classifier" else "embed")
    classifies = kind in ("classify", "token_classify")
    _check_overrides(task, user, classifies)
    if task in TOKEN_TASKS:
        pooling_type = "ALL"
    else:
        # transformers' *ForSequenceClassification pools at the last token; MEAN or CLS on
        # such a model departs from how its head was trained (allowed, as in vLLM).
        pooling_type = user.pooling_type or model_pooling_type(model) or "LAST"
    return PoolerSettings(
        task=task, pooling_type=pooling_type,
        normalize=None if classifies else _default(user.normalize),
        use_activation=_default(user.use_activation) if classifies else None,
        head=head, num_labels=_num_labels(model, head),
    )


# sentence-transformers' pooling modes (1_Pooling/config.json) -> ours
_ST_MODES = (("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
             ("pooling_mode_cls_token", "CLS"))


def model_pooling_type(model: Any) -> str | None:
    """The pooling the checkpoint declares: a sentence-transformers model directory's
    1_Pooling/config.json (the one mode set among last-token, mean and CLS); None when it
    declares none (then the task's default applies). pooler_config overrides it."""
    import json
    import os

    model_dir = getattr(model, "model_dir", None)
    path = os.path.join(model_dir, "1_Pooling", "config.json") if model_dir else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        modes = json.load(f)
    found = [ours for key, ours in _ST_MODES if modes.get(key)]
    if len(found) != 1:
        raise ValueError(
            f"{path} sets the pooling modes {found or 'none of last-token, mean, CLS'}; "
            "runnerlab needs exactly one of them: set pooler_config={'pooling_type': ...}")
    return found[0]


def _default(value: bool | None) -> bool:
    return True if value is None else value


def _check_head(task: str, head: Head, architecture: str) -> None:
    needed = _HEAD_OF_TASK.get(task)
    if needed is None or needed == head:
        return
    accepted = [t for t in POOLING_TASKS if t not in _HEAD_OF_TASK or _HEAD_OF_TASK[t] == head]
    raise field_error(
        "pooling_task", task,
        f"{', '.join(repr(t) for t in accepted)} for {architecture}, or a *{_SUFFIX[needed]} "
        f"model for {task!r}",
        f"{architecture} has {_HEAD_WORDS[head]}; {task!r} needs {_HEAD_WORDS[needed]}")


def _check_overrides(task: str, user: PoolerConfig, classifies: bool) -> None:
    """A pooler setting the task has no use for is refused, never ignored."""
    if task in TOKEN_TASKS and user.pooling_type is not None:
        raise field_error("pooler_config.pooling_type", user.pooling_type,
                          f"None with pooling_task={task!r}",
                          "a token task returns a row for every prompt token")
    if classifies and user.normalize is not None:
        raise field_error("pooler_config.normalize", user.normalize,
                          f"None with pooling_task={task!r} on this model",
                          "a classification output is not normalised; use_activation sets "
                          "its softmax")
    if not classifies and user.use_activation is not None:
        raise field_error("pooler_config.use_activation", user.use_activation,
                          f"None with pooling_task={task!r} on this model",
                          "an embedding has no activation; normalize sets its L2 norm")


def _num_labels(model: Any, head: Head) -> int | None:
    if head == "hidden":
        return None
    value = getattr(getattr(model, "hf_config", None), "num_labels", None)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"model={getattr(model, 'model', model.architecture)!r}: the "
                         f"{model.architecture} config gives no num_labels (got {value!r}); "
                         "its classifier head's size must be known")
    return value


def refuse_with_pooling(task: str | None, *, speculative_config: Any,
                        logits_processors: list[str], async_scheduling: bool) -> None:
    """Pooling runs prefill only: nothing to speculate on, no logits to process, no step to
    plan ahead of a token. The fields that would be ignored are refused by name."""
    if task is None:
        return
    clashes = []
    if speculative_config is not None:
        clashes.append("speculative_config=None")
    if logits_processors:
        clashes.append("logits_processors=[]")
    if async_scheduling:
        clashes.append("async_scheduling=False")
    if clashes:
        raise ValueError(
            f"pooling_task={task!r} runs prefill only and samples no token (nothing to "
            "speculate on, no logits to process, no next step to schedule ahead of a token); "
            f"set {', '.join(clashes)}, or pooling_task=None")
