"""The per-request settings of the example logits processors, read from
SamplingParams.extra_args, shared by their V1- and V2-interface versions
(runner_v1/example_logits_processors.py, runner_v2/example_logits_processors.py) so
that both accept and refuse exactly the same requests.

- "no_repeat_ngram_size": n in [2, MAX_NGRAM_SIZE]: a token that would complete an
  n-gram already present in prompt + output is banned (-inf), as transformers'
  NoRepeatNGramLogitsProcessor does for the whole sequence.
- "boost_token_ids" (list of token ids, at most MAX_BOOST_TOKENS) and "boost" (a real
  in [-100, 100]): the boost (as float32) is added to those tokens' logits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_NGRAM_SIZE = 8
MAX_BOOST_TOKENS = 64


@dataclass(frozen=True)
class NgramArgs:
    size: int  # 0: off


@dataclass(frozen=True)
class BoostArgs:
    token_ids: tuple[int, ...]  # distinct, in first-seen order; () = off
    boost: float


def _extra(extra_args: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return extra_args or {}


def ngram_args(extra_args: Mapping[str, Any] | None) -> NgramArgs:
    n = _extra(extra_args).get("no_repeat_ngram_size")
    if n is None:
        return NgramArgs(0)
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_NGRAM_SIZE:
        raise ValueError(
            f"extra_args['no_repeat_ngram_size']={n!r} is invalid: expected an int in "
            f"[2, {MAX_NGRAM_SIZE}] (or leave it out)"
        )
    return NgramArgs(n)


def boost_args(extra_args: Mapping[str, Any] | None, vocab_size: int) -> BoostArgs:
    extra = _extra(extra_args)
    ids = extra.get("boost_token_ids")
    if ids is None:
        return BoostArgs((), 0.0)
    ok = isinstance(ids, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids)
    if not ok or len(set(ids)) > MAX_BOOST_TOKENS:
        raise ValueError(
            f"extra_args['boost_token_ids']={ids!r} is invalid: expected a list of at most "
            f"{MAX_BOOST_TOKENS} token ids in [0, {vocab_size})"
        )
    boost = extra.get("boost")
    if (isinstance(boost, bool) or not isinstance(boost, (int, float))
            or not math.isfinite(boost) or abs(boost) > 100):
        raise ValueError(
            f"extra_args['boost']={boost!r} is invalid: expected a real number in [-100, 100] "
            "when boost_token_ids is set"
        )
    return BoostArgs(tuple(dict.fromkeys(ids)), float(boost))
