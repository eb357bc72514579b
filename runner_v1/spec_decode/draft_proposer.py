"""V1's draft_model proposer: a second, smaller model (shared/runtime/draft_executor.py,
the target's KV block layout) proposes up to k tokens per request after every step.

Stateless about draft progress. The invariant: at the start of a step the draft's KV is
valid at every position below the target's num_computed_tokens. After the step's
accepted tokens are in the token table, one catch-up forward feeds each scheduled row
the positions [num_computed_before, known), known = min(num_tokens, num_computed_before
+ num_scheduled + 1): a partial prefill its chunk; a row that sampled its chunk or decode
token, its accepted drafts and the target's own new token. That rewrites whatever the
rejected drafts left in the draft KV (and, redundantly, the last position the previous
catch-up wrote), so nothing about earlier proposals needs remembering and the invariant
holds again for the next step. The rows that sampled then draw draft 1 from their last
catch-up logit and drafts 2..k from k - 1 single-token forwards.

Caps. A row proposes at most min(k, max_model_len - known - 1) drafts: the scheduler
verifies d drafts at positions known .. known + d - 1 and the target's own token lands
at known + d, which must stay below max_model_len. The forwards write draft KV at
positions known - 1 .. known + cap - 2, so a row also proposes no more than its
allocated blocks hold (a new request's last prefill chunk gets no lookahead slots from
the scheduler: its new token's slot may lie in a block it does not own yet). KV past
the allocated blocks is never written: the catch-up itself is cut there.

The draft distributions q (float64 [drafts, V]; None for greedy rows, whose drafts are
an argmax) wait here, keyed by request, until the next step's rejection sampler asks
for them (draft_probs_for_step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from policy.config import EngineConfig
from policy.model_config import ModelConfig
from runner_v1.block_table import BlockTable
from runner_v1.buffers import CpuGpuBuffer
from runner_v1.persistent_batch import PersistentBatch
from runner_v1.prepare_inputs import fill_query_start_loc, gather_input_ids
from runner_v1.sampling_metadata import SamplingMetadata
from runner_v1.spec_decode.metadata import ragged_arange, to_device
from shared.attention.metadata import PAD_SLOT_ID, CommonAttentionMetadata, count_leading_decodes
from shared.runtime.draft_executor import DraftForward, make_draft_executor
from shared.runtime.draft_graphs import draft_graph_config
from shared.sampling.draft_sampling import sample_draft


@dataclass
class _DraftStepBatch:
    """One draft forward's ragged batch, under the StepBatch names (for_batch reads them)."""

    query_start_loc: torch.Tensor  # int32 [R + 1], device
    seq_lens: torch.Tensor  # int32 [R], device
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_decode_tokens: int


@dataclass
class _Proposal:
    """One request's drafts, kept until its next step verifies them (device views)."""

    tokens: torch.Tensor  # int64 [num_drafts]
    probs: torch.Tensor | None  # float64 [num_drafts, V]; None for a greedy row


class _DraftBuffers:
    """The proposer's own host/device buffers. The catch-up may hold up to
    max_num_batched_tokens + max_num_seqs tokens (each sampled row adds its new token),
    more than the runner's input buffers take."""

    def __init__(self, max_num_reqs: int, max_tokens: int, k: int, device: torch.device) -> None:
        T, R = max_tokens, max_num_reqs
        self.input_ids = CpuGpuBuffer(T, dtype=torch.int32, device=device)
        self.positions = CpuGpuBuffer(T, dtype=torch.int64, device=device)
        self.slot_mapping = CpuGpuBuffer(T, dtype=torch.int64, device=device)
        self.query_start_loc = CpuGpuBuffer(R + 1, dtype=torch.int32, device=device)
        self.seq_lens = CpuGpuBuffer(R, dtype=torch.int32, device=device)
        # The proposing rows, their last catch-up token, and per draft i (row i of each
        # grid) the position of the token draft i + 1 is sampled from: known - 1 + i.
        # Row 0 is the catch-up's last token; rows 1 .. k - 1 are the single-token forwards.
        self.rows = CpuGpuBuffer(R, dtype=torch.int64, device=device)
        self.last_token = CpuGpuBuffer(R, dtype=torch.int64, device=device)
        self.step_positions = CpuGpuBuffer(k, R, dtype=torch.int64, device=device)
        self.step_seq_lens = CpuGpuBuffer(k, R, dtype=torch.int32, device=device)
        self.step_slots = CpuGpuBuffer(k, R, dtype=torch.int64, device=device)
        # query_start_loc of m one-token rows: arange(m + 1)
        self.arange_cpu = torch.arange(R + 1, dtype=torch.int32)
        self.arange = self.arange_cpu.to(device)


