"""post_update for a step that verified drafts: fold each row's accepted run into the
state table, on the device (the plain step's runner_v2/post_update.py, generalised).

Per batch row b (one program): a row that samples appends its num_sampled[b] tokens
(accepted drafts, then the target's own token) to all_token_ids at total_len, sets
last_sampled_tokens to the run's last token, and advances num_computed_tokens past the
accepted drafts only: the rejected drafts' KV was written this step but is garbage, and
the next step recomputes from the first of them (their slots are overwritten). A partial
prefill chunk advances by its query length and samples nothing. Penalties are refused
with speculative decoding (no bin counts here).
"""

from __future__ import annotations

import torch

from runner_v2.states import RequestState
from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton


@triton.jit
def _spec_post_update_kernel(
    idx_mapping_ptr,  # [N] int32
    output_ptr,  # [N, max_k + 1] int64, accepted run then -1
    output_stride,
    num_sampled_ptr,  # [N] int32
    cu_num_logits_ptr,  # [N + 1] int32
    seq_lens_ptr,  # [N] int32: num_computed + query_len (this step)
    query_start_loc_ptr,  # [N + 1] int32
    prefill_len_ptr,  # [R] int32
    num_computed_ptr,  # [R] int32
    last_sampled_ptr,  # [R] int64
    total_len_ptr,  # [R] int32
    all_token_ids_ptr,  # [R, max_model_len] int32
    all_token_ids_stride,
    max_model_len,
    RUN_BLOCK: tl.constexpr,  # >= max_k + 1
):
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    query_len = tl.load(query_start_loc_ptr + b + 1) - tl.load(query_start_loc_ptr + b)
    num_computed = tl.load(num_computed_ptr + row)
    if tl.load(seq_lens_ptr + b) >= tl.load(prefill_len_ptr + row):
        num_drafts = tl.load(cu_num_logits_ptr + b + 1) - tl.load(cu_num_logits_ptr + b) - 1
        n = tl.load(num_sampled_ptr + b)
        # the target's own token and the accepted drafts become computed next step's
        # inputs: num_computed lands on the run's last token, as after a plain decode
        tl.store(num_computed_ptr + row, num_computed + query_len - num_drafts - 1 + n)
        offs = tl.arange(0, RUN_BLOCK)
        run = tl.load(output_ptr + b * output_stride + offs, mask=offs < n, other=0)
        total_len = tl.load(total_len_ptr + row)
        dst = all_token_ids_ptr + row * all_token_ids_stride + total_len + offs
        # the scheduler trims drafts so the run ends inside max_model_len; the mask only
        # keeps a runaway row from writing into the next row of the table
        tl.store(dst, run.to(tl.int32), mask=(offs < n) & (total_len + offs < max_model_len))
        tl.store(total_len_ptr + row, total_len + n)
        last = tl.load(output_ptr + b * output_stride + n - 1)
        tl.store(last_sampled_ptr + row, last)
    else:
        tl.store(num_computed_ptr + row, num_computed + query_len)


def spec_post_update(
    idx_mapping: torch.Tensor, num_reqs: int, output_token_ids: torch.Tensor,
    num_sampled: torch.Tensor, cu_num_logits: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor, state: RequestState,
) -> None:
    """output_token_ids int64 [N, max_k + 1]; num_sampled int32 [N]; the rest as in
    runner_v2.post_update.post_update, cu_num_logits from the SpecDecodeBatch."""
    if num_reqs == 0:
        return
    assert output_token_ids.dtype == torch.int64 and output_token_ids.stride(1) == 1
    num_sampled = num_sampled.to(torch.int32)
    all_token_ids = state.all_token_ids.gpu
    kept(_spec_post_update_kernel)((num_reqs,),
        idx_mapping, output_token_ids, output_token_ids.stride(0), num_sampled, cu_num_logits,
        seq_lens, query_start_loc, state.prefill_len.gpu, state.num_computed_tokens.gpu,
        state.last_sampled_tokens.gpu, state.total_len.gpu, all_token_ids,
        all_token_ids.stride(0), state.max_model_len,
        RUN_BLOCK=triton.next_power_of_2(output_token_ids.shape[1]), num_warps=1,
    )  # fmt: skip
