"""Speculative decoding: what a user asks for (SpeculativeConfig, EngineArgs.speculative_config)
and what the engine gets (SpeculativeSettings, EngineConfig.speculative_config).

SpeculativeConfig checks its own fields when it is built (a pydantic ValidationError, which
is a ValueError, naming the field, the bad value and the accepted values):
- method: "ngram" (prompt lookup: the draft tokens are the ones that followed the latest
  earlier occurrence of the context's last n tokens) or "draft_model" (a smaller model
  proposes them). Anything else, vLLM's "eagle" included, is refused.
- num_speculative_tokens: 1..16, required (as in vLLM when the draft has no default).
- prompt_lookup_min / prompt_lookup_max: ngram only. vLLM's defaults: both unset -> 5 and
  5; one set -> the other takes its value. Both >= 1, min <= max.
- model: draft_model only, and required there: a preset name or a directory / file holding
  a config.json, as EngineArgs.model.
- rejection_sample_method: "standard" (exact rejection sampling), "synthetic" (a draft
  position is accepted at a fixed rate: benchmarking), "block" (block verification).
- synthetic_acceptance_rates: required with "synthetic" (one rate in [0, 1] per draft
  position), refused otherwise (it would be ignored).

resolve_speculative() runs at create_engine_config() time, against the target model: it
loads the draft's ModelConfig the way the target's is loaded and refuses a draft that is
not dense, not implemented, has another vocabulary or a shorter position range than the
engine's max_model_len. Which runner honours which method and rule is the feature table's
business (policy.features); so is the ngram + block contradiction (no runner has both).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policy import presets
from policy.errors import field_error
from policy.model_config import ModelConfig, WeightSource, build_model_config, weight_source

MAX_SPECULATIVE_TOKENS = 16
# vLLM's SpeculativeConfig.__post_init__ sets both to 5 when neither is given.
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeConfig(BaseModel):
    """The user's speculative-decoding request (EngineArgs.speculative_config; JSON on the
    command line: --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}')."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int | None = Field(
        None, validate_default=True,
        description=f"draft tokens proposed per step, 1..{MAX_SPECULATIVE_TOKENS} (required)")
    prompt_lookup_min: int | None = Field(None, description="ngram: shortest n-gram matched")
    prompt_lookup_max: int | None = Field(None, description="ngram: longest n-gram matched")
    model: str | None = Field(None, description="draft_model: preset name or config.json path")
    rejection_sample_method: Literal["standard", "synthetic", "block"] = "standard"
    synthetic_acceptance_rates: list[float] | None = Field(
        None, description="synthetic: the acceptance rate of each draft position")

    @model_validator(mode="before")
    @classmethod
    def _prompt_lookup_defaults(cls, data: Any) -> Any:
        # Filled before validation (the model is frozen), so the resolved values are the
        # fields themselves and show in every dump.
        if not isinstance(data, dict) or data.get("method") != "ngram":
            return data
        low, high = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        return {**data, "prompt_lookup_min": high if low is None else low,
                "prompt_lookup_max": low if high is None else high}

    @field_validator("num_speculative_tokens")
    @classmethod
    def _check_num_tokens(cls, k: int | None) -> int:
        if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise field_error("num_speculative_tokens", k,
                              f"an integer in 1..{MAX_SPECULATIVE_TOKENS}",
                              "required" if k is None else "")
        return k

    @model_validator(mode="after")
    def _check_combination(self) -> SpeculativeConfig:
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft_model()
        self._check_synthetic_rates()
        return self

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise field_error("model", self.model, "None with method='ngram'",
                              "ngram proposes from the context itself; a draft model needs "
                              "method='draft_model'")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if value < 1:
                raise field_error(name, value, "an integer >= 1")
        if low > high:
            raise field_error("prompt_lookup_min", low,
                              f"an integer in 1..prompt_lookup_max={high}")

    def _check_draft_model(self) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise field_error(name, getattr(self, name), "None with method='draft_model'",
                                  "only method='ngram' looks up the prompt; it would be ignored")
        if self.model is None:
            drafts = ", ".join(sorted(presets.DRAFT_PRESETS))
            raise field_error("model", None, "a preset name (drafts: "
                              f"{drafts}) or a directory holding a config.json",
                              "method='draft_model' needs a draft model")

    def _check_synthetic_rates(self) -> None:
        rates, k = self.synthetic_acceptance_rates, self.num_speculative_tokens
        if self.rejection_sample_method != "synthetic":
            if rates is not None:
                raise field_error("synthetic_acceptance_rates", rates,
                                  f"None with rejection_sample_method="
                                  f"{self.rejection_sample_method!r}",
                                  "only 'synthetic' reads them; they would be ignored")
            return
        accepted = (f"a list of num_speculative_tokens={k} rates in [0, 1], one per draft "
                    "position, with rejection_sample_method='synthetic'")
        if rates is None:
            raise field_error("synthetic_acceptance_rates", None, accepted, "required")
        if len(rates) != k:
            raise field_error("synthetic_acceptance_rates", rates, accepted,
                              f"{len(rates)} rates given")
        bad = [r for r in rates if not 0.0 <= r <= 1.0]  # NaN fails too
        if bad:
            raise field_error("synthetic_acceptance_rates", rates, accepted,
                              f"outside [0, 1]: {bad}")