class V1DraftProposer:
    """draft_model proposals for V1. The runner calls, per step: draft_probs_for_step
    (before rejection sampling), propose (after the accepted tokens are appended),
    remove (finished / preempted requests), reset (recovery)."""

    def __init__(
        self, config: EngineConfig, draft_model_config: ModelConfig, num_speculative_tokens: int,
        device: torch.device,
    ) -> None:
        target = config.model_config
        sc = config.scheduler_config
        if draft_model_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocab_size={draft_model_config.vocab_size} differs from the "
                f"target's {target.vocab_size}; a draft model must share the target's vocabulary")
        max_pos = draft_model_config.max_position_embeddings
        if max_pos is not None and max_pos < sc.max_model_len:
            raise ValueError(
                f"the draft model's max_position_embeddings={max_pos} is below max_model_len="
                f"{sc.max_model_len}; accepted: max_model_len <= {max_pos}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1")
        self.k = num_speculative_tokens
        self.device = torch.device(device)
        self.max_model_len = sc.max_model_len
        self.max_num_reqs = sc.max_num_seqs
        self.max_catch_up_tokens = sc.max_num_batched_tokens + sc.max_num_seqs
        self.block_size = config.cache_config.block_size
        self.vocab_size = target.vocab_size
        self.executor = make_draft_executor(config, draft_model_config, self.device)
        graphs = draft_graph_config(
            config, self.device.type == "cuda", self.executor.backend,
            v1_full_query_lens(self.k), self.max_catch_up_tokens)
        self.draft_forward = DraftForward(
            self.executor, self.max_catch_up_tokens, graphs, self.device)
        self.buffers = _DraftBuffers(self.max_num_reqs, self.max_catch_up_tokens, self.k, self.device)
        self._proposals: dict[str, _Proposal] = {}
        # The host buffers are rewritten next step: the copies out of them must be done.
        self._copies_done = torch.cuda.Event() if self.device.type == "cuda" else None

    # ---- set-up ---------------------------------------------------------------------
    def load_model(self) -> None:
        self.executor.load_model()

    def kv_bytes_per_block(self) -> int:
        """The draft's KV per block (after load_model): the target's determine_num_blocks
        takes it as extra_bytes_per_block, since both caches have num_blocks blocks."""
        return self.executor.kv_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.executor.initialize_kv_cache(num_blocks)

    @torch.no_grad()
    def profile_run(self, then: Callable[[], None] | None = None) -> None:
        """The draft's largest forward and sampling (a full catch-up, q of a full batch),
        without attention metadata, so no KV is touched. q of every row's k drafts stays
        alive from one step to the next, next to the step's flat copy of it: that much
        is held while `then` (the target's profile forward) runs."""
        R, T, V = self.max_num_reqs, self.max_catch_up_tokens, self.vocab_size
        held = torch.empty((2, R, self.k, V), dtype=torch.float64, device=self.device)
        ids = torch.zeros(T, dtype=torch.int32, device=self.device)
        pos = torch.arange(T, dtype=torch.int64, device=self.device) % 16
        hidden = self.executor.forward(ids, pos, None, T)
        logits = self.executor.compute_logits(hidden[:R])
        ones = torch.ones(R, dtype=torch.float32, device=self.device)
        zeros = torch.zeros(R, dtype=torch.int64, device=self.device)
        sample_draft(logits, ones, zeros, zeros, 0)
        del hidden, logits
        if then is not None:
            then()
        del held

    # ---- request lifetime -----------------------------------------------------------
    def remove(self, req_id: str) -> None:
        """A finished or preempted request: its drafts will never be verified."""
        self._proposals.pop(req_id, None)

    def reset(self) -> None:
        self._proposals.clear()

    # ---- before rejection sampling -----------------------------------------------------
    def draft_probs_for_step(
        self, req_ids: Sequence[str], num_draft_tokens: np.ndarray
    ) -> torch.Tensor | None:
        """q of this step's drafts, float64 [sum drafts, V], rows in batch-row order, each
        request's first num_draft_tokens[row] (the scheduler may trim the tail of a
        proposal, never its head). A greedy row gets one-hot rows at its draft tokens so
        the tensor is defined everywhere. None when no drafted row samples randomly."""
        rows = np.flatnonzero(num_draft_tokens)
        counts = num_draft_tokens[rows].astype(np.int64)
        props = []
        for row, count in zip(rows.tolist(), counts.tolist()):  # per drafted request
            p = self._proposals.get(req_ids[row])
            if p is None or count > p.tokens.shape[0]:
                have = 0 if p is None else p.tokens.shape[0]
                raise RuntimeError(
                    f"request {req_ids[row]!r} is scheduled with {count} drafts but the draft "
                    f"proposer holds {have} for it: the scheduler and the runner disagree")
            props.append(p)
        is_random = np.array([p.probs is not None for p in props], dtype=bool)
        if not is_random.any():
            return None
        starts = np.cumsum(counts) - counts

        def flat_rows(sel: np.ndarray) -> torch.Tensor:  # the out rows of these requests
            flat = np.repeat(starts[sel], counts[sel]) + ragged_arange(counts[sel])
            return to_device(flat, self.device)  # pinned, non_blocking: no wait for the verify

        out = torch.zeros((int(counts.sum()), self.vocab_size), dtype=torch.float64,
                          device=self.device)
        random_rows = np.flatnonzero(is_random).tolist()
        out[flat_rows(is_random)] = torch.cat([props[i].probs[: counts[i]] for i in random_rows])
        greedy_rows = np.flatnonzero(~is_random).tolist()
        if greedy_rows:
            tokens = torch.cat([props[i].tokens[: counts[i]] for i in greedy_rows])
            out[flat_rows(~is_random), tokens] = 1.0
        return out

    # ---- after the step -------------------------------------------------------------
    @torch.no_grad()
    def propose(
        self, batch: PersistentBatch, num_scheduled: np.ndarray, sampled_rows: np.ndarray,
        metadata: SamplingMetadata,
    ) -> list[list[int]]:
        """Catch the draft up on this step's tokens and propose for `sampled_rows`.

        Called with the accepted tokens appended to the token table while
        batch.num_computed_tokens still holds the values from before this step, and the
        device block table as this step committed it. num_scheduled: int [num_reqs],
        this step's query lengths (drafts included). Returns the drafts of each sampled
        row, in the order of sampled_rows ([] where a cap leaves none)."""
        n = batch.num_reqs
        if self._copies_done is not None:
            self._copies_done.synchronize()
        for row in sampled_rows.tolist():  # their old drafts were verified this step
            self._proposals.pop(batch.req_ids[row], None)
        if n == 0:
            return [[] for _ in sampled_rows.tolist()]
        start = batch.num_computed_tokens[:n].astype(np.int64)
        scheduled = num_scheduled[:n].astype(np.int64)
        known = np.where(
            scheduled > 0, np.minimum(batch.num_tokens[:n], start + scheduled + 1), start)
        allocated = batch.block_table.num_blocks_per_row[:n].astype(np.int64) * self.block_size
        hidden, cu = self._catch_up(batch, start, np.minimum(known, allocated))

        rows = sampled_rows.astype(np.int64)
        known_rows = known[rows]
        caps = np.minimum(self.k, np.minimum(self.max_model_len - known_rows - 1,
                                             allocated[rows] - known_rows + 1))
        # Largest cap first: at draft forward i the rows still drafting are a prefix.
        order = np.argsort(-caps, kind="stable")
        order = order[caps[order] > 0]
        drafts_by_row: dict[int, list[int]] = {}
        if order.size and hidden is not None:
            drafts_by_row = self._draft(
                batch, hidden, cu, rows[order], known_rows[order], caps[order], metadata)
        if self._copies_done is not None:
            self._copies_done.record()
        return [drafts_by_row.get(row, []) for row in rows.tolist()]

    def _catch_up(
        self, batch: PersistentBatch, start: np.ndarray, end: np.ndarray
    ) -> tuple[torch.Tensor | None, np.ndarray]:
        """One forward over every row's positions [start, end): the tokens from the host
        token table, slots from the host block table. -> (hidden states, cu tokens)."""
        n = start.shape[0]
        b = self.buffers
        lens = np.maximum(end - start, 0)
        cu = np.cumsum(lens)
        total = int(cu[-1])
        if total > self.max_catch_up_tokens:
            raise RuntimeError(
                f"draft catch-up of {total} tokens exceeds max_num_batched_tokens + "
                f"max_num_seqs = {self.max_catch_up_tokens}")
        if total == 0:
            return None, cu
        req_idx = np.repeat(np.arange(n, dtype=np.int64), lens)
        positions = b.positions.np[:total]
        np.add(np.repeat(start, lens), ragged_arange(lens), out=positions)
        gather_input_ids(batch.token_ids_cpu, req_idx, positions, b.input_ids.cpu[:total])
        fill_slots(batch.block_table, req_idx, positions, b.slot_mapping.np[:total])
        fill_query_start_loc(cu, b.query_start_loc.np[: n + 1])
        b.seq_lens.np[:n] = end
        num_decodes = count_leading_decodes(lens)
        step = _DraftStepBatch(
            query_start_loc=b.query_start_loc.copy_to_gpu(n + 1),
            seq_lens=b.seq_lens.copy_to_gpu(n),
            num_reqs=n, num_tokens=total, max_query_len=int(lens.max()),
            max_seq_len=int(end.max()), num_decodes=num_decodes, num_decode_tokens=num_decodes,
        )
        hidden = self._forward(
            step, b.input_ids.copy_to_gpu(total), b.positions.copy_to_gpu(total),
            batch.block_table.block_table.gpu[:n], b.slot_mapping.copy_to_gpu(total),
            b.query_start_loc.cpu[: n + 1], b.seq_lens.cpu[:n],
        )
        return hidden, cu

    def _draft(
        self, batch: PersistentBatch, hidden: torch.Tensor, cu: np.ndarray, rows: np.ndarray,
        known: np.ndarray, caps: np.ndarray, metadata: SamplingMetadata,
    ) -> dict[int, list[int]]:
        """Draft 1 from each row's last catch-up logit, drafts 2..cap from single-token
        forwards; rows sorted by cap, descending. Keeps the proposals; -> row -> drafts."""
        n, steps, b = rows.shape[0], int(caps[0]), self.buffers
        b.rows.np[:n] = rows
        b.last_token.np[:n] = cu[rows] - 1
        grid = np.arange(steps, dtype=np.int64)[:, None]
        positions = b.step_positions.np[:steps, :n]
        np.add(known[None, :] - 1, grid, out=positions)  # draft i + 1 samples at known - 1 + i
        b.step_seq_lens.np[:steps, :n] = positions + 1
        slots = b.step_slots.np[:steps, :n]
        fill_slots(batch.block_table, np.broadcast_to(rows, positions.shape),
                   np.minimum(positions, self.max_model_len - 1), slots)
        slots[grid >= caps[None, :]] = PAD_SLOT_ID  # forward i runs only where cap > i
        rows_dev = b.rows.copy_to_gpu(n)
        positions_dev = b.step_positions.copy_to_gpu(steps)
        seq_lens_dev = b.step_seq_lens.copy_to_gpu(steps)
        slots_dev = b.step_slots.copy_to_gpu(steps)
        temperature = seeds = None  # greedy drafts are an argmax: neither is read
        if not metadata.all_greedy:
            temperature = metadata.temperature[rows_dev]
            seeds = metadata.seeds[rows_dev]
        # gathered once for the k - 1 forwards, into the draft's persistent FULL-graph
        # rows where it has them (after the catch-up, whose FULL graph reads them too)
        block_table = self._table_rows(batch.block_table.block_table.gpu, rows_dev, n)

        logits = self.executor.compute_logits(hidden[b.last_token.copy_to_gpu(n)])
        tokens, q = sample_draft(logits, temperature, seeds, positions_dev[0, :n], 0,
                                 all_greedy=metadata.all_greedy)
        drafts = torch.empty((steps, n), dtype=torch.int64, device=self.device)
        drafts[0] = tokens
        probs = None  # [n, steps, V]; never allocated when every proposing row is greedy
        if q is not None:
            probs = torch.empty((n, steps, self.vocab_size), dtype=torch.float64, device=self.device)
            probs[:, 0] = q
        for i in range(1, steps):  # <= k - 1 forwards, each vectorised over its rows
            m = int(np.count_nonzero(caps > i))
            step = _DraftStepBatch(
                query_start_loc=b.arange[: m + 1], seq_lens=seq_lens_dev[i, :m], num_reqs=m,
                num_tokens=m, max_query_len=1, max_seq_len=int(known[:m].max()) + i,
                num_decodes=m, num_decode_tokens=m,
            )
            hidden_i = self._forward(
                step, drafts[i - 1, :m], positions_dev[i, :m], block_table[:m],
                slots_dev[i, :m], b.arange_cpu[: m + 1], b.step_seq_lens.cpu[i, :m],
            )
            logits = self.executor.compute_logits(hidden_i)
            tokens, q = sample_draft(logits, _head(temperature, m), _head(seeds, m),
                                     positions_dev[0, :m], i, all_greedy=metadata.all_greedy)
            drafts[i, :m] = tokens
            if q is not None and probs is not None:
                probs[:m, i] = q
        per_row = drafts.t().tolist()  # the proposer's one sync; [n][steps]
        greedy = batch.temperature.np[rows] == 0
        out: dict[int, list[int]] = {}
        for j, (row, cap) in enumerate(zip(rows.tolist(), caps.tolist())):  # per request
            self._proposals[batch.req_ids[row]] = _Proposal(
                drafts[:cap, j], None if probs is None or greedy[j] else probs[j, :cap])
            out[row] = per_row[j][:cap]
        return out

    def _table_rows(self, table: torch.Tensor, rows_dev: torch.Tensor, n: int) -> torch.Tensor:
        """table[rows] (int32 [n, max_blocks]), written into the draft's persistent FULL-
        graph block table when it has n rows (its staging then copies nothing)."""
        full = self.draft_forward.full
        if full is None or n > full.block_table.shape[0]:
            return table.index_select(0, rows_dev)
        return torch.index_select(table, 0, rows_dev, out=full.block_table[:n])

    def _forward(
        self, step: _DraftStepBatch, input_ids: torch.Tensor, positions: torch.Tensor,
        block_table: torch.Tensor, slot_mapping: torch.Tensor, query_start_loc_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
    ) -> torch.Tensor:
        common = CommonAttentionMetadata.for_batch(
            step, block_table, slot_mapping, self.block_size,
            query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu,
        )
        return self.draft_forward(input_ids, positions, slot_mapping, common)

    def capture(self, pool) -> None:
        """The draft model's graphs, FULL and piecewise (after the target's, in its pool)."""
        self.draft_forward.capture(pool)


