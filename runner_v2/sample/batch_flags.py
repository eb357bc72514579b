"""Which of the sampler's optional stages a batch needs, decided on the host from per-row
bits (no device value is read).

Each row's bits are set once, when a request is written into it (row_flag_bits, from its
parameters as the kernels will read them); a batch's flags are one OR over its rows. A churning
batch has a new composition nearly every step, and reading a dozen parameter columns per
batch was a measurable share of V2's sample stage there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.contract.sampling_params import SamplingParams

FLAG_RANDOM = 1  # temperature != 0
FLAG_FILTER = 2  # top_k, top_p or min_p on a random row
FLAG_PENALTIES = 4
FLAG_MIN_TOKENS = 8
FLAG_LOGPROBS = 16
FLAG_ALLOWED = 32  # allowed_token_ids
FLAG_BIAS = 64  # logit_bias
FLAG_BAD_WORDS = 128


@dataclass
class BatchFlags:
    """Which optional stages a batch needs, decided on the host (no device sync)."""

    any_penalties: bool
    any_min_tokens: bool
    any_filter: bool  # top_k, top_p or min_p on a random row
    num_logprobs: tuple[int, ...] = ()  # per batch row (-1 = none); empty without the rows
    max_num_logprobs: int | None = None  # None: no row asks for logprobs
    any_allowed_token_ids: bool = False
    any_logit_bias: bool = False
    any_bad_words: bool = False  # a row with bad_words_token_ids
    all_greedy: bool = False  # no random row: the sampler needs no noise, no positions

    @property
    def needs_positions(self) -> bool:
        """Whether the sampler reads the logits' positions: the noise of random rows is
        keyed by them, and min_tokens / penalties count outputs from them."""
        return not self.all_greedy or self.any_penalties or self.any_min_tokens

    @property
    def any_builtins(self) -> bool:
        """allowed_token_ids, logit_bias or bad words on some row."""
        return self.any_allowed_token_ids or self.any_logit_bias or self.any_bad_words


def row_flag_bits(sp: SamplingParams, top_k: int, num_allowed: int, num_bias: int,
                  num_bad_words: int) -> int:
    """A row's FLAG_* bits for a request: `top_k` as staged (0 when off), the built-ins'
    counts as their tables hold them. temperature, top_p and min_p are read in float32, as
    the kernels read them: a top_p that rounds to 1.0 filters nothing."""
    random = bool(np.float32(sp.temperature) != 0)
    filt = top_k > 0 or np.float32(sp.top_p) < 1 or np.float32(sp.min_p) > 0
    return (FLAG_RANDOM * random | FLAG_FILTER * bool(filt and random)
            | FLAG_PENALTIES * bool(sp.uses_penalties) | FLAG_MIN_TOKENS * (sp.min_tokens > 0)
            | FLAG_LOGPROBS * (sp.logprobs is not None) | FLAG_ALLOWED * bool(num_allowed)
            | FLAG_BIAS * bool(num_bias) | FLAG_BAD_WORDS * bool(num_bad_words))


def flags_of_rows(flag_bits: np.ndarray, num_logprobs: np.ndarray, rows: np.ndarray,
                  per_row: bool = True) -> BatchFlags:
    """The flags of the batch whose state rows are `rows` (batch order). per_row False:
    `rows` is not a batch (every row ever written), so no per-row logprob counts."""
    bits = int(np.bitwise_or.reduce(flag_bits[rows])) if len(rows) else 0
    if bits & FLAG_LOGPROBS:
        lps = num_logprobs[rows]
        counts, max_n = tuple(lps.tolist()), int(lps.max())
    else:
        counts, max_n = (-1,) * len(rows), -1
    return BatchFlags(
        any_penalties=bool(bits & FLAG_PENALTIES),
        any_min_tokens=bool(bits & FLAG_MIN_TOKENS),
        any_filter=bool(bits & FLAG_FILTER),
        num_logprobs=counts if per_row else (),
        max_num_logprobs=max_n if max_n >= 0 else None,
        any_allowed_token_ids=bool(bits & FLAG_ALLOWED),
        any_logit_bias=bool(bits & FLAG_BIAS),
        any_bad_words=bool(bits & FLAG_BAD_WORDS),
        all_greedy=not bits & FLAG_RANDOM,
    )
