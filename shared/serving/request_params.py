"""Admission checks of the SamplingParams fields that depend on the model (vocabulary,
tokenizer) or on the runners' table sizes, and the tokenisation of text bad words.

Both runners accept exactly the same requests: V2 keeps the built-ins in fixed-width
per-slot tables (runner_v2/sample/), so the limits are checked here, once, for both, and
a request over them fails alone at add_request instead of failing a step.
Each function raises ValueError with a message naming the field and the fix; the engine
prefixes the request id and raises EngineInputError.
"""

from __future__ import annotations

from typing import Any

from shared.contract.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_TOTAL_TOKENS,
    MAX_LOGIT_BIAS_TOKENS,
    SamplingParams,
)


def _outside(ids, vocab_size: int) -> list[int]:
    return sorted({t for t in ids if t >= vocab_size})


def check_vocabulary_fields(params: SamplingParams, vocab_size: int) -> None:
    """Token ids inside the vocabulary, table sizes within the runners' limits."""
    bias = params.logit_bias or {}
    checks = (
        ("logit_bias", list(bias), len(bias), MAX_LOGIT_BIAS_TOKENS, "entries"),
        ("allowed_token_ids", params.allowed_token_ids or [],
         len(params.allowed_token_ids or []), MAX_ALLOWED_TOKEN_IDS, "ids"),
    )
    for name, ids, count, limit, what in checks:
        bad = _outside(ids, vocab_size)
        if bad:
            raise ValueError(f"SamplingParams.{name} has token ids {bad[:8]} outside the "
                             f"vocabulary [0, {vocab_size})")
        if count > limit:
            raise ValueError(f"SamplingParams.{name} has {count} {what}; at most {limit} are "
                             "supported: pass fewer")
    words = params.bad_words_token_ids or []
    bad = _outside((t for w in words for t in w), vocab_size)
    if bad:
        raise ValueError(f"SamplingParams.bad_words_token_ids has token ids {bad[:8]} outside "
                         f"the vocabulary [0, {vocab_size})")
    total = sum(len(w) for w in words)
    if len(words) > MAX_BAD_WORDS or total > MAX_BAD_WORDS_TOTAL_TOKENS:
        raise ValueError(
            f"bad words come to {len(words)} words of {total} tokens (bad_words tokenised "
            f"plus bad_words_token_ids); at most {MAX_BAD_WORDS} words and "
            f"{MAX_BAD_WORDS_TOTAL_TOKENS} tokens are supported: pass fewer")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > vocab_size:
            raise ValueError(f"SamplingParams.{name}={value} exceeds the vocabulary size "
                             f"{vocab_size}; ask for at most {vocab_size}")


def check_text_fields(params: SamplingParams, tokenizer: Any, model_name: str) -> None:
    """stop strings and text bad words need a tokenizer."""
    needs = [name for name, used in (("stop", bool(params.stop)),
                                     ("bad_words", bool(params.bad_words))) if used]
    if needs and tokenizer is None:
        raise ValueError(
            f"SamplingParams.{' and '.join(needs)} need a tokenizer, and model {model_name!r} "
            "has none; use stop_token_ids / bad_words_token_ids instead")


def tokenize_bad_words(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each word as it reads at the start of the text and after a space (a word's tokens
    usually differ between the two, and vLLM bans both); duplicates dropped."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


def spec_decode_unsupported(params: SamplingParams) -> list[str]:
    """What the rejection samplers do not implement yet (refused, never ignored)."""
    unsupported = []
    if params.uses_penalties:
        unsupported.append("presence/frequency/repetition penalties")
    if params.min_tokens > 0:
        unsupported.append(f"min_tokens={params.min_tokens}")
    if params.logprobs is not None:
        unsupported.append(f"logprobs={params.logprobs}")
    if params.prompt_logprobs is not None:
        unsupported.append(f"prompt_logprobs={params.prompt_logprobs}")
    for name in ("logit_bias", "allowed_token_ids", "bad_words", "bad_words_token_ids"):
        if getattr(params, name):
            unsupported.append(name)
    return unsupported
