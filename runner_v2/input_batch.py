"""V2 input prep: persistent input buffers, the per-step InputBatch, and the Triton
kernels that build positions, seq_lens, input_ids and logits_indices on the device; the
batch also carries the step's block table and slot mapping (BlockTables.prepare).

The host computes only what it knows exactly and cheaply (the batch order, idx_mapping
and query_start_loc, from the scheduler's token counts). Everything that depends on
per-request progress reads the DEVICE state (num_computed_tokens, last_sampled_tokens),
so a decode's input token never makes a CPU round trip.

Padding rules (CUDA graphs replay over padded sizes; see CommonAttentionMetadata):
- query_start_loc past the real rows repeats the real token count (non-decreasing),
- seq_lens past the real rows is 0 in the whole persistent buffer (a padded row attends
  to nothing, whatever graph size reads it),
- input_ids / positions from num_tokens to num_tokens_padded are 0 (in range for the
  embedding and RoPE, and the same whatever an earlier step left there); their
  slot_mapping entries are PAD (no KV write), no real row's query range covers them, and
  padded tokens are never sampled. Past num_tokens_padded the buffers keep stale values
  no graph of this step reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from runner_v2.block_tables import BlockTables
from runner_v2.states import RequestState
from runner_v2.uva import async_copy_to_device
from shared.attention.metadata import count_leading_decodes
from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton

_BLOCK = 1024


class InputBuffers:
    """Persistent device buffers the model (and a captured graph) reads. Their
    addresses never change; each step writes a prefix and views it."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device | str):
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)
        kw = {"device": self.device}
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32, **kw)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, **kw)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, **kw)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, **kw)
        self.logits_indices = torch.zeros(max_num_reqs, dtype=torch.int32, **kw)
        self.idx_mapping = torch.zeros(max_num_reqs, dtype=torch.int32, **kw)


@dataclass(frozen=True)
class InputBatch:
    """One step's batch: views of InputBuffers and of BlockTables' per-step buffers, plus
    host-side sizes."""

    req_ids: list[str]  # batch order
    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    num_tokens_padded: int
    idx_mapping: torch.Tensor  # int32 [num_reqs], device: batch position -> state row
    idx_mapping_np: np.ndarray  # int32 [num_reqs]
    num_scheduled_tokens_np: np.ndarray  # int32 [num_reqs]
    query_start_loc: torch.Tensor  # int32 [num_reqs_padded + 1], device
    query_start_loc_np: np.ndarray  # int32 [num_reqs_padded + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs_padded], device (exact)
    seq_lens_np: np.ndarray  # int32 [num_reqs_padded], host upper bound, 0 when padded
    max_query_len: int
    max_seq_len: int  # host upper bound
    input_ids: torch.Tensor  # int32 [num_tokens_padded], device
    positions: torch.Tensor  # int64 [num_tokens_padded], device
    logits_indices: torch.Tensor  # int32 [num_reqs], device: last token of each row
    num_decodes: int  # leading rows with query length 1
    num_decode_tokens: int
    is_uniform_decode: bool  # every row has query length 1
    # batch order, rows past num_reqs zeroed
    block_table: torch.Tensor  # int32 [num_reqs_padded, max_num_blocks_per_req], device
    slot_mapping: torch.Tensor  # int64 [num_tokens_padded], device, PAD past num_tokens


