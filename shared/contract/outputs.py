"""What the engine returns to users (vLLM's RequestOutput shape)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Speculative decoding counters, per request or summed over an engine.

    A "draft" is one verification of a request's proposals in one step (a step in which
    it was scheduled with at least one draft token). Accepted counts are what the
    rejection sampler accepted, before a stop inside the run truncated the output.
    """

    num_drafts: int = 0  # verifications with >= 1 draft token
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # draft tokens accepted
    # accepted_per_position[i]: verifications that accepted draft position i
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend(
                [0] * (num_draft_tokens - len(self.accepted_per_position)))
        for i in range(num_accepted):  # <= 16 positions
            self.accepted_per_position[i] += 1

    def merge(self, other: SpecDecodeStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.accepted_per_position):
            if i < len(self.accepted_per_position):
                self.accepted_per_position[i] += n
            else:
                self.accepted_per_position.append(n)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: 1 (the target's own token) + accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def acceptance_rate_per_position(self) -> list[float]:
        """Per draft position i: verifications that accepted position i / verifications."""
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_per_position]

    def as_dict(self) -> dict[str, object]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate_per_position": self.acceptance_rate_per_position(),
        }


@dataclass(frozen=True)
class Logprob:
    """One token's entry in a logprobs dict (vLLM's shape): its raw log-probability, its
    rank among the whole vocabulary (1 = most likely) and its text when the model has a
    tokenizer."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the sampled / prompt token and the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]  # cumulative: every token generated so far
    text: str = ""
    # one dict per generated token (the sampled token + the top-k requested)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    # the stop token id, or the stop string, when finish_reason == "stop" (None for EOS)
    stop_reason: int | str | None = None
    # sum of the sampled tokens' logprobs; None unless logprobs were requested (vLLM)
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    # (nothing predicts it), else the prompt token's and the top-k tokens' logprobs
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # None unless the engine runs speculative decoding
    spec_decode_stats: SpecDecodeStats | None = None


def make_position_logprobs(
    token_ids: list[int],
    logprobs: list[float],
    rank: int,
    decode: Callable[[int], str] | None = None,
) -> PositionLogprobs:
    """One position's dict from a runner's row: token_ids[0] is the sampled (or prompt)
    token with `rank`; the rest are the top-k in order, ranks 1, 2, ... A token that is
    both keeps the first entry (its true rank). decode: token id -> text, or None."""
    out: PositionLogprobs = {}
    for i, (token, lp) in enumerate(zip(token_ids, logprobs)):
        if token in out:
            continue
        out[token] = Logprob(float(lp), rank if i == 0 else i,
                             None if decode is None else decode(token))
    return out
