"""V1 speculative decoding in the step: drafts into the token table, spec-decode metadata
in NumPy, rejection sampling in PyTorch, accepted runs into the batch, the next proposals.

V1's way, as in vLLM: the drafts the scheduler hands back (SchedulerOutput.
scheduled_spec_decode_tokens) are written into the host token table right after each
row's known tokens, so the ordinary NumPy input gather reads them as query tokens; the
logits of a row with k drafts are its last k + 1 tokens; after sampling the accepted run
and the target's own token are appended to the table, and the ngram proposer reads the
table for the next step's drafts. A draft model's proposals stay on the device and are
written into the step's input ids there (prepare_step): under async scheduling the host
only has placeholders for them (runner_v1/spec_decode/async_spec.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from runner_v1.persistent_batch import PersistentBatch
from runner_v1.prepare_inputs import PreparedInputs
from runner_v1.sampling_metadata import SamplingMetadata
from runner_v1.spec_decode.async_spec import draft_positions, fill_drafts
from runner_v1.spec_decode.draft_inputs import StepTokens
from runner_v1.spec_decode.draft_proposer import V1DraftProposer
from runner_v1.spec_decode.metadata import (
    SpecDecodeMetadata,
    build_spec_decode_metadata,
    ragged_arange,
)
from runner_v1.spec_decode.ngram_proposer import NgramProposer
from runner_v1.spec_decode.rejection_sampler import RejectionOutput, rejection_sample
from shared.runtime.host_buffers import copy_packed_to_device


class V1Speculator:
    """The runner's one handle on speculative decoding: the proposer (ngram over the host
    token table, or a draft model), the rejection sampler's settings, the draft q rows."""

    def __init__(self, config: Any, device: torch.device) -> None:
        spec = config.speculative_config
        if spec.rejection_sample_method == "block":
            raise ValueError(
                "speculative_config.rejection_sample_method='block' (block verification) is "
                "V2-only; use 'standard' or 'synthetic' with the V1 runner, or "
                "RUNNERLAB_USE_V2_MODEL_RUNNER=1"
            )
        self.k = spec.num_speculative_tokens
        self.method = spec.rejection_sample_method
        rates = spec.synthetic_acceptance_rates
        self.synthetic_rates = None if rates is None else tuple(float(r) for r in rates)
        # on the device once: built per step from a list, the copy would wait for the
        # verify forward (a pageable host-to-device copy is synchronous)
        self.synthetic_rates_dev = None if rates is None else torch.tensor(
            self.synthetic_rates, dtype=torch.float64, device=device)
        self.device = device
        max_model_len = config.scheduler_config.max_model_len
        self.ngram: NgramProposer | None = None
        self.draft: V1DraftProposer | None = None
        if spec.method == "ngram":
            self.ngram = NgramProposer(
                self.k, spec.prompt_lookup_min, spec.prompt_lookup_max, max_model_len)
        else:
            self.draft = V1DraftProposer(config, spec.draft_model_config, self.k, device)

    # ---- set-up (the runner's; ngram has no model and no KV) ------------------------------
    def load_model(self) -> None:
        if self.draft is not None:
            self.draft.load_model()

    def kv_bytes_per_block(self) -> int:
        return 0 if self.draft is None else self.draft.kv_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.draft is not None:
            self.draft.initialize_kv_cache(num_blocks)

    def capture(self, pool) -> None:
        if self.draft is not None:
            self.draft.capture(pool)

    # ---- request lifecycle ------------------------------------------------------------------
    def remove(self, req_id: str) -> None:
        """A finished or preempted request: forget its proposals (draft q rows)."""
        if self.draft is not None:
            self.draft.remove(req_id)

    def reset(self) -> None:
        if self.draft is not None:
            self.draft.reset()

    # ---- before the forward -------------------------------------------------------------
    def write_drafts(
        self, batch: PersistentBatch, scheduled_spec_decode_tokens: dict[str, list[int]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Writes each scheduled row's drafts after its known tokens (the columns past
        num_tokens are scratch: nothing but this step's gather reads them, and the
        accepted tokens overwrite them). Returns (drafts per row int32 [N], the drafts
        flat in row order)."""
        num_draft = np.zeros(batch.num_reqs, dtype=np.int32)
        for req_id, drafts in scheduled_spec_decode_tokens.items():  # per request
            row = batch.req_id_to_index[req_id]
            start = int(batch.num_tokens[row])
            batch.token_ids[row, start : start + len(drafts)] = drafts
            num_draft[row] = len(drafts)
        # read back in row order: the rejection sampler wants them flat, row by row
        rows = np.flatnonzero(num_draft)
        counts = num_draft[rows]
        cols = np.repeat(batch.num_tokens[rows].astype(np.int64), counts) + ragged_arange(counts)
        return num_draft, batch.token_ids[np.repeat(rows, counts), cols].astype(np.int64)

    def prepare_step(
        self, inputs: PreparedInputs, req_ids: list[str], num_draft: np.ndarray,
        drafts: np.ndarray,
    ) -> tuple[SpecDecodeMetadata, np.ndarray | None]:
        """The step's spec-decode metadata. draft_model: the drafts come from the
        proposals on the device, written into the input ids there too (under async
        scheduling the host holds placeholders for them). -> (metadata, the drafts'
        flat token indices, or None for ngram, whose host drafts are the real ones)."""
        qsl = inputs.query_start_loc_cpu.numpy()
        if self.draft is None:
            return build_spec_decode_metadata(num_draft, qsl, drafts, self.device), None
        index = draft_positions(inputs, num_draft)
        index_dev, = copy_packed_to_device([index], self.device)
        device_drafts = self.draft.draft_tokens_for_step(req_ids, num_draft)
        fill_drafts(inputs.input_ids, index_dev, device_drafts)
        md = build_spec_decode_metadata(num_draft, qsl, drafts, self.device, device_drafts)
        return md, index

    # ---- sampling -----------------------------------------------------------------------
    def sample(
        self, logits: torch.Tensor, metadata: SamplingMetadata, positions: torch.Tensor,
        md: SpecDecodeMetadata, req_ids: list[str],
    ) -> RejectionOutput:
        probs = None
        if self.draft is not None:  # ngram's drafts are deterministic: q is one-hot
            probs = self.draft.draft_probs_for_step(req_ids, md.num_draft_tokens)
        return rejection_sample(
            logits, metadata, positions, md.num_draft_tokens, md.draft_token_ids, probs,
            self.method, self.synthetic_rates_dev,
        )

    # ---- after sampling -----------------------------------------------------------------
    def launch(self, batch: PersistentBatch, step: StepTokens, num_scheduled: np.ndarray,
               new_tokens: torch.Tensor, num_new: torch.Tensor | None,
               metadata: SamplingMetadata) -> None:
        """Enqueue the draft model behind the step's sampling (draft_model only: ngram
        reads the host token table, after the sync). It runs even when no row sampled:
        its catch-up must still see this step's prefill chunks."""
        if self.draft is not None:
            self.draft.launch(batch, step, num_scheduled, new_tokens, num_new, metadata)

    def propose(self, batch: PersistentBatch, rows: np.ndarray) -> list[list[int]]:
        """The next step's drafts for the given rows (those that sampled), with this
        step's accepted tokens in the token table: the launched ones, or ngram's."""
        if self.draft is not None:
            return self.draft.collect(batch, rows)
        if rows.size == 0:
            return []
        drafts, counts = self.ngram.propose(batch.token_ids, batch.num_tokens, rows)
        return [d[:c].tolist() for d, c in zip(drafts, counts.tolist())]
