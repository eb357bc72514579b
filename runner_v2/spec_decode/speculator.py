"""V2 speculative decoding in the step: the drafts' device buffers, the per-step
spec-decode batch, rejection sampling (Triton) and the draft model's proposals.

V2's way: the drafts never reach the host. The scheduler sees only their count (the
runner returns -1 placeholders), the input-prep kernel reads their values from
`draft_tokens` by state row, the rejection sampler reads them back out of input_ids, and
the accepted run is folded into the state table by a kernel. Only draft_model proposes
here (ngram reads a host token table V2 does not keep: the policy sends it to V1).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from runner_v2.input_batch import InputBatch
from runner_v2.sample.states import SamplingStates
from runner_v2.spec_decode.draft_proposer import V2DraftProposer, v2_full_query_lens
from runner_v2.spec_decode.rejection_sampler import RejectionOutput, rejection_sample
from runner_v2.spec_decode.spec_batch import SpecDecodeBatch, build_spec_decode_batch
from runner_v2.states import RequestState
from shared.contract.step import SchedulerOutput
from shared.runtime.draft_executor import make_draft_executor
from shared.runtime.draft_graphs import draft_graph_config


class V2Speculator:
    def __init__(self, config: Any, device: torch.device, max_num_reqs: int, vocab_size: int) -> None:
        spec = config.speculative_config
        if spec.method != "draft_model":
            raise ValueError(
                f"speculative_config.method={spec.method!r} is V1-only (the ngram proposer "
                "reads V1's host token table); use RUNNERLAB_USE_V2_MODEL_RUNNER=0 or "
                "method='draft_model'"
            )
        self.k = spec.num_speculative_tokens
        self.method = spec.rejection_sample_method
        self.vocab_size = vocab_size
        self.device = device
        rates = spec.synthetic_acceptance_rates
        self.synthetic_rates = (
            None if rates is None else torch.tensor(rates, dtype=torch.float64, device=device)
        )
        self.draft_executor = make_draft_executor(config, spec.draft_model_config, device)
        # by state row; a row's entries are read only for drafts the scheduler scheduled,
        # which this row's own last proposal wrote: nothing to clear at add
        self.draft_tokens = torch.zeros(max_num_reqs, self.k, dtype=torch.int64, device=device)
        self.draft_probs: torch.Tensor | None = None  # [R, k, V] float64, on first random row
        self.max_num_reqs = max_num_reqs
        max_tokens = config.scheduler_config.max_num_batched_tokens + max_num_reqs
        on_cuda = torch.device(device).type == "cuda"
        graphs = draft_graph_config(config, on_cuda, self.draft_executor.backend,
                                    v2_full_query_lens(self.k), max_tokens)
        self.proposer = V2DraftProposer(
            self.draft_executor, self.k, config.scheduler_config.max_model_len,
            config.cache_config.block_size, config.attention_backend == "TORCH", device,
            max_tokens, graphs,
        )

    # ---- set-up -------------------------------------------------------------------------
    def load_model(self) -> None:
        self.draft_executor.load_model()

    def kv_bytes_per_block(self) -> int:
        return self.draft_executor.kv_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.draft_executor.initialize_kv_cache(num_blocks)

    def capture(self, pool) -> None:
        self.proposer.draft_forward.capture(pool)

    # ---- a step -------------------------------------------------------------------------
    def spec_batch(self, batch: InputBatch, so: SchedulerOutput) -> SpecDecodeBatch | None:
        if not so.scheduled_spec_decode_tokens:
            return None
        return build_spec_decode_batch(
            batch.req_ids, batch.idx_mapping_np, batch.query_start_loc_np,
            so.scheduled_spec_decode_tokens, self.k, self.device,
        )

    def sample(self, logits: torch.Tensor, batch: InputBatch, sb: SpecDecodeBatch,
               states: SamplingStates, all_greedy: bool) -> RejectionOutput:
        # logit row j of a drafted row predicts input token j + 1 of that row: its draft
        # (the bonus row's entry is never read; clamped into the batch)
        nxt = (sb.logits_indices + 1).clamp(max=batch.num_tokens - 1)
        draft_ids = batch.input_ids.index_select(0, nxt).to(torch.int64)
        positions = batch.positions.index_select(0, sb.logits_indices)
        probs = None
        if not all_greedy and self.draft_probs is not None:
            probs = self.draft_probs.view(-1, self.vocab_size).index_select(0, sb.draft_slot)
        return rejection_sample(
            logits, sb.expanded_idx_mapping, sb.cu_num_logits, positions, draft_ids, probs,
            states, self.method, self.synthetic_rates, self.k,
        )

    def propose(self, batch: InputBatch, is_sampled_np: np.ndarray, req_states: RequestState,
                block_table: torch.Tensor, states: SamplingStates, all_greedy: bool) -> None:
        if not all_greedy and self.draft_probs is None:
            self.draft_probs = torch.zeros(
                self.max_num_reqs, self.k, self.vocab_size, dtype=torch.float64, device=self.device)
        self.proposer.propose(
            batch, is_sampled_np, req_states, block_table, states, self.draft_tokens,
            None if all_greedy else self.draft_probs,
        )
