"""V2 model runner: the GPU-resident state table.

The step is a thin spine: finish / add / update request state (staged, one copy and
one launch per structure), gather this step's batch through idx_mapping, prepare
inputs with Triton kernels, forward (explicit FULL / PIECEWISE graph replays where one fits,
eager otherwise), sample with the Triton sampler, start the async copy of the sampled
ids, and advance the device state with the post_update kernel.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from policy.config import EngineConfig
from runner_v2.block_tables import BlockTables
from runner_v2.cudagraph import CudaGraphManager
from runner_v2.input_batch import InputBatch, InputBuffers, gather_batch_req_state, prepare_inputs
from runner_v2.logits_processor import SlotProcessorContext, V2LogitsProcessors
from runner_v2.pooling import pool_step
from runner_v2.post_update import post_update
from runner_v2.prompt_logprobs import compute_prompt_logprobs_v2
from runner_v2.sample.sampler import Sampler
from runner_v2.sample.states import SamplingStates
from runner_v2.spec_decode.post_update import spec_post_update
from runner_v2.spec_decode.spec_batch import SpecDecodeBatch
from runner_v2.spec_decode.speculator import V2Speculator
from runner_v2.states import RequestState
from shared.attention.metadata import CommonAttentionMetadata
from shared.contract.sampler_output import SamplerOutput
from shared.contract.step import ModelRunnerOutput, SchedulerOutput
from shared.runtime.async_output import (
    AsyncModelRunnerOutput,
    PinnedOutputRing,
    fill_sampled_output,
    fill_spec_sampled_output,
)
from shared.runtime.model_executor import ModelExecutor, rows_at_logits
from shared.runtime.runner_base import RunnerSetupMixin
from shared.runtime.step_timing import StageTimer
from shared.sampling.prompt_logprobs import (
    PendingPromptLogprobs,
    PromptLogprobsRequests,
    attach_prompt_logprobs,
)

logger = logging.getLogger("runnerlab")


@dataclass
class _ExecuteState:
    batch: InputBatch
    hidden_states: torch.Tensor
    spec: SpecDecodeBatch | None = None  # this step verifies drafts


class GPUModelRunner(RunnerSetupMixin):
    runner_name = "v2"
    # Decode input ids come from last_sampled_tokens on the device and every per-row
    # counter advances on the device, so the next step can be planned and prepared before
    # this step's tokens reach the host (the engine's async_scheduling).
    supports_async_scheduling = True

    def __init__(self, config: EngineConfig, device: torch.device):
        self.config = config
        self.device = device
        sc = config.scheduler_config
        R, T, L = sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len
        vocab = config.model_config.vocab_size
        self.block_size = config.cache_config.block_size
        self.executor = ModelExecutor(config, device)
        self.req_states = RequestState(R, L, T, vocab, device)
        self.sampling_states = SamplingStates(R, vocab, device)
        self.block_tables = BlockTables(R, -(-L // self.block_size), T, self.block_size, device)
        self.buffers = InputBuffers(R, T, device)
        rs = self.req_states
        self.logits_processors = V2LogitsProcessors(
            config.logits_processors,
            SlotProcessorContext(R, vocab, device, rs.all_token_ids.gpu, rs.total_len.gpu,
                                 rs.prompt_len.gpu),
        )
        self.sampler = Sampler(self.sampling_states, self.req_states, self.logits_processors)
        self.cudagraph_manager = CudaGraphManager(
            config, device, self.executor, self.buffers, self.block_tables
        )
        self.copy_stream = torch.cuda.Stream() if device.type == "cuda" else None
        self.output_ring = PinnedOutputRing()
        self.timer = StageTimer("runner_v2", use_cuda_events=device.type == "cuda")
        self.max_num_tokens = T
        self.max_num_reqs = R
        self._state: _ExecuteState | None = None
        # V2's token table is on the device: the prompts of prompt_logprobs requests only
        self.prompt_logprobs_reqs = PromptLogprobsRequests(keep_prompt=True)
        self.speculator = (
            None if config.speculative_config is None
            else V2Speculator(config, device, R, vocab)
        )
        # Drafts are made, kept and read on the device: the scheduler may plan the next
        # step before they (and the accepted counts) reach the host (async scheduling).
        self.keeps_drafts_on_device = self.speculator is not None
        self._host_seq_lens_inexact = (
            self.keeps_drafts_on_device and sc.async_scheduling
            and config.attention_backend == "TORCH"
        )

    # ---- runner protocol: set-up (load_model, KV sizing: RunnerSetupMixin) ----------
    def capture_model(self) -> None:
        self.cudagraph_manager.capture()
        if self.speculator is not None:
            self.speculator.capture(self.cudagraph_manager.pool)

    # ---- runner protocol: a step ------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        so = scheduler_output
        self.timer.begin_step(so.num_reqs, so.total_num_scheduled_tokens)
        with self.timer.stage("preprocess"):
            self._finish_requests(so)
            self._add_requests(so)
            self._update_requests(so)
            self.prompt_logprobs_reqs.update(so)
            self.req_states.apply_staged_writes()
            self.block_tables.apply_staged_writes()
            self.sampling_states.apply_staged_writes()
            if so.total_num_scheduled_tokens == 0:
                self._state = None
                return None
            batch, desc = self._prepare_batch(so)
            spec = None if self.speculator is None else self.speculator.spec_batch(batch, so)
            attn_metadata = None
            if desc is None or desc.mode == "PIECEWISE":  # FULL builds it inside the graph
                attn_metadata = self.executor.build_attn_metadata(self._common_metadata(batch))
        self.timer.stats.cudagraph_mode = "NONE" if desc is None else desc.mode
        with self.timer.stage("forward"):
            if desc is None:
                hidden = self.executor.forward(
                    batch.input_ids, batch.positions, attn_metadata, batch.num_tokens_padded
                )
            elif desc.mode == "FULL":
                hidden = self.cudagraph_manager.run_fullgraph(desc)
            else:
                hidden = self.cudagraph_manager.run_piecewise(desc, attn_metadata)
        self._state = _ExecuteState(batch, hidden, spec)
        return None

    def sample_tokens(self, grammar_output: Any = None) -> AsyncModelRunnerOutput | ModelRunnerOutput:
        state, self._state = self._state, None
        if state is None:
            return ModelRunnerOutput.empty()
        batch = state.batch
        n = batch.num_reqs
        if state.spec is not None:
            return self._sample_spec(state)
        if self.pooler is not None:  # a pooling engine: pool the prompts, sample nothing
            with self.timer.stage("sample"):
                return pool_step(self.pooler, batch, state.hidden_states, self.req_states)
        with self.timer.stage("sample"):
            hidden = rows_at_logits(state.hidden_states, batch.logits_indices, n,
                                    batch.num_tokens)
            logits = self.executor.compute_logits(hidden)
            # cached per batch composition: the sampler asks for the same flags below
            flags = self.sampling_states.batch_flags(batch.idx_mapping_np)
            # the position of each logit's input token: the seeded noise is keyed by it
            # (an all-greedy batch without penalties or min_tokens reads none: no gather)
            positions = (rows_at_logits(batch.positions, batch.logits_indices, n,
                                        batch.num_tokens) if flags.needs_positions else None)
            out = self.sampler(
                logits, batch.idx_mapping, positions, flags.max_num_logprobs,
                batch.idx_mapping_np,
            )
            prompt_lps = compute_prompt_logprobs_v2(
                self.prompt_logprobs_reqs, batch, state.hidden_states, self.req_states,
                self.executor)
        with self.timer.stage("postprocess"):
            # Output set-up counts here, as V1's bookkeeping does. The D2H copy starts
            # first, on a side stream: it overlaps post_update below.
            is_sampled = self._is_sampled(batch)
            async_output = self._make_async_output(batch, out, flags.num_logprobs, is_sampled,
                                                   prompt_lps)
            post_update(
                batch.idx_mapping, n, out.sampled_token_ids, batch.seq_lens, batch.query_start_loc,
                self.req_states, self.sampling_states.output_bin_counts,
            )
            # The host mirror stays an upper bound of the device counter.
            self.req_states.num_computed_tokens_np[batch.idx_mapping_np] += (
                batch.num_scheduled_tokens_np
            )
            self._propose(batch, is_sampled)
        return async_output

    # ---- speculative decoding -------------------------------------------------------------
    def _sample_spec(self, state: _ExecuteState) -> AsyncModelRunnerOutput:
        """A step with drafts: every logit row of the drafted rows, rejection sampling,
        the accepted runs folded into the state table on the device."""
        batch, sb = state.batch, state.spec
        n = batch.num_reqs
        all_greedy = self.sampling_states.batch_flags(batch.idx_mapping_np).all_greedy
        with self.timer.stage("sample"):
            logits = self.executor.compute_logits(
                state.hidden_states.index_select(0, sb.logits_indices))
            out = self.speculator.sample(logits, batch, sb, self.sampling_states, all_greedy)
        with self.timer.stage("postprocess"):
            is_sampled = self._is_sampled(batch)
            output = self._empty_output(batch)
            tensors = {"sampled": out.output_token_ids, "num_sampled": out.num_sampled}
            fill = functools.partial(fill_spec_sampled_output, is_sampled=is_sampled.tolist(),
                                     num_drafts=self.speculator.k)
            async_output = AsyncModelRunnerOutput(
                output, tensors, fill, self.copy_stream, self.output_ring)
            spec_post_update(
                batch.idx_mapping, n, out.output_token_ids, out.num_sampled, sb.cu_num_logits,
                batch.seq_lens, batch.query_start_loc, self.req_states,
            )
            self.req_states.num_computed_tokens_np[batch.idx_mapping_np] += (
                batch.num_scheduled_tokens_np
            )
            self._propose(batch, is_sampled)
        return async_output

    def _propose(self, batch: InputBatch, is_sampled: np.ndarray) -> None:
        """The draft model's proposals for the rows that sampled (values stay on the
        device; the output carries -1 placeholders for the scheduler)."""
        if self.speculator is None:
            return
        all_greedy = self.sampling_states.batch_flags(batch.idx_mapping_np).all_greedy
        self.speculator.propose(
            batch, is_sampled, self.req_states, self.block_tables.block_table.gpu,
            self.sampling_states, all_greedy,
        )

    def _is_sampled(self, batch: InputBatch) -> np.ndarray:
        """Which rows sample, decided on the host from exact scheduler counts (call it
        before the host mirror is advanced past this step)."""
        idx = batch.idx_mapping_np
        return (
            self.req_states.num_computed_tokens_np[idx] + batch.num_scheduled_tokens_np
            >= self.req_states.prefill_len_np[idx]
        )

    @staticmethod
    def _empty_output(batch: InputBatch) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
            sampled_token_ids=[],
        )

    def reset_request_states(self) -> None:
        """Forget every request; model, KV cache and graphs stay. The engine calls it after
        a failed step, with every request requeued for a recompute (they come back as new
        requests, whose adds overwrite every per-row field, as any add does)."""
        self._state = None
        self.req_states.reset()
        self.prompt_logprobs_reqs.clear()
        self.block_tables.discard_staged_writes()
        self.sampling_states.discard_staged_writes()
        if self.logits_processors:
            self.logits_processors.reset()
        if self.pooler is not None:
            self.pooler.clear()

    # ---- state updates ------------------------------------------------------------------
    def _finish_requests(self, so: SchedulerOutput) -> None:
        # Preemption is completion here: a resumed request comes back as a new one.
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._remove_request(req_id)

    def _remove_request(self, req_id: str) -> None:
        row = self.req_states.remove_request(req_id)
        if self.pooler is not None:
            self.pooler.drop(req_id)
        if row is not None and self.logits_processors:
            self.logits_processors.remove_request(row)

    def _add_requests(self, so: SchedulerOutput) -> None:
        for new in so.scheduled_new_reqs:
            # Covers abort-then-resubmit of the same id in one step: the old row is
            # freed (if the finish did not already) and the new request gets a fresh one.
            self._remove_request(new.req_id)
            row = self.req_states.add_request(
                new.req_id, new.prompt_len, new.prompt_token_ids, new.num_computed_tokens
            )
            self.block_tables.append_block_ids(row, new.block_ids, overwrite=True)
            self.sampling_states.add_request(
                row, new.sampling_params, new.prompt_token_ids[: new.prompt_len],
                new.prompt_token_ids, new.eos_token_id,
            )
            if self.logits_processors:
                self.logits_processors.add_request(row, new.sampling_params)
            if self.pooler is not None:
                self.pooler.add_request(new.req_id, new.pooling_params)

    def _update_requests(self, so: SchedulerOutput) -> None:
        cached = so.scheduled_cached_reqs
        n = len(cached.req_ids)
        if n == 0:
            return
        index = self.req_states.req_id_to_index
        rows = np.fromiter(map(index.__getitem__, cached.req_ids), dtype=np.int64, count=n)
        # CPU upper bound only; the device counter is advanced by post_update.
        self.req_states.num_computed_tokens_np[rows] = cached.num_computed_tokens
        for row, new_blocks in zip(rows.tolist(), cached.new_block_ids):
            if new_blocks:  # most decode steps: a few rows cross a block boundary
                self.block_tables.append_block_ids(row, new_blocks, overwrite=False)

    # ---- input prep ---------------------------------------------------------------------
    def _prepare_batch(self, so: SchedulerOutput):
        req_ids, idx_mapping_np, num_scheduled = gather_batch_req_state(
            so.num_scheduled_tokens, self.req_states
        )
        num_reqs, num_tokens = len(req_ids), so.total_num_scheduled_tokens
        desc = self.cudagraph_manager.dispatch(num_reqs, num_tokens, int(num_scheduled.max()))
        num_tokens_padded = desc.num_tokens if desc is not None else num_tokens
        # PIECEWISE pads the tokens only (num_reqs None): its eager attention sees the
        # real requests, and the padded tokens belong to none of them.
        num_reqs_padded = num_reqs if desc is None or desc.num_reqs is None else desc.num_reqs
        batch = prepare_inputs(
            req_ids, idx_mapping_np, num_scheduled, num_reqs_padded, num_tokens_padded,
            self.req_states, self.buffers, self.block_tables,
            self.speculator.draft_tokens if so.scheduled_spec_decode_tokens else None,
        )
        return batch, desc

    def _common_metadata(self, batch: InputBatch) -> CommonAttentionMetadata:
        # host copies, used only by TORCH: exact from the scheduler's counts, except under
        # async scheduling with drafts, where the scheduler counts every draft as
        # accepted: there the device's (a sync, on the oracle backend only)
        seq_lens_cpu = torch.from_numpy(batch.seq_lens_np)
        if self._host_seq_lens_inexact:
            seq_lens_cpu = batch.seq_lens.cpu()
        return CommonAttentionMetadata.for_batch(
            batch, batch.block_table, batch.slot_mapping, self.block_size,
            query_start_loc_cpu=torch.from_numpy(batch.query_start_loc_np),
            seq_lens_cpu=seq_lens_cpu,
        )

    # ---- output -------------------------------------------------------------------------
    def _make_async_output(
        self, batch: InputBatch, out: SamplerOutput, num_logprobs: tuple[int, ...],
        is_sampled: np.ndarray, prompt_lps: PendingPromptLogprobs | None = None,
    ) -> AsyncModelRunnerOutput:
        tensors = {
            "sampled": out.sampled_token_ids,
            "ids": out.logprob_token_ids,
            "lps": out.logprobs,
            "ranks": out.ranks,
        }
        fill = functools.partial(
            fill_sampled_output, is_sampled=is_sampled.tolist(), num_logprobs=num_logprobs
        )
        if self.speculator is not None:  # this step proposes: placeholders for its drafts
            fill = functools.partial(_fill_with_draft_placeholders, fill,
                                     is_sampled=is_sampled.tolist(), num_drafts=self.speculator.k)
        # through the same side-stream copy as the sampled ids: no sync of their own
        tensors, fill = attach_prompt_logprobs(prompt_lps, tensors, fill)
        return AsyncModelRunnerOutput(
            self._empty_output(batch), tensors, fill, self.copy_stream, self.output_ring)


def _fill_with_draft_placeholders(fill, output: ModelRunnerOutput, host, is_sampled: list[bool],
                                  num_drafts: int) -> None:
    fill(output, host)
    output.draft_token_ids = [[-1] * num_drafts if s else [] for s in is_sampled]
