"""V1's built-in logits processors: allowed_token_ids, logit_bias and bad words.

The semantics are tests/oracles/sampling_reference.py's processed_logits; the sampler
(runner_v1/sampler.py) applies them in its order: allowed_token_ids, logit_bias, the
penalties, min_tokens, bad words. Each op takes the logits in the compute dtype and
returns a new tensor (the sampler's raw logits stay untouched for the logprobs), and
returns x itself when no row uses it. V2's Triton sampler computes the same function,
so the bias is one plain IEEE add of the float32 value widened to the compute dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runner_v1.sampling_metadata import SamplingMetadata

BadWords = tuple[tuple[tuple[int, ...], int], ...]  # (prefix, last token) per word


def apply_allowed_token_ids(x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Every token outside a row's allowed_token_ids gets -inf (rows without: unchanged)."""
    mask = metadata.allowed_token_mask
    if mask is None:
        return x
    return torch.where(mask, x, float("-inf"))


def apply_logit_bias(x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """x[row, t] = x[row, t] + bias, the float32 bias widened to x's dtype (exact)."""
    index = metadata.logit_bias_index
    if index is None:
        return x
    rows, cols = index[0], index[1]
    biased = x[rows, cols] + metadata.logit_bias_values.to(x.dtype)
    return x.index_put((rows, cols), biased)  # out of place; no (row, t) appears twice


def banned_bad_word_tokens(
    bad_words: dict[int, BadWords], output_token_ids: Sequence[Sequence[int]], vocab_size: int
) -> tuple[list[int], list[int]]:
    """(rows, token ids) to ban this step: a word's last token when the row's outputs end
    with the word's other tokens (always for a one-token word). A loop over the rows with
    bad words and their words, comparing only each word's prefix with the output tail.
    Under async scheduling the outputs must have landed (no placeholders)."""
    rows: list[int] = []
    cols: list[int] = []
    for row, words in bad_words.items():
        outputs = output_token_ids[row]
        n = len(outputs)
        for prefix, last in words:
            k = len(prefix)
            if last < vocab_size and (k == 0 or (n >= k and tuple(outputs[n - k:]) == prefix)):
                rows.append(row)
                cols.append(last)
    return rows, cols


def apply_bad_words(x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The tokens banned_bad_word_tokens names get -inf (matched on this step's outputs)."""
    if not metadata.bad_words:
        return x
    rows, cols = banned_bad_word_tokens(metadata.bad_words, metadata.output_token_ids, x.shape[1])
    if not rows:
        return x
    index = torch.tensor([rows, cols], dtype=torch.int64).to(x.device, non_blocking=True)
    x = x.clone()
    x[index[0], index[1]] = float("-inf")
    return x
