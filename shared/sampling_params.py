"""SamplingParams with vLLM's meaning, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

# top_k values that mean "no top-k" (vLLM accepts both).
_NO_TOP_K = (0, -1)


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs besides the sampled token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k in _NO_TOP_K:
            self.top_k = 0
        self._validate()

    def _fail(self, name: str, value: object, accepted: str) -> None:
        raise SamplingParamsError(
            f"SamplingParams.{name}={value!r} is invalid: expected {accepted}."
        )

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            self._fail("max_tokens", self.max_tokens, "an integer >= 1")
        if not self.temperature >= 0.0:  # also rejects NaN
            self._fail("temperature", self.temperature, "a float >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            self._fail("top_k", self.top_k, "an integer >= 1, or 0 / -1 to disable")
        if not 0.0 < self.top_p <= 1.0:
            self._fail("top_p", self.top_p, "a float in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            self._fail("min_p", self.min_p, "a float in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            self._fail("seed", self.seed, "None or an integer in [0, 2**63)")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            self._fail("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            self._fail("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            self._fail("logprobs", self.logprobs, "None or an integer >= 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            self._fail("presence_penalty", self.presence_penalty, "a float in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            self._fail("frequency_penalty", self.frequency_penalty, "a float in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            self._fail("repetition_penalty", self.repetition_penalty, "a float > 0 (1 = off)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
