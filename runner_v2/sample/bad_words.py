"""Bad words: per-state-row device tables of banned token sequences, and their kernel.

For each word w (a token list) of a request's `bad_words_token_ids`, w[-1] gets -inf
when the request's OUTPUT tokens end with w[:-1] (a one-token word is always banned),
as in tests/oracles/sampling_reference.py. The outputs are read on the device from the
RequestState's token table: all_token_ids[s, prompt_len[s] : total_len[s]], which holds
the outputs resumed after a preemption (in the prefill) and every token post_update
appended since, so the tail is current at every step without the host. The prompt is
never looked into.

Tables (allocated on the first request with bad words, or eagerly with
`ensure_allocated()`), one fixed-width row per state row:
  word_tokens  int32 [R, max_total_tokens]: the row's words, concatenated
  word_offsets int32 [R, max_words + 1]: word i is word_tokens[offsets[i] : offsets[i + 1]]
  num_words    int32 [R] (0: none)
Once the tables exist every add writes its row in full (staging, packing and the lazy
allocation follow runner_v2/sample/row_tables.py). Ids >= vocab_size are stored as vocab_size: such a last token bans nothing and
such a prefix token matches no output, exactly as the original id would.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from runner_v2.sample.row_tables import StagedRowTables, clamp_ids
from shared.contract.sampling_params import (
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_TOTAL_TOKENS,
    SamplingParams,
)
from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton

# Prefix tokens compared per loop step, for all of a row's words at once; bad words are
# short, so one step covers almost every batch.
PREFIX_BLOCK = 32


class BadWordsState(StagedRowTables):
    NUM_PARTS = 2  # word offsets (num_words + 1), the words' tokens

    def __init__(
        self,
        max_num_reqs: int,
        vocab_size: int,
        device: torch.device | str,
        max_words: int = MAX_BAD_WORDS,
        max_total_tokens: int = MAX_BAD_WORDS_TOTAL_TOKENS,
    ) -> None:
        super().__init__(max_num_reqs, vocab_size, device)
        self.max_words = max_words
        self.max_total_tokens = max_total_tokens
        self.word_tokens: torch.Tensor | None = None
        self.word_offsets: torch.Tensor | None = None
        self.num_words: torch.Tensor | None = None
        self.num_words_np = np.zeros(max_num_reqs, np.int32)  # host mirror

    @property
    def allocated(self) -> bool:
        return self.num_words is not None

    def ensure_allocated(self) -> None:
        if self.allocated:
            return
        r, dev = self.max_num_reqs, self.device
        self.word_tokens = torch.full((r, self.max_total_tokens), -1, dtype=torch.int32,
                                      device=dev)
        self.word_offsets = torch.zeros(r, self.max_words + 1, dtype=torch.int32, device=dev)
        self.num_words = torch.zeros(r, dtype=torch.int32, device=dev)

    def check(self, sp: SamplingParams) -> None:
        """ValueError when the request's words do not fit the tables (the engine refuses
        such requests at admission; this guards a caller that did not)."""
        words = sp.bad_words_token_ids or []
        total = sum(len(w) for w in words)
        if len(words) > self.max_words or total > self.max_total_tokens:
            raise ValueError(
                f"bad_words_token_ids has {len(words)} words of {total} tokens in all; the "
                f"V2 sampler supports at most {self.max_words} words and "
                f"{self.max_total_tokens} tokens."
            )

    def add_request(self, row: int, sp: SamplingParams) -> None:
        """Stage every field of `row` for a new request."""
        words = sp.bad_words_token_ids or []
        if not (words or self.allocated):  # the common add: nothing to stage
            self.num_words_np[row] = 0
            self._stage(row, False, ())
            return
        self.check(sp)
        self.num_words_np[row] = len(words)
        offsets = np.zeros(len(words) + 1, np.int64)
        np.cumsum([len(w) for w in words], out=offsets[1:])
        tokens = clamp_ids(list(itertools.chain.from_iterable(words)), self.vocab_size)
        self._stage(row, bool(words), (offsets, tokens))

    def write_packed(self, segment: torch.Tensor, num_rows: int) -> None:
        if num_rows == 0:
            return
        assert self.allocated and segment.dtype == torch.int64
        kept(_write_kernel)((num_rows,),
            segment, segment[num_rows * self.header_width:], self.word_tokens,
            self.word_offsets, self.num_words,
            MAX_TOTAL=self.max_total_tokens, MAX_WORDS=self.max_words,
            BLOCK_TOKENS=min(1024, triton.next_power_of_2(self.max_total_tokens)),
            BLOCK_OFFSETS=triton.next_power_of_2(self.max_words + 1),
        )


@triton.jit
def _write_kernel(
    header_ptr,  # int64 [m, 4]: row, start, num offsets (num_words + 1), num tokens
    contents_ptr,  # int64: per staged row its offsets, then its tokens
    tokens_ptr, offsets_ptr, num_words_ptr,
    MAX_TOTAL: tl.constexpr, MAX_WORDS: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCK_OFFSETS: tl.constexpr,
):
    h = header_ptr + tl.program_id(0) * 4
    row = tl.load(h + 0)
    at = tl.load(h + 1)
    n_words = tl.load(h + 2) - 1
    n_tokens = tl.load(h + 3)
    tl.store(num_words_ptr + row, n_words.to(tl.int32))
    # the whole width, padding included: nothing of the row's previous request survives
    j = tl.arange(0, BLOCK_OFFSETS)
    offs = tl.load(contents_ptr + at + j, mask=j <= n_words, other=0)
    offs = tl.where(j <= n_words, offs, n_tokens)
    tl.store(offsets_ptr + row * (MAX_WORDS + 1) + j, offs.to(tl.int32), mask=j <= MAX_WORDS)
    for off in range(0, MAX_TOTAL, BLOCK_TOKENS):
        k = off + tl.arange(0, BLOCK_TOKENS)
        toks = tl.load(contents_ptr + at + n_words + 1 + k, mask=k < n_tokens, other=-1)
        tl.store(tokens_ptr + row * MAX_TOTAL + k, toks.to(tl.int32), mask=k < MAX_TOTAL)


@triton.jit
def _bad_words_kernel(
    x_ptr,  # [N, vocab_size] processed logits, compute dtype, contiguous: written in place
    idx_mapping_ptr,  # int32 [N]
    all_token_ids_ptr,  # int32 [R, max_model_len] (UVA on CUDA), row stride token_stride
    token_stride,
    prompt_len_ptr, total_len_ptr,  # int32 [R]
    words_ptr, offsets_ptr, num_words_ptr,  # the tables
    vocab_size,
    MAX_TOTAL: tl.constexpr, MAX_WORDS: tl.constexpr,
    WORDS: tl.constexpr,  # >= MAX_WORDS, a power of 2
    PREFIX: tl.constexpr,
):
    """One program per batch row, all of the row's words at once: a [WORDS, PREFIX]
    tile compares each word's prefix with the output tail it would have to match."""
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    w = tl.arange(0, WORDS)
    has = w < tl.load(num_words_ptr + row)
    start = tl.load(offsets_ptr + row * (MAX_WORDS + 1) + w, mask=has, other=0)
    end = tl.load(offsets_ptr + row * (MAX_WORDS + 1) + w + 1, mask=has, other=1)
    prefix_len = end - start - 1
    total_len = tl.load(total_len_ptr + row)
    # a prefix longer than the outputs never matches (it would reach into the prompt)
    cand = has & (prefix_len <= total_len - tl.load(prompt_len_ptr + row))
    tail = total_len - prefix_len  # where each word's prefix would start in the table
    mismatches = tl.zeros([WORDS], dtype=tl.int32)
    words_row = words_ptr + row * MAX_TOTAL
    tokens_row = all_token_ids_ptr + row * token_stride
    for off in range(0, tl.max(tl.where(cand, prefix_len, 0), 0), PREFIX):
        j = off + tl.arange(0, PREFIX)
        lane = cand[:, None] & (j[None, :] < prefix_len[:, None])
        want = tl.load(words_row + start[:, None] + j[None, :], mask=lane, other=0)
        got = tl.load(tokens_row + tail[:, None] + j[None, :], mask=lane, other=0)
        mismatches += tl.sum((want != got).to(tl.int32), 1)
    banned = cand & (mismatches == 0)
    last = tl.load(words_row + end - 1, mask=banned, other=0)
    # two words may ban the same token: the same value, written twice
    tl.store(x_ptr + b * vocab_size + last, tl.full([WORDS], float("-inf"), tl.float32),
             mask=banned & (last < vocab_size))


