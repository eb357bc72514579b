"""V1's draft_model proposer: a second, smaller model (shared/runtime/draft_executor.py,
the target's KV block layout) proposes up to k tokens per request after every step.

Stateless about draft progress. The invariant: at the start of a step the draft's KV is
valid at every position below the target's num_computed_tokens. Right after the step's
sampling (launch), before its tokens reach the host, one catch-up forward feeds each
scheduled row the positions [num_computed_before, num_computed_before + num_scheduled
(+ 1 for a row that sampled)): a partial prefill its chunk; a row that sampled its
query, the target's new token placed on the device after the accepted drafts
(runner_v1/spec_decode/draft_inputs.py). That rewrites whatever the rejected drafts left
in the draft KV, so nothing about earlier proposals needs remembering and the invariant
holds again for the next step. The rows that sampled then draw draft 1 from their new
token's logit and drafts 2..k from k - 1 single-token forwards, all enqueued without a
wait: the step's one sync (the runner's, for its tokens) finds the drafts done, and
collect() hands them out. vLLM's V1 proposers prepare their padded batches on the device
the same way, so that the draft runs behind the verify with no host round trip.

Caps (known: num_tokens with the step's accepted run appended). A row proposes at most
min(k, max_model_len - known - 1) drafts: the scheduler
verifies d drafts at positions known .. known + d - 1 and the target's own token lands
at known + d, which must stay below max_model_len. The forwards write draft KV at
positions known - 1 .. known + cap - 2, so a row also proposes no more than its
allocated blocks hold (a new request's last prefill chunk gets no lookahead slots from
the scheduler: its new token's slot may lie in a block it does not own yet). KV past
the allocated blocks is never written: the catch-up itself is cut there. The launch
only has an upper bound of each cap (no draft accepted); collect() trims to the cap.

The drafts and their distributions q (float64 [drafts, V]; None for greedy rows, whose
drafts are an argmax) wait in runner_v1/spec_decode/proposals.py, keyed by request, until
the next step's input prep and rejection sampler ask for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from policy.config import EngineConfig
from policy.model_config import ModelConfig
from runner_v1.persistent_batch import PersistentBatch
from runner_v1.sampling_metadata import SamplingMetadata
from runner_v1.spec_decode.draft_inputs import (
    CatchUpLayout,
    StepTokens,
    catch_up_inputs,
    catch_up_layout,
    catch_up_sources,
    draft_decode_inputs,
    place_new_tokens,
    v1_full_query_lens,
)
from runner_v1.spec_decode.proposals import DraftProposals
from shared.attention.metadata import CommonAttentionMetadata, count_leading_decodes
from shared.runtime.draft_executor import DraftForward, make_draft_executor
from shared.runtime.draft_graphs import draft_graph_config
from shared.runtime.host_buffers import copy_packed_to_device
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


class _DraftBuffers:
    """The proposer's own device buffers. The catch-up may hold up to
    max_num_batched_tokens + max_num_seqs tokens (each sampled row adds its new token),
    more than the runner's input buffers take."""

    def __init__(self, max_num_reqs: int, max_tokens: int, device: torch.device) -> None:
        # one entry more than a catch-up can use: place_new_tokens' scratch slot
        self.input_ids = torch.zeros(max_tokens + 1, dtype=torch.int32, device=device)
        # query_start_loc of m one-token rows: arange(m + 1)
        self.arange_cpu = torch.arange(max_num_reqs + 1, dtype=torch.int32)
        self.arange = self.arange_cpu.to(device)


@dataclass
class _Launched:
    """A step's drafts, launched and not yet read (collect() trims them to the caps)."""

    rows: np.ndarray  # int64 [n]: the proposing batch rows, upper-bound cap descending
    drafts: torch.Tensor  # int64 [steps, n]