# A V1 catch-up feeds a row its accepted drafts + 2 tokens: uniform (one q for every row)
# when the rows accepted alike, which at batch 1 is every step, rarely at large batches.
# FULL catch-up graphs for q in 2..k + 2 are captured up to this many requests only.
CATCH_UP_FULL_MAX_REQS = 4


def v1_full_query_lens(k: int) -> dict[int, int]:
    """The uniform query lengths V1's draft captures FULL graphs for (q -> the most
    requests): its single-token forwards at every size, its catch-ups at small batches."""
    lens = dict.fromkeys(range(2, k + 3), CATCH_UP_FULL_MAX_REQS)
    lens[1] = 1 << 30
    return lens


def _head(t: torch.Tensor | None, m: int) -> torch.Tensor | None:
    return None if t is None else t[:m]


def fill_slots(
    table: BlockTable, rows: np.ndarray, positions: np.ndarray, out: np.ndarray
) -> None:
    """out = block_table[row, pos // block_size] * block_size + pos % block_size from the
    host table (BlockTable.compute_slot_mapping's rule, into a buffer of the caller's:
    the draft's batches are larger than its slot buffer). Any matching shapes."""
    bs = table.block_size
    flat = rows.astype(np.int64) * table.max_num_blocks_per_req + positions // bs
    # int64 arithmetic: block number * block_size may pass int32 on a large cache.
    np.multiply(table.np.reshape(-1)[flat], np.int64(bs), out=out)
    out += positions % bs