class SpeculativeSettings(SpeculativeConfig):
    """SpeculativeConfig resolved against the target model: EngineConfig.speculative_config.
    For method="draft_model" it carries the draft's ModelConfig (dtype and max_model_len
    those of the target) and where the draft's weights come from; None for ngram."""

    draft_model_config: ModelConfig | None = None
    draft_weight_source: WeightSource | None = None


def resolve_speculative(spec: SpeculativeConfig | None, target: ModelConfig, device: str,
                        load_format: str) -> SpeculativeSettings | None:
    """The engine's speculative settings, or None without speculative decoding. Raises
    ValueError, naming speculative_config.model, for a draft the target cannot use."""
    if spec is None:
        return None
    fields = spec.model_dump()
    if spec.method != "draft_model":
        return SpeculativeSettings(**fields)
    draft = draft_model_config(spec.model, target, device)
    return SpeculativeSettings(**fields, draft_model_config=draft,
                               draft_weight_source=weight_source(draft, load_format))


def draft_model_config(name: str, target: ModelConfig, device: str) -> ModelConfig:
    """The draft's ModelConfig, loaded as the target's is (presets, directories, files),
    in the target's dtype and with the engine's max_model_len once it is known to fit."""
    try:
        draft = build_model_config(name, target.dtype, device, None)
    except ValueError as err:
        raise ValueError(f"speculative_config.model: {err}") from err
    _check_draft_architecture(name, draft)
    if draft.vocab_size != target.vocab_size:
        raise field_error("speculative_config.model", name,
                          f"a draft with the target's vocab_size={target.vocab_size}",
                          f"its vocab_size is {draft.vocab_size}: its token ids would not be "
                          "the target's")
    limit = draft.max_position_embeddings
    if limit is not None and limit < target.max_model_len:
        raise field_error("speculative_config.model", name,
                          f"a draft with max_position_embeddings >= max_model_len="
                          f"{target.max_model_len}, or max_model_len <= {limit}",
                          f"its max_position_embeddings is {limit}: it could not draft past "
                          "that position")
    return draft.model_copy(update={"max_model_len": target.max_model_len})


def _check_draft_architecture(name: str, draft: ModelConfig) -> None:
    kind = ("MoE" if draft.is_moe else "hybrid attention/mamba" if draft.is_hybrid
            else "attention-free" if draft.is_attention_free else "")
    accepted = ("a dense model of an architecture runnerlab implements, e.g. the presets "
                + ", ".join(sorted(presets.DRAFT_PRESETS)))
    if kind:
        raise field_error("speculative_config.model", name, accepted,
                          f"{draft.architecture} is {kind}: only dense drafts are supported")
    if not draft.supported_by_runnerlab:
        raise field_error("speculative_config.model", name, accepted,
                          f"runnerlab implements neither runner for {draft.architecture}")
