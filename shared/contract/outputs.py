"""What the engine returns to users (vLLM's RequestOutput shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]  # cumulative: every token generated so far
    text: str = ""
    # one dict per generated token: token id -> logprob (sampled token + top-k requested)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | None = None  # the stop token id when finish_reason == "stop"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
