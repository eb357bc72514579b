"""V1 model runner: the dense persistent batch.

The step is a thin spine: update the persistent batch (four ordered phases), prepare
inputs in NumPy into pinned buffers, forward (eager or an implicitly dispatched CUDA
graph), sample with PyTorch ops, write the sampled tokens back into the batch. Under
async scheduling the tokens go back as placeholders whose values land later
(runner_v1/in_flight_tokens.py), and the output is an async output object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from policy.config import EngineConfig
from runner_v1.cudagraph import V1CudaGraphs
from runner_v1.in_flight_tokens import InFlightTokens
from runner_v1.logits_processor import BatchProcessorContext, V1LogitsProcessors
from runner_v1.persistent_batch import PersistentBatch
from runner_v1.pooling import pool_step
from runner_v1.prepare_inputs import InputBuffers, PreparedInputs, prepare_inputs
from runner_v1.prompt_logprobs import compute_prompt_logprobs_v1
from runner_v1.request_state import CachedRequestState
from runner_v1.sampler import Sampler
from runner_v1.sampling_metadata import SamplingMetadata
from runner_v1.spec_decode.async_spec import correct_positions
from runner_v1.spec_decode.bookkeeping import spec_bookkeeping
from runner_v1.spec_decode.draft_inputs import StepTokens
from runner_v1.spec_decode.metadata import SpecDecodeMetadata
from runner_v1.spec_decode.rejection_sampler import RejectionOutput
from runner_v1.spec_decode.speculator import V1Speculator
from runner_v1.tp_sampling import RankZeroSampling
from shared.contract.sampler_output import SamplerOutput
from shared.contract.step import ModelRunnerOutput, SchedulerOutput
from shared.distributed.group import current_tp_group
from shared.runtime.async_output import (
    AsyncModelRunnerOutput,
    PinnedOutputRing,
    fill_sampled_output,
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
    """What execute_model leaves for sample_tokens (vLLM's ExecuteModelState)."""

    inputs: PreparedInputs
    hidden_states: torch.Tensor
    sampling_metadata: SamplingMetadata
    req_ids: list[str]
    spec: SpecDecodeMetadata | None = None  # this step verifies drafts


class GPUModelRunner(RunnerSetupMixin):
    runner_name = "v1"
    # The previous step's sampled ids stay on the device and are scattered into the next
    # step's input ids; the host tables hold placeholders until the copy lands.
    supports_async_scheduling = True

    def __init__(self, config: EngineConfig, device: torch.device):
        self.config = config
        self.device = device
        sc = config.scheduler_config
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = sc.max_num_batched_tokens
        self.block_size = config.cache_config.block_size
        self.executor = ModelExecutor(config, device)
        self.persistent_batch = PersistentBatch(
            self.max_num_reqs, sc.max_model_len, self.max_num_tokens,
            config.model_config.vocab_size, self.block_size, device,
        )
        self.buffers = InputBuffers(self.max_num_reqs, self.max_num_tokens, device)
        self.requests: dict[str, CachedRequestState] = {}
        self.logits_processors = V1LogitsProcessors(
            config.logits_processors,
            BatchProcessorContext(self.max_num_reqs, config.model_config.vocab_size, device),
        )
        self.sampler = Sampler(self.logits_processors)
        # tensor parallelism: the sampler runs on rank 0 only (runner_v1/tp_sampling.py)
        self.tp_sampling = RankZeroSampling(current_tp_group(), device)
        self.timer = StageTimer("runner_v1", use_cuda_events=device.type == "cuda")
        self.graphs = V1CudaGraphs(
            config, device, self.executor, self.buffers, self.persistent_batch
        )
        # Guards the pinned input buffers: the previous step's non_blocking H2D copies
        # out of them must be done before NumPy overwrites them (V1's async barrier).
        self.prepare_inputs_event = torch.cuda.Event() if device.type == "cuda" else None
        self._state: _ExecuteState | None = None
        self.async_scheduling = sc.async_scheduling
        self.in_flight = InFlightTokens(self.max_num_tokens, device)
        self.copy_stream = torch.cuda.Stream() if device.type == "cuda" else None
        self.output_ring = PinnedOutputRing()
        self.prompt_logprobs_reqs = PromptLogprobsRequests(keep_prompt=False)
        spec = config.speculative_config
        self.speculator = (
            None if spec is None else V1Speculator(config, device)
        )
        # a draft model's proposals never leave the device (ngram's are host lists): the
        # scheduler may then plan a step before the previous one's drafts are known
        self.keeps_drafts_on_device = (
            self.speculator is not None and self.speculator.draft is not None)

    # ---- runner protocol: set-up (load_model, KV sizing: RunnerSetupMixin) ----------
    def capture_model(self) -> None:
        self.graphs.capture()
        if self.speculator is not None:
            self.speculator.capture(self.graphs.pool)

    # ---- runner protocol: a step ------------------------------------------------------
    @contextlib.contextmanager
    def synchronize_input_prep(self) -> Iterator[None]:
        if self.prepare_inputs_event is not None:
            self.prepare_inputs_event.synchronize()
        try:
            yield
        finally:
            if self.prepare_inputs_event is not None:
                self.prepare_inputs_event.record()

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        so = scheduler_output
        self.timer.begin_step(so.num_reqs, so.total_num_scheduled_tokens)
        with self.timer.stage("preprocess"), self.synchronize_input_prep():
            if self.in_flight:  # tokens older than the latest step have landed by now
                self.in_flight.land(self.persistent_batch, keep_latest=True)
            self._update_states(so)
            self.prompt_logprobs_reqs.update(so)
            if so.total_num_scheduled_tokens == 0:
                # finishes and adds applied, nothing to run; emit this step's BatchUpdate
                # now so its records are not folded into the next step's. Nothing will
                # read the latest sampled ids on the device: land them too.
                self.in_flight.land(self.persistent_batch, keep_latest=False)
                self._refresh_sampling_metadata()
                self._state = None
                return None
            batch = self.persistent_batch
            req_ids = list(batch.req_ids)
            num_scheduled = np.fromiter(
                (so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int32, count=len(req_ids)
            )
            num_draft = drafts = None
            if so.scheduled_spec_decode_tokens:
                num_draft, drafts = self.speculator.write_drafts(
                    batch, so.scheduled_spec_decode_tokens)
            plan = self.graphs.dispatch(num_scheduled)
            inputs = prepare_inputs(
                batch, num_scheduled, self.buffers, plan.num_tokens_padded, plan.num_reqs_padded,
                num_draft,
            )
            spec = draft_index = None
            if num_draft is not None:
                spec, draft_index = self.speculator.prepare_step(
                    inputs, req_ids, num_draft, drafts)
            moved = bool(self.in_flight) and self._land_in_flight_inputs(inputs, req_ids, draft_index)
            attn_metadata = None
            if plan.mode != "FULL":  # a FULL replay reads the persistent buffers directly
                common = inputs.common_attn_metadata(
                    batch.block_table.block_table.gpu, self.block_size
                )
                if moved and self.config.attention_backend == "TORCH":
                    # it reads host lengths: the device's, moved back (a sync)
                    common = dataclasses.replace(
                        common, seq_lens_cpu=inputs.seq_lens[: inputs.num_reqs_padded].cpu())
                attn_metadata = self.executor.build_attn_metadata(common)
            sampling_metadata = self._refresh_sampling_metadata()
        self.timer.stats.cudagraph_mode = plan.mode
        with self.timer.stage("forward"):
            hidden = self.graphs.run(plan, inputs, attn_metadata)
        self._state = _ExecuteState(inputs, hidden, sampling_metadata, req_ids, spec)
        return None

    def _land_in_flight_inputs(self, inputs: PreparedInputs, req_ids: list[str],
                               draft_index: np.ndarray | None) -> bool:
        """Async scheduling: the latest step's sampled tokens into this step's input ids,
        and (speculative decoding) each row moved back by the drafts that step rejected
        (runner_v1/spec_decode/async_spec.py). -> whether any row was moved."""
        host_ids = self.buffers.input_ids.np[: inputs.num_tokens]
        if draft_index is not None and draft_index.size:
            host_ids = host_ids.copy()  # the drafts' placeholders are not sampled tokens
            host_ids[draft_index] = 0
        self.in_flight.scatter_into_input_ids(
            host_ids, inputs.query_start_loc_cpu[1 : inputs.num_reqs + 1].numpy(),
            req_ids, self.requests, inputs.input_ids,
        )
        rejected = self.in_flight.rejected_by_row(req_ids, self.requests)
        if rejected is None:
            return False
        n = inputs.num_reqs
        correct_positions(
            inputs, rejected, self.persistent_batch.block_table.block_table.gpu,
            self.block_size, np.repeat(np.arange(n), inputs.num_scheduled_tokens_np[:n]))
        return True

    def _refresh_sampling_metadata(self) -> SamplingMetadata:
        """The sampler's view of the batch; the step's row changes go to the custom
        processors at once (every step that emits a BatchUpdate, or its records would be
        lost or folded into the next step's)."""
        metadata = self.persistent_batch.refresh_sampling_metadata()
        if self.logits_processors:
            self.logits_processors.update_state(self.persistent_batch.last_batch_update)
        return metadata

    def sample_tokens(self, grammar_output: Any = None) -> ModelRunnerOutput:
        state, self._state = self._state, None
        if state is None:
            return ModelRunnerOutput.empty()
        inputs = state.inputs
        if self.pooler is not None:  # a pooling engine: pool the prompts, sample nothing
            with self.timer.stage("sample"):
                return pool_step(self.pooler, self.persistent_batch, inputs,
                                 state.hidden_states, state.req_ids)
        with self.timer.stage("sample"):
            if self.in_flight and (state.sampling_metadata.reads_output_tokens
                                   or self.logits_processors):
                # Penalties count the output tokens, bad words match their tail and custom
                # processors read their live output lists, on the host: wait for the copy
                # of the latest step's (it overlapped this forward) and land it.
                self.in_flight.land(self.persistent_batch, keep_latest=False)
            if state.spec is not None:
                spec_out = self._sample_spec(state)
                self._launch_drafts(state, spec_out.output_token_ids, spec_out.num_sampled)
            else:
                hidden = rows_at_logits(state.hidden_states, inputs.logits_indices,
                                        inputs.num_reqs, inputs.num_tokens)
                logits = self.executor.compute_logits(hidden)
                # the position of each logit's input token: the seeded noise is keyed by
                # it (greedy rows have none: not gathered when every row is greedy)
                positions = (None if state.sampling_metadata.all_greedy
                             else rows_at_logits(inputs.positions, inputs.logits_indices,
                                                 inputs.num_reqs, inputs.num_tokens))
                sampler_output = self.tp_sampling.run(
                    lambda: self.sampler(logits, state.sampling_metadata, positions))
                self._launch_drafts(state, sampler_output.sampled_token_ids, None)
                prompt_lps = compute_prompt_logprobs_v1(
                    self.prompt_logprobs_reqs, self.persistent_batch, inputs,
                    state.hidden_states, self.executor)
        with self.timer.stage("postprocess"):
            if state.spec is not None:
                output = spec_bookkeeping(self, state.req_ids, state.inputs,
                                          state.spec.num_draft_tokens, spec_out)
            else:
                output = self._bookkeeping(state, sampler_output, prompt_lps)
            self._propose(output, state)
        return output

    def _sample_spec(self, state: _ExecuteState) -> RejectionOutput:
        """A step with drafts: every logit row of the drafted rows, rejection sampling."""
        md = state.spec
        logits = self.executor.compute_logits(state.hidden_states[md.logits_indices])
        positions = state.inputs.positions[md.logits_indices]
        return self.tp_sampling.run(lambda: self.speculator.sample(
            logits, state.sampling_metadata, positions, md, state.req_ids))

    def _launch_drafts(self, state: _ExecuteState, new_tokens: torch.Tensor,
                       num_new: torch.Tensor | None) -> None:
        """The draft model's forwards, enqueued behind the sampling before the step's one
        sync (so the GPU runs them while the host waits for the tokens)."""
        if self.speculator is None:
            return
        inputs = state.inputs
        step = StepTokens(inputs.input_ids, inputs.positions, inputs.seq_lens,
                          inputs.query_start_loc_cpu.numpy())
        self.speculator.launch(self.persistent_batch, step, inputs.num_scheduled_tokens_np,
                               new_tokens, num_new, state.sampling_metadata)

    def _propose(self, output: ModelRunnerOutput, state: _ExecuteState) -> None:
        """The next step's drafts for every row that sampled (synchronous runs only)."""
        if self.speculator is None or not isinstance(output, ModelRunnerOutput):
            # an async output: only a draft model runs async (the config refuses ngram),
            # its proposals stay on the device and the scheduler gives placeholders
            return
        rows = np.flatnonzero([bool(t) for t in output.sampled_token_ids])
        proposals = self.speculator.propose(self.persistent_batch, rows)
        drafts: list[list[int]] = [[] for _ in state.req_ids]
        for row, d in zip(rows.tolist(), proposals):
            drafts[row] = d
        output.draft_token_ids = drafts

    def reset_request_states(self) -> None:
        """Forget every request; model, KV cache and graphs stay. The engine calls it after
        a failed step, with every request requeued for a recompute (they come back as new
        requests)."""
        self._state = None
        self.requests.clear()
        self.persistent_batch.clear()
        self.in_flight.clear()
        if self.pooler is not None:
            self.pooler.clear()
        self.prompt_logprobs_reqs.clear()
        if self.speculator is not None:
            self.speculator.reset()

    # ---- the four ordered phases ------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.persistent_batch
        # 1. Finished and aborted (and preempted: they come back as new requests, with
        #    their generated tokens in the prefill). Done first: an id may be finished
        #    and scheduled new in one step (abort then resubmit), two distinct requests.
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
            if self.pooler is not None:
                self.pooler.drop(req_id)
            if self.speculator is not None:
                self.speculator.remove(req_id)
        # 2. In the batch but not scheduled this step: free the row, keep the state.
        scheduled = so.num_scheduled_tokens
        for req_id in [r for r in batch.req_ids if r is not None and r not in scheduled]:
            batch.remove_request(req_id)
        # 3. New and resumed requests.
        to_add: list[CachedRequestState] = []
        for new in so.scheduled_new_reqs:
            if self.pooler is not None:
                self.pooler.add_request(new.req_id, new.pooling_params)
            state = CachedRequestState.from_new_request(new, new.eos_token_id)
            self.requests[new.req_id] = state
            to_add.append(state)
        # 4. Cached requests: counts and new blocks; re-add those not in the batch.
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[req_id]
            state.num_computed_tokens = num_computed
            state.block_ids.extend(new_blocks)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                to_add.append(state)
                continue
            batch.num_computed_tokens[row] = num_computed
            batch.block_table.append_row(new_blocks, row)
        for state in to_add:
            batch.add_request(state)
        batch.condense()
        batch.reorder_decodes_first(scheduled)

    # ---- after sampling -----------------------------------------------------------------
    def _bookkeeping(
        self, state: _ExecuteState, out: SamplerOutput,
        prompt_lps: PendingPromptLogprobs | None = None,
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        inputs, req_ids = state.inputs, state.req_ids
        num_reqs = inputs.num_reqs
        batch = self.persistent_batch
        # A row samples only when its chunk reaches the end of what it has to prefill;
        # a partial prefill chunk's token is computed and dropped.
        seq_lens = inputs.seq_lens_cpu[:num_reqs].numpy()
        is_sampled = seq_lens >= batch.num_tokens[:num_reqs]
        rows = np.flatnonzero(is_sampled)
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[],
        )
        tensors = {"sampled": out.sampled_token_ids, "ids": out.logprob_token_ids,
                   "lps": out.logprobs, "ranks": out.ranks}
        fill = functools.partial(fill_sampled_output, is_sampled=is_sampled.tolist(),
                                 num_logprobs=state.sampling_metadata.num_logprobs)
        tensors, fill = attach_prompt_logprobs(prompt_lps, tensors, fill)
        if self.async_scheduling:
            # No sync: placeholders now, the values when the side-stream copy lands.
            pending = AsyncModelRunnerOutput(
                output, tensors, fill, self.copy_stream, self.output_ring)
            states = [self.requests[req_ids[row]] for row in rows.tolist()]
            self.in_flight.record(batch, states, rows, out.sampled_token_ids, pending)
            return pending
        host = {k: None if t is None else t.cpu() for k, t in tensors.items()}  # the one sync
        fill(output, host)
        sampled = host["sampled"].numpy()
        batch.append_output_tokens(rows, sampled[rows])
        for row, token in zip(rows.tolist(), sampled[rows].tolist()):
            self.requests[req_ids[row]].output_token_ids.append(token)
        return output
