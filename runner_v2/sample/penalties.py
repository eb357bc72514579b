"""Penalties and the min_tokens mask in one Triton kernel, writing processed logits.

Per batch row b (state row = idx_mapping[b]), on the logits in the compute dtype:
  repetition r on tokens in prompt ∪ outputs: x > 0 ? x / r : x * r
  frequency:  x -= f * count          presence: x -= p * (count > 0)
  min_tokens: while pos + 1 - prompt_len < min_tokens, the row's stop-id table
              (stop ids + EOS unless ignore_eos, padded with -1) gets -inf.
The input may already be processed (allowed_token_ids / logit_bias ran first).
Rows without penalties (r = 1, f = p = 0) never read the bin tensors, whose rows may
be stale from an earlier request of the same state row. Same operation order as
runner_v1/sampler.py, launched without FMA contraction, so results are bit-identical.
"""

from __future__ import annotations

import torch

from runner_v2.sample.gumbel import div_ieee, load_logits
from runner_v2.sample.states import SamplingStates
from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton

PENALTY_BLOCK = 1024


@triton.jit
def _penalties_kernel(
    logits_ptr,  # [N, vocab_size] raw logits, any float dtype, row stride logits_stride
    logits_stride,
    out_ptr,  # [N, vocab_size] compute dtype, contiguous
    idx_mapping_ptr,  # int32 [N]: batch row -> state row
    pos_ptr,  # int64 [N]: position of each logit's input token
    repetition_ptr, frequency_ptr, presence_ptr,  # float32 [R]
    prompt_mask_ptr,  # int32 [R, num_words]: prompt bitset
    counts_ptr,  # int32 [R, vocab_size]: output bin counts
    min_tokens_ptr, prompt_len_ptr, num_stop_ptr,  # int32 [R]
    stop_ids_ptr,  # int32 [R, max_stop]
    vocab_size, num_words, max_stop,
    BLOCK: tl.constexpr,
    HAS_PENALTIES: tl.constexpr,
    HAS_MIN_TOKENS: tl.constexpr,
    IS_FP64: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < vocab_size
    x = load_logits(logits_ptr + b * logits_stride, offs, valid, IS_FP64)
    if HAS_PENALTIES:
        rep = tl.load(repetition_ptr + row).to(x.dtype)
        freq = tl.load(frequency_ptr + row).to(x.dtype)
        pres = tl.load(presence_ptr + row).to(x.dtype)
        if (rep != 1.0) | (freq != 0.0) | (pres != 0.0):
            count = tl.load(counts_ptr + row.to(tl.int64) * vocab_size + offs, mask=valid, other=0)
            words = tl.load(prompt_mask_ptr + row.to(tl.int64) * num_words + offs // 32,
                            mask=valid, other=0)
            seen = (((words >> (offs % 32)) & 1) != 0) | (count > 0)
            x = tl.where(seen, tl.where(x > 0, div_ieee(x, rep, IS_FP64), x * rep), x)
            x = x - freq * count.to(x.dtype)
            x = x - pres * (count > 0).to(x.dtype)
    if HAS_MIN_TOKENS:
        num_outputs = tl.load(pos_ptr + b) + 1 - tl.load(prompt_len_ptr + row)
        if num_outputs < tl.load(min_tokens_ptr + row):
            for j in range(0, tl.load(num_stop_ptr + row)):
                stop_id = tl.load(stop_ids_ptr + row.to(tl.int64) * max_stop + j)
                x = tl.where(offs == stop_id, float("-inf"), x)
    tl.store(out_ptr + b * vocab_size + offs, x, mask=valid)


def apply_penalties_and_min_tokens(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    positions: torch.Tensor,
    states: SamplingStates,
    has_penalties: bool,
    has_min_tokens: bool,
    block: int = PENALTY_BLOCK,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Processed logits [N, V] in float32 (float64 for fp64 logits): a new tensor, or
    `out` (contiguous, compute dtype), which may be `logits` itself: every program
    reads its block before writing it back, so the update is safe in place (the
    sampler passes the built-ins' processed logits that way)."""
    n, vocab_size = logits.shape
    assert logits.stride(1) == 1 and vocab_size == states.vocab_size
    assert idx_mapping.dtype == torch.int32 and idx_mapping.shape == (n,)
    assert positions.dtype == torch.int64 and positions.shape == (n,)
    is_fp64 = logits.dtype == torch.float64
    dtype = torch.float64 if is_fp64 else torch.float32
    if out is None:
        out = torch.empty(n, vocab_size, dtype=dtype, device=logits.device)
    assert out.shape == (n, vocab_size) and out.dtype == dtype and out.is_contiguous()
    if n == 0:
        return out
    if has_penalties:
        assert states.output_bin_counts is not None and states.prompt_bin_mask is not None
        prompt_mask, counts = states.prompt_bin_mask, states.output_bin_counts
    else:  # never dereferenced: HAS_PENALTIES is False
        prompt_mask, counts = states.min_tokens, states.min_tokens
    kept(_penalties_kernel)((n, triton.cdiv(vocab_size, block)),
        logits, logits.stride(0), out, idx_mapping, positions,
        states.repetition_penalty, states.frequency_penalty, states.presence_penalty,
        prompt_mask, counts, states.min_tokens, states.prompt_len, states.num_stop_ids,
        states.stop_ids, vocab_size, prompt_mask.shape[-1] if has_penalties else 1,
        states.max_stop_ids,
        BLOCK=block, HAS_PENALTIES=has_penalties, HAS_MIN_TOKENS=has_min_tokens,
        IS_FP64=is_fp64, enable_fp_fusion=False,
    )
    return out
