"""V2's draft_model proposer: the drafts are made and kept on the device.

After the step's post_update (all_token_ids, total_len already hold the accepted run), the
draft model first catches up: per batch row the positions [num_computed before the step,
num_computed + query_len (+ 1 for a row that sampled)) are fed, their tokens read from
all_token_ids on the device. The host knows that layout but not how many drafts were
accepted, so a sampled row's tail past total_len carries placeholder tokens whose KV is
not written (PAD slots) and whose outputs nobody reads; the row's proposal starts from the
logit of its last real token (found on the device). Then k - 1 single-token forwards extend
the sampled rows' drafts. Tokens and q rows go to the speculator's per-state-row buffers;
nothing is copied to the host.

Invariant that makes this stateless: the draft's KV is valid at every position below the
target's num_computed_tokens at the start of a step (each step's catch-up starts there and
ends at the newest token). KV positions follow the target's block table (the draft's cache
shares its layout, shared/runtime/draft_executor.py); the scheduler allocated k positions
of lookahead, which covers the k - 1 draft positions past the newest token.
"""

from __future__ import annotations

import numpy as np
import torch

from runner_v2.input_batch import InputBatch
from runner_v2.sample.states import SamplingStates
from runner_v2.states import RequestState
from shared.attention.metadata import PAD_SLOT_ID, CommonAttentionMetadata, count_leading_decodes
from shared.runtime.draft_executor import DraftForward
from shared.runtime.draft_graphs import DraftGraphConfig
from shared.runtime.host_buffers import copy_packed_to_device
from shared.runtime.model_executor import ModelExecutor
from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton
from shared.sampling.draft_sampling import sample_draft

_BLOCK = 256
PAD = tl.constexpr(PAD_SLOT_ID)


