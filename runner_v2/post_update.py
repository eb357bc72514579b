"""post_update: fold a step's sampled tokens back into the state table, on the device.

One kernel, one program per batch row: num_computed_tokens advances by the row's query
length, and a row that sampled (its chunk reached the end of its prefill) writes last_sampled_tokens, appends the token to
all_token_ids at total_len, bumps total_len and (for penalties) its output bin count.
The CPU never learns the token ids here; they reach it later through the async output
copy. Rows are distinct state rows (idx_mapping is injective), so one program per row
needs no atomics.
"""

from __future__ import annotations

import torch

from runner_v2.states import RequestState
from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton


@triton.jit
def _post_update_kernel(
    idx_mapping_ptr,  # [num_reqs] int32
    sampled_ptr,  # [>= num_reqs] int64
    seq_lens_ptr,  # [>= num_reqs] int32: num_computed + query_len (after this step)
    prefill_len_ptr,  # [max_num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    num_computed_ptr,  # [max_num_reqs] int32
    last_sampled_ptr,  # [max_num_reqs] int64
    total_len_ptr,  # [max_num_reqs] int32
    all_token_ids_ptr,  # [max_num_reqs, max_model_len] int32 (UVA on CUDA)
    all_token_ids_stride,
    max_model_len,
    bin_counts_ptr,  # [max_num_reqs, vocab_size] int32, or a dummy when not HAS_BIN_COUNTS
    bin_counts_stride,
    HAS_BIN_COUNTS: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    query_len = tl.load(query_start_loc_ptr + b + 1) - tl.load(query_start_loc_ptr + b)
    num_computed = tl.load(num_computed_ptr + row)
    tl.store(num_computed_ptr + row, num_computed + query_len)
    # A row samples iff this step's chunk reaches the end of its prefill (the last
    # prefill chunk, or any decode); a partial prefill chunk samples nothing.
    if tl.load(seq_lens_ptr + b) >= tl.load(prefill_len_ptr + row):
        tok = tl.load(sampled_ptr + b)
        tl.store(last_sampled_ptr + row, tok)
        total_len = tl.load(total_len_ptr + row)
        # The scheduler stops a request at max_model_len; the guard only keeps a
        # runaway row from writing into the next row of the table.
        tl.store(
            all_token_ids_ptr + row * all_token_ids_stride + total_len,
            tok.to(tl.int32),
            mask=total_len < max_model_len,
        )
        tl.store(total_len_ptr + row, total_len + 1)
        if HAS_BIN_COUNTS:
            cnt_ptr = bin_counts_ptr + row * bin_counts_stride + tok
            tl.store(cnt_ptr, tl.load(cnt_ptr) + 1)


def post_update(
    idx_mapping: torch.Tensor,
    num_reqs: int,
    sampled_token_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    state: RequestState,
    output_bin_counts: torch.Tensor | None = None,
) -> None:
    """Advance the state of the step's `num_reqs` rows (see module docstring).

    sampled_token_ids: int64 [N] (or [N, 1]), N >= num_reqs, batch order.
    seq_lens: int32 [N], the step's device seq_lens (InputBatch.seq_lens), batch order: a
    row whose seq_len is short of its prefill_len is still chunk-prefilling (no token).
    output_bin_counts: int32 [max_num_reqs, vocab_size] by state row, or None.
    """
    if num_reqs == 0:
        return
    sampled = sampled_token_ids.reshape(-1)
    assert sampled.dtype == torch.int64 and sampled.shape[0] >= num_reqs
    assert seq_lens.dtype == torch.int32 and seq_lens.shape[0] >= num_reqs
    assert idx_mapping.dtype == torch.int32 and idx_mapping.shape[0] >= num_reqs
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape[0] >= num_reqs + 1
    all_token_ids = state.all_token_ids.gpu
    has_bins = output_bin_counts is not None
    if has_bins:
        assert output_bin_counts.dtype == torch.int32
        assert output_bin_counts.shape == (state.max_num_reqs, state.vocab_size)
        assert output_bin_counts.stride(1) == 1
    bins = output_bin_counts if has_bins else state.num_computed_tokens.gpu  # dummy pointer
    kept(_post_update_kernel)((num_reqs,),
        idx_mapping, sampled, seq_lens, state.prefill_len.gpu, query_start_loc,
        state.num_computed_tokens.gpu,
        state.last_sampled_tokens.gpu, state.total_len.gpu, all_token_ids,
        all_token_ids.stride(0), state.max_model_len, bins,
        bins.stride(0) if has_bins else 0, HAS_BIN_COUNTS=has_bins,
        num_warps=1,
    )  # fmt: skip
