"""SamplingMetadata: the V1 sampler's per-step view of the batch, rows = batch rows.

Built by PersistentBatch (runner_v1.persistent_batch) and rebuilt only when the batch
changed; the per-step parts (positions, min-tokens masks) are passed to the sampler separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    num_reqs: int
    temperature: torch.Tensor  # float32 [N]; 0 = greedy
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # int32 [N], 0 = off; None when no row uses top-k
    top_p: torch.Tensor | None  # float32 [N]; None when every row has top_p == 1
    min_p: torch.Tensor | None  # float32 [N]; None when every row has min_p == 0
    seeds: torch.Tensor  # int64 [N]; every request has one (assigned at admission)
    # penalties: None when no row uses any
    presence_penalty: torch.Tensor | None  # float32 [N]
    frequency_penalty: torch.Tensor | None  # float32 [N]
    repetition_penalty: torch.Tensor | None  # float32 [N]
    # user-prompt tokens per row, padded with vocab_size (a bin past the vocabulary)
    prompt_token_ids: torch.Tensor | None  # int64 [N, max_prompt_len]
    # generated tokens per row (references to the requests' lists; resumed outputs included)
    output_token_ids: list[list[int]]
    # per row: how many top logprobs to return (-1 = none); max over rows, or None
    num_logprobs: list[int]
    max_num_logprobs: int | None
    # rows still below min_tokens -> token ids to mask (stop ids, EOS unless ignore_eos)
    min_tokens_stop_ids: dict[int, list[int]]
    # Built-in logits processors (runner_v1/builtin_processors.py); each None when no row
    # uses it, so a batch without them builds and applies nothing.
    # bool [N, V]: True = the row may sample the token; rows without allowed_token_ids
    # are all True
    allowed_token_mask: torch.Tensor | None = None
    # logit_bias entries of every row: int64 [2, K] (row; token id) and float32 [K]
    logit_bias_index: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    # row -> its bad words as (prefix, last token) pairs; matched per step on the host
    # against output_token_ids
    bad_words: dict[int, tuple[tuple[tuple[int, ...], int], ...]] | None = None

    @property
    def reads_output_tokens(self) -> bool:
        """The sampler reads output_token_ids on the host (penalties, bad words): under
        async scheduling the latest step's placeholders must have landed."""
        return self.repetition_penalty is not None or bool(self.bad_words)

    @property
    def uses_builtin_processors(self) -> bool:
        return (self.allowed_token_mask is not None or self.logit_bias_index is not None
                or bool(self.bad_words))
