"""SamplerOutput: what both runners' samplers return for one step, batch rows = N."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [N]
    # column 0 is the sampled token, then the top max_num_logprobs tokens by raw logit;
    # rows that asked for fewer (or none) still carry max_num_logprobs columns
    logprob_token_ids: torch.Tensor | None  # int64 [N, 1 + max_n]
    # the compute dtype: float32 (float64 for fp64 logits)
    logprobs: torch.Tensor | None  # [N, 1 + max_n]
    ranks: torch.Tensor | None  # int64 [N], rank of the sampled token (1 = best)


@dataclass(frozen=True)
class RejectionOutput:
    """What both runners' speculative-decoding rejection samplers return, rows = N requests.

    Row b holds its accepted draft tokens, then one token sampled by the target (the
    bonus token when every draft was accepted, else the recovered token), then -1."""

    output_token_ids: torch.Tensor  # int64 [N, max_k + 1], -1 padded
    num_sampled: torch.Tensor  # int32 [N]: accepted drafts + 1

    @property
    def num_accepted(self) -> torch.Tensor:
        """int32 [N]: accepted draft tokens per request."""
        return self.num_sampled - 1