class V1DraftProposer:
    """draft_model proposals for V1. The runner calls, per step: draft_probs_for_step
    (before rejection sampling), launch (right after sampling), collect (after the
    accepted tokens are appended), remove (finished / preempted requests), reset
    (recovery)."""

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
        # no sync between steps to trim proposals on: every sampled row drafts k
        self.async_scheduling = sc.async_scheduling
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
        self.buffers = _DraftBuffers(self.max_num_reqs, self.max_catch_up_tokens, self.device)
        self.proposals = DraftProposals(self.vocab_size, self.device)
        self._pending: _Launched | None = None
        # the TORCH backend reads exact host seq_lens, which the draft forwards after the
        # catch-up only have on the device
        self.needs_host_seq_lens = config.attention_backend == "TORCH"

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
        self.proposals.remove(req_id)

    def reset(self) -> None:
        self.proposals.clear()
        self._pending = None

    # ---- before rejection sampling: the proposals' views --------------------------------
    def draft_probs_for_step(
        self, req_ids: Sequence[str], num_draft_tokens: np.ndarray
    ) -> torch.Tensor | None:
        return self.proposals.probs_for_step(req_ids, num_draft_tokens)

    def draft_tokens_for_step(
        self, req_ids: Sequence[str], num_draft_tokens: np.ndarray
    ) -> torch.Tensor:
        return self.proposals.tokens_for_step(req_ids, num_draft_tokens)

    # ---- after sampling, before the step's tokens reach the host -------------------------
    @torch.no_grad()
    def launch(
        self, batch: PersistentBatch, step: StepTokens, num_scheduled: np.ndarray,
        new_tokens: torch.Tensor, num_new: torch.Tensor | None, metadata: SamplingMetadata,
    ) -> None:
        """Enqueue the catch-up and the draft forwards right behind the step's sampling,
        without waiting for it (draft_inputs.py has the layout).

        Called before the step's tokens are in the token table (num_tokens and
        num_computed_tokens are from before the step: the scheduler's, which count the
        previous step's drafts as accepted under async scheduling), with the device
        block table as this step committed it. step: the step's query on the device;
        num_scheduled: int [N], its query lengths; new_tokens / num_new: the step's
        sampled tokens on the device (place_new_tokens). The proposals are kept at once
        (each its upper-bound cap); collect() trims them once the step's tokens are on
        the host, under the synchronous loop."""
        n = batch.num_reqs
        self._pending = None
        if n == 0:
            return
        start = batch.num_computed_tokens[:n].astype(np.int64)
        known = batch.num_tokens[:n].astype(np.int64)
        scheduled = num_scheduled[:n].astype(np.int64)
        allocated = batch.block_table.num_blocks_per_row[:n].astype(np.int64) * self.block_size
        layout = catch_up_layout(start, scheduled, known, allocated)
        for row in np.flatnonzero(layout.sampled).tolist():  # verified this step
            self.proposals.remove(batch.req_ids[row])
        if layout.total == 0:
            return
        if layout.total > self.max_catch_up_tokens:
            raise RuntimeError(
                f"draft catch-up of {layout.total} tokens exceeds max_num_batched_tokens + "
                f"max_num_seqs = {self.max_catch_up_tokens}")
        # Each proposing row drafts at most this many (its new token at the earliest,
        # known); collect() trims to the exact cap. Under async scheduling nothing trims
        # on the host: every sampled row drafts k (the scheduler trims what it verifies).
        cap_hi = np.minimum(self.k, np.minimum(self.max_model_len - known - 2, allocated - known))
        if self.async_scheduling:
            cap_hi = np.full(n, self.k, dtype=np.int64)
        rows = np.flatnonzero(layout.sampled & (cap_hi > 0))
        # Largest cap first: at draft forward i the rows still drafting are a prefix.
        rows = rows[np.argsort(-cap_hi[rows], kind="stable")]
        src, extra, req = catch_up_sources(layout, step.query_start_loc, scheduled)
        # one pinned copy, fresh (no barrier: the host may change its arrays at once)
        qsl = np.zeros(n + 1, dtype=np.int32)
        qsl[1:] = layout.cu
        (src, extra, req, row_start, new_rel, limit, lens_delta, rows_dev, row_limit, qsl_dev,
         ) = copy_packed_to_device([
            src, extra, req, layout.cu - layout.lens, layout.new_rel,
            np.where(layout.sampled, layout.lens, 0), layout.lens - scheduled, rows,
            np.minimum(allocated[rows], self.max_model_len), qsl], self.device)
        hidden, positions, new_rel, placed = self._catch_up(
            batch, step, layout, (src, extra, req, lens_delta), (qsl, qsl_dev),
            new_tokens, num_new, (row_start, new_rel, limit))
        if rows.size:
            # each proposing row's new token (or, where it did not fit, its last token)
            new_index = torch.where(placed, row_start + new_rel, row_start + limit - 1)
            new_index = new_index.index_select(0, rows_dev)
            self._pending = self._draft(
                batch, hidden.index_select(0, new_index), positions.index_select(0, new_index),
                rows, rows_dev, row_limit, cap_hi[rows], start[rows] + scheduled[rows],
                metadata)

    # ---- after the step's tokens are in the token table -------------------------------
    def collect(self, batch: PersistentBatch, sampled_rows: np.ndarray) -> list[list[int]]:
        """The launched drafts of `sampled_rows` (in their order), each trimmed to its
        cap: min(k, max_model_len - known - 1, allocated - known + 1) with known the
        row's num_tokens, now that the step's accepted run is appended ([] where a cap
        leaves none); a trimmed proposal keeps only what is handed out."""
        pending, self._pending = self._pending, None
        if pending is None:
            return [[] for _ in sampled_rows.tolist()]
        known = batch.num_tokens[pending.rows].astype(np.int64)
        allocated = (batch.block_table.num_blocks_per_row[pending.rows].astype(np.int64)
                     * self.block_size)
        caps = np.minimum(self.k, np.minimum(self.max_model_len - known - 1,
                                             allocated - known + 1))
        per_row = pending.drafts.t().tolist()  # the step has synced already: [n][steps]
        out: dict[int, list[int]] = {}
        for j, (row, cap) in enumerate(zip(pending.rows.tolist(), caps.tolist())):
            self.proposals.trim(batch.req_ids[row], cap)
            if cap > 0:
                out[row] = per_row[j][:cap]
        return [out.get(row, []) for row in sampled_rows.tolist()]

    def _catch_up(
        self, batch: PersistentBatch, step: StepTokens, layout: CatchUpLayout,
        sources: tuple[torch.Tensor, ...], qsl: tuple[np.ndarray, torch.Tensor],
        new_tokens: torch.Tensor,
        num_new: torch.Tensor | None, placement: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward over every row's layout, its inputs gathered on the device from the
        step's (catch_up_inputs), the new tokens placed (place_new_tokens). -> (hidden
        states, the catch-up's positions, each row's new-token index in its row, whether
        it was placed)."""
        n, total = layout.lens.shape[0], layout.total
        src, extra, req, lens_delta = sources
        ids = self.buffers.input_ids
        positions, slots = catch_up_inputs(
            step, src, extra, req, batch.block_table.block_table.gpu, self.block_size, ids)
        # ids' last entry is the scratch slot: a catch-up never reaches it
        new_rel, placed = place_new_tokens(ids, ids.shape[0] - 1, new_tokens, num_new, *placement)
        seq_lens = step.seq_lens[:n] + lens_delta.to(torch.int32)
        # the host's lengths: exact, or an upper bound while the previous step is in flight
        end = layout.seq_lens
        num_decodes = count_leading_decodes(layout.lens)
        batch_desc = _DraftStepBatch(
            query_start_loc=qsl[1], seq_lens=seq_lens, num_reqs=n, num_tokens=total,
            max_query_len=int(layout.lens.max()), max_seq_len=int(end.max()),
            num_decodes=num_decodes, num_decode_tokens=num_decodes,
        )
        host_lens = (seq_lens.cpu() if self.needs_host_seq_lens
                     else torch.from_numpy(end.astype(np.int32)))
        hidden = self._forward(
            batch_desc, ids[:total], positions, batch.block_table.block_table.gpu[:n], slots,
            torch.from_numpy(qsl[0]), host_lens)
        return hidden, positions, new_rel, placed

    def _draft(
        self, batch: PersistentBatch, hidden: torch.Tensor, new_pos: torch.Tensor,
        rows: np.ndarray, rows_dev: torch.Tensor, limit: torch.Tensor, caps: np.ndarray,
        max_known: np.ndarray, metadata: SamplingMetadata,
    ) -> _Launched:
        """Draft 1 from each proposing row's new-token logit, drafts 2..cap from single-
        token forwards; rows sorted by cap (an upper bound), descending. hidden: the new
        tokens' hidden states; new_pos: their positions (device); max_known: each row's
        known count were every draft accepted (a bound for the metadata's max_seq_len)."""
        n, steps = rows.shape[0], int(caps[0])
        temperature = seeds = None  # greedy drafts are an argmax: neither is read
        if not metadata.all_greedy:
            temperature = metadata.temperature[rows_dev]
            seeds = metadata.seeds[rows_dev]
        logits = self.executor.compute_logits(hidden)
        tokens, q = sample_draft(logits, temperature, seeds, new_pos, 0,
                                 all_greedy=metadata.all_greedy)
        drafts = torch.empty((steps, n), dtype=torch.int64, device=self.device)
        drafts[0] = tokens
        probs = None  # [n, steps, V]; never allocated when every proposing row is greedy
        if q is not None:
            probs = torch.empty((n, steps, self.vocab_size), dtype=torch.float64, device=self.device)
            probs[:, 0] = q
        if steps > 1:
            table = batch.block_table.block_table.gpu
            positions, seq_lens, slots = draft_decode_inputs(
                new_pos, rows_dev, limit, table, steps - 1, self.block_size, self.max_model_len)
            # gathered once for the k - 1 forwards, into the draft's persistent FULL-graph
            # rows where it has them (after the catch-up, whose FULL graph reads them too)
            block_table = self._table_rows(table, rows_dev, n)
        for i in range(1, steps):  # <= k - 1 forwards, each vectorised over its rows
            m = int(np.count_nonzero(caps > i))
            step = _DraftStepBatch(
                query_start_loc=self.buffers.arange[: m + 1], seq_lens=seq_lens[i - 1, :m],
                num_reqs=m, num_tokens=m, max_query_len=1,
                max_seq_len=min(self.max_model_len, int(max_known[:m].max()) + i),
                num_decodes=m, num_decode_tokens=m,
            )
            # the TORCH backend reads exact host lengths (a sync, on a CPU-only path)
            host_lens = seq_lens[i - 1, :m].cpu() if self.needs_host_seq_lens else None
            hidden_i = self._forward(
                step, drafts[i - 1, :m], positions[i - 1, :m], block_table[:m],
                slots[i - 1, :m], self.buffers.arange_cpu[: m + 1], host_lens,
            )
            logits = self.executor.compute_logits(hidden_i)
            tokens, q = sample_draft(logits, _head(temperature, m), _head(seeds, m),
                                     new_pos[:m], i, all_greedy=metadata.all_greedy)
            drafts[i, :m] = tokens
            if q is not None and probs is not None:
                probs[:m, i] = q
        greedy = batch.temperature.np[rows] == 0
        for j, (row, cap) in enumerate(zip(rows.tolist(), caps.tolist())):  # per request
            self.proposals.keep(
                batch.req_ids[row], drafts[:cap, j],
                None if probs is None or greedy[j] else probs[j, :cap])
        return _Launched(rows=rows, drafts=drafts)

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


def _head(t: torch.Tensor | None, m: int) -> torch.Tensor | None:
    return None if t is None else t[:m]