def gather_batch_req_state(
    num_scheduled_tokens: Mapping[str, int], state: RequestState
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Batch order, idx_mapping (int32, batch position -> state row) and the query
    lengths in that order, from the scheduler's {req_id: num_tokens}. The order: uniform
    decodes (query length 1) first, then ascending query length; stable, so ties keep
    the scheduler's order. Attention backends split decodes from prefills by assuming
    decode-like rows lead."""
    req_ids = list(num_scheduled_tokens)
    nst = np.fromiter(num_scheduled_tokens.values(), dtype=np.int32, count=len(req_ids))
    if not (nst == 1).all():  # an all-decode step is already in order (the common case)
        order = np.lexsort((nst, nst != 1))  # stable: ties keep the scheduler's order
        req_ids = [req_ids[i] for i in order.tolist()]
        nst = nst[order]
    index = state.req_id_to_index
    idx_mapping_np = np.fromiter(map(index.__getitem__, req_ids), dtype=np.int32, count=len(req_ids))
    return req_ids, idx_mapping_np, nst


# ---- kernels ------------------------------------------------------------------------


@triton.jit
def _prepare_inputs_kernel(
    input_ids_ptr,  # [max_num_tokens] int32
    positions_ptr,  # [max_num_tokens] int64
    seq_lens_ptr,  # [max_num_reqs] int32
    logits_indices_ptr,  # [max_num_reqs] int32
    idx_mapping_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    num_computed_ptr,  # [max_num_reqs] int32, by state row (device truth)
    prefill_len_ptr,  # [max_num_reqs] int32
    last_sampled_ptr,  # [max_num_reqs] int64
    all_token_ids_ptr,  # [max_num_reqs, max_model_len] int32 (UVA on CUDA)
    all_token_ids_stride,
    draft_tokens_ptr,  # [max_num_reqs, k] int64, by state row (read iff HAS_DRAFTS)
    draft_tokens_stride,
    num_reqs,
    max_num_reqs,
    num_tokens_padded,
    BLOCK: tl.constexpr,
    HAS_DRAFTS: tl.constexpr,
    DRAFT_BLOCK: tl.constexpr,  # >= k, a power of two
):
    """One program per batch row: seq_len, positions, input ids (prefill positions from
    all_token_ids, the sampled position from last_sampled_tokens, the positions after it
    from the row's drafts) and the logit index. One extra program zeroes the padded
    seq_lens and the padded tokens' ids / positions."""
    b = tl.program_id(0)
    if b < num_reqs:
        row = tl.load(idx_mapping_ptr + b)
        num_computed = tl.load(num_computed_ptr + row)
        prefill_len = tl.load(prefill_len_ptr + row)
        start = tl.load(query_start_loc_ptr + b)
        end = tl.load(query_start_loc_ptr + b + 1)
        query_len = end - start
        tl.store(seq_lens_ptr + b, num_computed + query_len)
        # One logit per row (no speculative tokens): its last token.
        tl.store(logits_indices_ptr + b, end - 1)
        for off in range(start, end, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            pos = num_computed + (offs - start)
            tl.store(positions_ptr + offs, pos.to(tl.int64), mask=offs < end)
        # Prefill positions (< prefill_len) come from the token table...
        n = tl.minimum(query_len, prefill_len - num_computed)
        src = all_token_ids_ptr + row.to(tl.int64) * all_token_ids_stride + num_computed
        for off in range(0, n, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(input_ids_ptr + start + offs, tl.load(src + offs, mask=mask), mask=mask)
        # ... and the first position at or past prefill_len is the token sampled last
        # step, still only on the device; the scheduled drafts follow it (speculative
        # decoding: a prefix of the row's proposals, also only on the device).
        first_sampled_pos = tl.maximum(num_computed, prefill_len)
        if first_sampled_pos < num_computed + query_len:
            tok = tl.load(last_sampled_ptr + row)
            first = start + first_sampled_pos - num_computed
            tl.store(input_ids_ptr + first, tok.to(tl.int32))
            if HAS_DRAFTS:
                num_drafts = num_computed + query_len - first_sampled_pos - 1
                d = tl.arange(0, DRAFT_BLOCK)
                # its own name: reusing `src` (an int32 pointer above) for this int64
                # pointer block does not compile outside the interpreter
                draft_src = draft_tokens_ptr + row.to(tl.int64) * draft_tokens_stride + d
                drafts = tl.load(draft_src, mask=d < num_drafts)
                tl.store(input_ids_ptr + first + 1 + d, drafts.to(tl.int32), mask=d < num_drafts)
    else:
        # The extra program zeroes the whole padded tail, so any graph size that
        # reads past num_reqs sees seq_len 0 (not a previous step's length).
        for off in range(num_reqs, max_num_reqs, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            zeros = tl.zeros([BLOCK], dtype=tl.int32)
            tl.store(seq_lens_ptr + offs, zeros, mask=offs < max_num_reqs)
        # Padded tokens of a graph batch (the real count read on the device, like the
        # slot kernel does): id 0 and position 0, not an earlier step's values.
        num_tokens = tl.load(query_start_loc_ptr + num_reqs)
        for off in range(num_tokens, num_tokens_padded, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            mask = offs < num_tokens_padded
            tl.store(input_ids_ptr + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=mask)
            tl.store(positions_ptr + offs, tl.zeros([BLOCK], dtype=tl.int64), mask=mask)


# ---- host side ----------------------------------------------------------------------


def _query_start_loc_np(num_scheduled_tokens_np: np.ndarray, num_reqs_padded: int) -> np.ndarray:
    num_reqs = num_scheduled_tokens_np.shape[0]
    qsl = np.empty(num_reqs_padded + 1, dtype=np.int32)
    qsl[0] = 0
    np.cumsum(num_scheduled_tokens_np, out=qsl[1 : num_reqs + 1])
    # Padded rows are empty: repeat the real token count (non-decreasing for backends).
    qsl[num_reqs + 1 :] = qsl[num_reqs]
    return qsl


def prepare_inputs(
    req_ids: list[str],
    idx_mapping_np: np.ndarray,
    num_scheduled_tokens_np: np.ndarray,
    num_reqs_padded: int,
    num_tokens_padded: int,
    state: RequestState,
    buffers: InputBuffers,
    block_tables: BlockTables,
    draft_tokens: torch.Tensor | None = None,
) -> InputBatch:
    """Fill the persistent buffers for one step (batch already ordered) and return the
    step's views. draft_tokens: int64 [max_num_reqs, k] by state row, the proposals
    speculative decoding scheduled after each decode's sampled token (None: no drafts). Two small H2D copies (idx_mapping, query_start_loc), then one
    input-prep launch and BlockTables.prepare's one launch (which reads the positions
    the first one writes); no sync."""
    num_reqs = len(req_ids)
    assert idx_mapping_np.shape == (num_reqs,) and num_scheduled_tokens_np.shape == (num_reqs,)
    num_tokens = int(num_scheduled_tokens_np.sum())
    assert num_reqs <= num_reqs_padded <= buffers.max_num_reqs, (num_reqs, num_reqs_padded)
    assert num_tokens <= num_tokens_padded <= buffers.max_num_tokens, (
        num_tokens,
        num_tokens_padded,
    )
    device = buffers.device
    idx_mapping_np = idx_mapping_np.astype(np.int32, copy=False)
    idx_mapping = buffers.idx_mapping[:num_reqs]
    async_copy_to_device(idx_mapping_np, device, out=idx_mapping)
    qsl_np = _query_start_loc_np(num_scheduled_tokens_np, num_reqs_padded)
    query_start_loc = buffers.query_start_loc[: num_reqs_padded + 1]
    async_copy_to_device(qsl_np, device, out=query_start_loc)

    _launch_prepare_inputs(buffers, idx_mapping, state, num_reqs, num_tokens_padded, draft_tokens)
    nc_np = state.num_computed_tokens_np[idx_mapping_np]

    seq_lens_np = np.zeros(num_reqs_padded, dtype=np.int32)
    seq_lens_np[:num_reqs] = nc_np + num_scheduled_tokens_np
    num_decodes = count_leading_decodes(num_scheduled_tokens_np)
    max_query_len = int(num_scheduled_tokens_np.max()) if num_reqs else 0
    positions = buffers.positions[:num_tokens_padded]
    block_table, slot_mapping = block_tables.prepare(
        idx_mapping, query_start_loc, positions, num_reqs_padded, num_tokens_padded
    )
    return InputBatch(
        req_ids=list(req_ids),
        num_reqs=num_reqs,
        num_reqs_padded=num_reqs_padded,
        num_tokens=num_tokens,
        num_tokens_padded=num_tokens_padded,
        idx_mapping=idx_mapping,
        idx_mapping_np=idx_mapping_np,
        num_scheduled_tokens_np=num_scheduled_tokens_np,
        query_start_loc=query_start_loc,
        query_start_loc_np=qsl_np,
        seq_lens=buffers.seq_lens[:num_reqs_padded],
        seq_lens_np=seq_lens_np,
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens_np.max()) if num_reqs else 0,
        input_ids=buffers.input_ids[:num_tokens_padded],
        positions=positions,
        logits_indices=buffers.logits_indices[:num_reqs],
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        is_uniform_decode=num_reqs > 0 and max_query_len == 1,
        block_table=block_table,
        slot_mapping=slot_mapping,
    )


def _launch_prepare_inputs(
    buffers: InputBuffers,
    idx_mapping: torch.Tensor,
    state: RequestState,
    num_reqs: int,
    num_tokens_padded: int,
    draft_tokens: torch.Tensor | None = None,
) -> None:
    all_token_ids = state.all_token_ids.gpu
    assert idx_mapping.dtype == torch.int32 and state.num_computed_tokens.gpu.dtype == torch.int32
    assert all_token_ids.dtype == torch.int32 and all_token_ids.dim() == 2
    assert state.last_sampled_tokens.gpu.dtype == torch.int64
    has_drafts = draft_tokens is not None
    if has_drafts:
        assert draft_tokens.dtype == torch.int64 and draft_tokens.stride(1) == 1
    drafts = draft_tokens if has_drafts else state.last_sampled_tokens.gpu  # dummy pointer
    kept(_prepare_inputs_kernel)((num_reqs + 1,),
        buffers.input_ids, buffers.positions, buffers.seq_lens, buffers.logits_indices,
        idx_mapping, buffers.query_start_loc, state.num_computed_tokens.gpu,
        state.prefill_len.gpu, state.last_sampled_tokens.gpu, all_token_ids,
        all_token_ids.stride(0), drafts, drafts.stride(0) if has_drafts else 0,
        num_reqs, buffers.max_num_reqs, num_tokens_padded,
        BLOCK=_BLOCK, HAS_DRAFTS=has_drafts,
        DRAFT_BLOCK=triton.next_power_of_2(draft_tokens.shape[1]) if has_drafts else 1,
    )  # fmt: skip
