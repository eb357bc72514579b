"""The V2 sampler: Triton kernels over the logits, per-request state via idx_mapping.

Same semantics as the V1 PyTorch sampler (tests/oracles/sampling_reference.py), computed so
that seeded tokens are bit-identical: allowed_token_ids + logit_bias, penalties +
min_tokens, bad words -> processed logits, min_p / top_k / top_p -> one threshold per
row, Gumbel-max with the shared noise (greedy rows take the argmax), raw logprobs (from
the unprocessed logits). Which stages run is decided from the host mirrors in
SamplingStates, never from device values: no host sync, and a batch that needs no
stage launches nothing for it. Grids depend only on (num rows, vocab size).
"""

from __future__ import annotations

import numpy as np
import torch

from runner_v2.logits_processor import V2LogitsProcessors
from runner_v2.sample.bad_words import apply_bad_words
from runner_v2.sample.batch_flags import BatchFlags
from runner_v2.sample.gumbel import gumbel_sample
from runner_v2.sample.logit_bias import apply_allowed_and_bias
from runner_v2.sample.logprobs import compute_logprobs
from runner_v2.sample.penalties import apply_penalties_and_min_tokens
from runner_v2.sample.states import SamplingStates
from runner_v2.sample.top_k_top_p import compute_thresholds
from runner_v2.states import RequestState
from shared.contract.sampler_output import SamplerOutput
from shared.sampling.noise_kernels import NOISE_BLOCK


class Sampler:
    def __init__(self, states: SamplingStates, req_states: RequestState | None = None,
                 logits_processors: V2LogitsProcessors | None = None) -> None:
        """req_states: the runner's RequestState, whose token table (prompt_len,
        total_len, all_token_ids) bad words read the outputs from; only a batch with bad
        words needs it. logits_processors: the custom ones, run last on the processed
        logits, before temperature."""
        self.states = states
        self.req_states = req_states
        self.logits_processors = logits_processors
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    def _gumbel_workspace(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-block results of gumbel_sample for up to every state row, allocated once."""
        n = self.states.max_num_reqs * -(-self.states.vocab_size // NOISE_BLOCK)
        if self._workspace is None or self._workspace[0].device != logits.device:
            self._workspace = (torch.empty(n, dtype=torch.float64, device=logits.device),
                               torch.empty(n, dtype=torch.int64, device=logits.device))
        return self._workspace

    def __call__(
        self,
        logits: torch.Tensor,
        idx_mapping: torch.Tensor,
        positions: torch.Tensor | None,
        max_num_logprobs: int | None,
        idx_mapping_np: np.ndarray | None = None,
    ) -> SamplerOutput:
        """logits [N, V]; idx_mapping int32 [N] (batch row -> state row); positions
        int64 [N] (position of each logit's input token), None allowed when the batch's
        flags say it needs none (an all-greedy batch without penalties or min_tokens:
        the runner then skips their gather). idx_mapping_np, the host copy of
        idx_mapping when the caller has it, narrows the stage decision to the batch;
        without it the decision covers every row ever written (still correct)."""
        st = self.states
        flags = st.batch_flags(idx_mapping_np)
        if positions is None and flags.needs_positions:
            raise ValueError("this batch has random rows, penalties or min_tokens: the "
                             "sampler needs the logits' positions")
        x = self.processed_logits(logits, idx_mapping, positions, flags)
        if self.logits_processors:
            if x is logits:  # processors may write in place; logprobs read the raw logits
                x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32,
                              copy=True)
            x = self.logits_processors.apply(x, idx_mapping)
        threshold = None
        if flags.any_filter:
            threshold = compute_thresholds(
                x, idx_mapping, st.temperature, st.top_k, st.top_p, st.min_p
            )
        sampled = gumbel_sample(x, idx_mapping, None if flags.all_greedy else positions,
                                st.temperature, st.seeds, threshold,
                                workspace=self._gumbel_workspace(logits))
        if max_num_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        ids, logprobs, ranks = compute_logprobs(logits, sampled, max_num_logprobs)
        return SamplerOutput(sampled, ids, logprobs, ranks)

    def processed_logits(
        self,
        logits: torch.Tensor,
        idx_mapping: torch.Tensor,
        positions: torch.Tensor | None,
        flags: BatchFlags,
    ) -> torch.Tensor:
        """The oracle's processed_logits for every row: allowed_token_ids, logit_bias,
        penalties, min_tokens, bad words, in that order. `logits` itself when no stage
        runs (it is never modified); otherwise one compute-dtype tensor that the first
        stage creates and the later ones update in place."""
        st = self.states
        x = logits
        if flags.any_allowed_token_ids or flags.any_logit_bias:
            x = apply_allowed_and_bias(logits, idx_mapping, st.logit_bias,
                                       flags.any_allowed_token_ids, flags.any_logit_bias)
        if flags.any_penalties or flags.any_min_tokens:
            x = apply_penalties_and_min_tokens(
                x, idx_mapping, positions, st, flags.any_penalties, flags.any_min_tokens,
                out=None if x is logits else x,
            )
        if flags.any_bad_words:
            rs = self.req_states
            if rs is None:
                raise ValueError("bad words need the RequestState's token table: build the "
                                 "Sampler with req_states")
            if x is logits:  # bad words write in place: never into the raw logits
                x = torch.empty(logits.shape, dtype=torch.float64 if logits.dtype ==
                                torch.float64 else torch.float32, device=logits.device)
                x.copy_(logits)  # exact: float32 / float64 or a narrower float widened
            apply_bad_words(x, idx_mapping, st.bad_words, rs.all_token_ids.gpu,
                            rs.prompt_len.gpu, rs.total_len.gpu)
        return x
