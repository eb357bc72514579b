"""Pooling (vLLM's names): the per-request PoolingParams and what a pooling request
returns. An engine runs one pooling task for all its requests (EngineArgs.pooling_task);
a request's PoolingParams may only restate it and set the post-processing.

Tasks: "embed" (one vector per prompt: the pooled final hidden state), "classify" (a
sequence-classification head on the pooled state), "score" (built on embed or classify),
"token_embed" / "token_classify" (one row per prompt token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
TOKEN_TASKS = ("token_embed", "token_classify")


class PoolingParamsError(ValueError):
    """A pooling parameter is invalid; the message names the field and what is accepted."""


@dataclass(frozen=True)
class PoolingParams:
    task: str | None = None  # None: the engine's pooling_task
    normalize: bool | None = None  # embed tasks: L2-normalise (None: the pooler config's)
    use_activation: bool | None = None  # classify tasks: softmax (None: the config's)

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise PoolingParamsError(
                f"PoolingParams.task={self.task!r} is invalid: expected None or one of "
                f"{', '.join(POOLING_TASKS)}."
            )
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise PoolingParamsError(
                    f"PoolingParams.{name}={value!r} is invalid: expected None or a bool.")


@dataclass
class PoolingOutput:
    # embed: [hidden]; classify: [num_labels]; token tasks: [num_prompt_tokens, ...]
    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    prompt: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ScoringRequestOutput:
    """LLM.score: one score per (a, b) pair."""

    request_id: str
    outputs: PoolingOutput  # data: a 0-d tensor (cosine similarity or class probability)
    finished: bool = True