def apply_bad_words(
    x: torch.Tensor,
    idx_mapping: torch.Tensor,
    state: BadWordsState,
    all_token_ids: torch.Tensor,
    prompt_len: torch.Tensor,
    total_len: torch.Tensor,
) -> None:
    """Ban, in place on the processed logits x ([N, V], float32 / float64, contiguous),
    each word's last token where the row's outputs end with the word's prefix.
    all_token_ids / prompt_len / total_len: the RequestState's device tensors."""
    n, vocab_size = x.shape
    assert x.is_contiguous() and x.dtype in (torch.float32, torch.float64)
    assert vocab_size == state.vocab_size and state.allocated
    assert idx_mapping.dtype == torch.int32 and idx_mapping.shape == (n,)
    assert all_token_ids.dtype == torch.int32 and all_token_ids.stride(1) == 1
    assert prompt_len.dtype == total_len.dtype == torch.int32
    if n == 0:
        return
    kept(_bad_words_kernel)((n,),
        x, idx_mapping, all_token_ids, all_token_ids.stride(0), prompt_len, total_len,
        state.word_tokens, state.word_offsets, state.num_words, vocab_size,
        MAX_TOTAL=state.max_total_tokens, MAX_WORDS=state.max_words,
        WORDS=triton.next_power_of_2(state.max_words), PREFIX=PREFIX_BLOCK,
    )