@triton.jit
def _slot(block_table_ptr, block_table_stride, row, pos, block_size, valid):
    blk = tl.load(block_table_ptr + row * block_table_stride + pos // block_size, mask=valid, other=0)
    return tl.where(valid, blk.to(tl.int64) * block_size + pos % block_size, PAD)


@triton.jit
def _catch_up_inputs_kernel(
    idx_mapping_ptr, seq_lens_ptr, query_start_loc_ptr,  # the step's batch (batch order)
    catch_qsl_ptr,  # [N + 1] int32: the catch-up layout
    total_len_ptr, all_token_ids_ptr, all_token_ids_stride,  # state (by state row)
    block_table_ptr, block_table_stride, block_size, max_model_len,
    input_ids_ptr, positions_ptr, slots_ptr,  # [num catch-up tokens]
    last_idx_ptr,  # [N] int64: each row's last real catch-up token
    seq_lens_out_ptr,  # [N] int32: the catch-up's seq_lens
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    query_len = tl.load(query_start_loc_ptr + b + 1) - tl.load(query_start_loc_ptr + b)
    start_pos = tl.load(seq_lens_ptr + b) - query_len  # num_computed before the step
    cs = tl.load(catch_qsl_ptr + b)
    n = tl.load(catch_qsl_ptr + b + 1) - cs
    total = tl.load(total_len_ptr + row)
    for off in range(0, n, BLOCK):
        o = off + tl.arange(0, BLOCK)
        m = o < n
        pos = start_pos + o
        real = m & (pos < total)
        tok = tl.load(all_token_ids_ptr + row * all_token_ids_stride + pos, mask=real, other=0)
        tl.store(input_ids_ptr + cs + o, tok, mask=m)
        tl.store(positions_ptr + cs + o, tl.minimum(pos, max_model_len - 1).to(tl.int64), mask=m)
        slot = _slot(block_table_ptr, block_table_stride, row, pos, block_size, real)
        tl.store(slots_ptr + cs + o, slot, mask=m)
    tl.store(last_idx_ptr + b, (cs + tl.minimum(n, total - start_pos) - 1).to(tl.int64))
    tl.store(seq_lens_out_ptr + b, (start_pos + n).to(tl.int32))


@triton.jit
def _decode_inputs_kernel(
    rows_ptr,  # [n] int32 state rows
    prev_pos_ptr,  # [n] int64: the previous draft input's position
    tokens_ptr,  # [n] int64: the previous draft
    block_table_ptr, block_table_stride, block_size, max_model_len,
    input_ids_ptr, positions_ptr, slots_ptr, seq_lens_ptr,
):
    s = tl.program_id(0)
    row = tl.load(rows_ptr + s).to(tl.int64)
    pos = tl.load(prev_pos_ptr + s) + 1
    valid = pos < max_model_len
    # a row past max_model_len computes a throw-away draft (the scheduler trims it):
    # clamped position and length, no KV write
    tl.store(positions_ptr + s, tl.minimum(pos, max_model_len - 1))
    tl.store(seq_lens_ptr + s, tl.minimum(pos + 1, max_model_len).to(tl.int32))
    tl.store(input_ids_ptr + s, tl.load(tokens_ptr + s).to(tl.int32))
    tl.store(slots_ptr + s, _slot(block_table_ptr, block_table_stride, row, pos, block_size, valid))


def v2_full_query_lens(k: int) -> dict[int, int]:
    """The uniform query lengths V2's draft captures FULL graphs for (q -> the most
    requests): its single-token forwards, and its catch-up, which feeds every sampled
    decode row with k drafts k + 2 tokens (uniform whenever the whole batch drafts)."""
    return {1: 1 << 30, k + 2: 1 << 30}


class V2DraftProposer:
    def __init__(self, executor: ModelExecutor, k: int, max_model_len: int, block_size: int,
                 needs_host_seq_lens: bool, device: torch.device, max_num_tokens: int,
                 graphs: DraftGraphConfig) -> None:
        self.executor = executor
        self.draft_forward = DraftForward(executor, max_num_tokens, graphs, device)
        self.k = k
        self.max_model_len = max_model_len
        self.block_size = block_size
        # the TORCH backend reads exact host seq_lens: a sync per draft forward there
        self.needs_host_seq_lens = needs_host_seq_lens
        self.device = device
        self._max_seq_len = max_model_len  # a bound for the draft decodes' metadata
        self._arange_dev: torch.Tensor | None = None
        self._arange_cpu = torch.arange(1025, dtype=torch.int32)

    def _arange(self, n: int) -> torch.Tensor:
        """int32 0..n-1 on the device, from one buffer (a decode's query_start_loc)."""
        if self._arange_dev is None or self._arange_dev.shape[0] < n:
            self._arange_dev = torch.arange(max(n, 1024), dtype=torch.int32, device=self.device)
            self._arange_cpu = torch.arange(self._arange_dev.shape[0], dtype=torch.int32)
        return self._arange_dev[:n]

    def _metadata_rows(self, n: int, dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
        """Where a forward's per-request metadata goes: the draft's persistent FULL-graph
        buffer when it has one of n rows (the graph's staging then copies nothing), else
        a fresh tensor. seq_lens int32 [n] (width None) or block-table rows [n, width]."""
        full = self.draft_forward.full
        if full is not None and n <= full.seq_lens.shape[0]:
            return full.seq_lens[:n] if width is None else full.block_table[:n]
        shape = (n,) if width is None else (n, width)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def propose(
        self, batch: InputBatch, is_sampled_np: np.ndarray, req_states: RequestState,
        block_table: torch.Tensor, states: SamplingStates, draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
    ) -> None:
        """Writes the sampled rows' k drafts into draft_tokens[state row] (int64 [R, k])
        and, for random rows, q into draft_probs[state row] (float64 [R, k, V])."""
        n = batch.num_reqs
        sampled = np.flatnonzero(is_sampled_np)
        if sampled.size == 0:
            return
        m = int(sampled.size)
        hidden, last_idx, positions, sel = self._catch_up(
            batch, is_sampled_np, sampled, req_states, block_table)
        last = last_idx.index_select(0, sel)
        rows = batch.idx_mapping[:n].index_select(0, sel)
        want_probs = draft_probs is not None
        temperature = seeds = None
        if want_probs:  # greedy drafts are an argmax: no temperature, no noise
            temperature = states.temperature.index_select(0, rows)
            seeds = states.seeds.index_select(0, rows)
        # the position of each proposal's first draft input: every draft's noise key
        first = positions.index_select(0, last)
        logits = self.executor.compute_logits(hidden.index_select(0, last))
        tokens, q = sample_draft(logits, temperature, seeds, first, 0, want_probs,
                                 all_greedy=not want_probs)
        rows_long = rows.long()
        drafts = torch.empty((self.k, m), dtype=torch.int64, device=self.device)
        drafts[0] = tokens
        self._store_probs(draft_probs, rows_long, 0, q)
        # the sampled rows' block tables, gathered once for the k - 1 forwards (after the
        # catch-up: its FULL graph may read the same persistent rows)
        tables = self._metadata_rows(m, torch.int32, batch.block_table.shape[1])
        torch.index_select(batch.block_table, 0, sel, out=tables)
        pos = first
        for i in range(1, self.k):  # draft positions, not tokens: k <= 16
            hidden, pos = self._decode_forward(rows, pos, drafts[i - 1], tables, block_table, m)
            logits = self.executor.compute_logits(hidden)
            drafts[i], q = sample_draft(logits, temperature, seeds, first, i, want_probs,
                                        all_greedy=not want_probs)
            self._store_probs(draft_probs, rows_long, i, q)
        draft_tokens[rows_long] = drafts.t()  # one scatter for the k drafts

    @staticmethod
    def _store_probs(draft_probs, rows_long, i, q) -> None:
        # one [m, V] row block per draft (stacking all k first would double the largest
        # tensor of the step)
        if draft_probs is not None and q is not None:
            draft_probs[rows_long, i] = q

    def _catch_up(self, batch: InputBatch, is_sampled_np: np.ndarray, sampled: np.ndarray,
                  req_states: RequestState, block_table: torch.Tensor):
        """The catch-up forward. -> (hidden states, each row's last real token, the
        positions, the sampled rows' batch indices on the device)."""
        n = batch.num_reqs
        qlen = batch.num_scheduled_tokens_np.astype(np.int64)
        lengths = qlen + is_sampled_np.astype(np.int64)
        qsl = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths, out=qsl[1:])
        total = int(qsl[-1])
        fwd = self.draft_forward
        if total > fwd.max_num_tokens:
            raise ValueError(f"draft catch-up of {total} tokens exceeds its {fwd.max_num_tokens}")
        dev = self.device
        # written in place: the forward's persistent buffers (no copy into them)
        ids, positions, slots = fwd.input_ids[:total], fwd.positions[:total], fwd.slot_mapping[:total]
        last_idx = torch.empty(n, dtype=torch.int64, device=dev)
        seq_lens = self._metadata_rows(n, torch.int32)
        # pinned staging, non_blocking, one copy for both: a pageable copy would wait for
        # the whole verify step on the stream and serialise the draft's launches behind it
        qsl_dev, sel = copy_packed_to_device([qsl, sampled], dev)
        at = req_states.all_token_ids.gpu
        kept(_catch_up_inputs_kernel)((n,),
            batch.idx_mapping, batch.seq_lens, batch.query_start_loc, qsl_dev,
            req_states.total_len.gpu, at, at.stride(0),
            block_table, block_table.stride(0), self.block_size, self.max_model_len,
            ids, positions, slots, last_idx, seq_lens, BLOCK=_BLOCK,
        )  # fmt: skip
        # the device's seq_lens are exact; the host's, from the scheduler's num_computed,
        # are an upper bound under async scheduling (it counts every draft as accepted)
        seq_lens_np = (batch.seq_lens_np[:n] - qlen + lengths).astype(np.int32)
        seq_lens_cpu = seq_lens.cpu() if self.needs_host_seq_lens else torch.from_numpy(seq_lens_np)
        num_decodes = count_leading_decodes(lengths)
        md = CommonAttentionMetadata(
            query_start_loc=qsl_dev, seq_lens=seq_lens, block_table=batch.block_table[:n],
            slot_mapping=slots, num_reqs=n, num_actual_tokens=total,
            max_query_len=int(lengths.max()), max_seq_len=int(seq_lens_np.max()),
            num_decodes=num_decodes, num_prefills=n - num_decodes, num_decode_tokens=num_decodes,
            block_size=self.block_size, query_start_loc_cpu=torch.from_numpy(qsl),
            seq_lens_cpu=seq_lens_cpu,
        )
        self._max_seq_len = min(self.max_model_len, int(seq_lens_np.max()) + self.k)
        hidden = fwd(ids, positions, slots, md)
        return hidden, last_idx, positions, sel

    def _decode_forward(self, rows, prev_pos, tokens, tables, block_table, n: int):
        fwd = self.draft_forward
        # written in place: the forward's persistent buffers (the kernel reads prev_pos[s]
        # before it writes positions[s], so prev_pos may be this very view)
        ids, positions, slots = fwd.input_ids[:n], fwd.positions[:n], fwd.slot_mapping[:n]
        seq_lens = self._metadata_rows(n, torch.int32)
        kept(_decode_inputs_kernel)((n,),
            rows, prev_pos, tokens, block_table, block_table.stride(0), self.block_size,
            self.max_model_len, ids, positions, slots, seq_lens,
        )  # fmt: skip
        md = CommonAttentionMetadata(
            query_start_loc=self._arange(n + 1), seq_lens=seq_lens,
            block_table=tables, slot_mapping=slots, num_reqs=n, num_actual_tokens=n,
            max_query_len=1, max_seq_len=self._max_seq_len, num_decodes=n, num_prefills=0,
            num_decode_tokens=n, block_size=self.block_size,
            query_start_loc_cpu=self._arange_cpu[: n + 1],
            seq_lens_cpu=seq_lens.cpu() if self.needs_host_seq_lens else None,
        )
        return fwd(ids, positions, slots, md), positions
