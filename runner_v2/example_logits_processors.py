"""Example V2-interface logits processors (slot-keyed); their V1-interface twins, with
the same behaviour, are in runner_v1/example_logits_processors.py. The per-request
settings come from SamplingParams.extra_args (shared/sampling/example_processor_args.py).

Use: EngineArgs(logits_processors=["runner_v2.example_logits_processors:NoRepeatNGram"]).
Their state is per-slot device tensors written at add_request (every slot field
overwritten: slots are reused without clearing) and read through idx_mapping, so apply
launches a few torch ops over the gathered batch and never syncs with the host.
"""

from __future__ import annotations

import numpy as np
import torch

from runner_v2.logits_processor import SlotLogitsProcessor, SlotProcessorContext
from runner_v2.uva import async_copy_to_device
from shared.contract.sampling_params import SamplingParams
from shared.sampling.example_processor_args import (
    MAX_BOOST_TOKENS,
    MAX_NGRAM_SIZE,
    boost_args,
    ngram_args,
)


class NoRepeatNGram(SlotLogitsProcessor):
    """extra_args["no_repeat_ngram_size"] = n: ban every token that would complete an
    n-gram already present in prompt + output (the slot's row of the token table)."""

    @classmethod
    def validate_params(cls, params: SamplingParams, vocab_size: int) -> None:
        ngram_args(params.extra_args)

    def __init__(self, ctx: SlotProcessorContext) -> None:
        super().__init__(ctx)
        self.size = torch.zeros(ctx.max_num_reqs, dtype=torch.int64, device=ctx.device)
        self.size_np = np.zeros(ctx.max_num_reqs, dtype=np.int64)  # host mirror: any in use?

    def add_request(self, slot: int, params: SamplingParams) -> None:
        self.size_np[slot] = ngram_args(params.extra_args).size
        self.size[slot] = int(self.size_np[slot])  # a tiny H2D write, at add only

    def remove_request(self, slot: int) -> None:
        self.size_np[slot] = 0
        self.size[slot] = 0

    def apply(self, logits: torch.Tensor, idx_mapping: torch.Tensor) -> torch.Tensor:
        if not self.size_np.any():
            return logits
        ctx = self.ctx
        idx = idx_mapping.long()
        seq = ctx.all_token_ids.index_select(0, idx).long()  # [N, L]
        length = ctx.total_len.index_select(0, idx).long()[:, None]  # [N, 1]
        m = (self.size.index_select(0, idx) - 1)[:, None]  # [N, 1]; -1: off
        width = seq.shape[1]
        # window start i, one row per batch row (gather does not broadcast its index)
        start = torch.arange(width, device=seq.device).expand(seq.shape[0], width)
        # window i = seq[i : i + m], completed by seq[i + m], for i + m <= length - 1
        hit = (m > 0) & (start + m < length)
        for j in range(MAX_NGRAM_SIZE - 1):  # <= 7 offsets, vectorised over rows and starts
            col = (start + j).clamp(max=width - 1)
            tail = (length - m + j).clamp(min=0, max=width - 1)
            same = seq.gather(1, col) == seq.gather(1, tail)
            hit &= (j >= m) | same
        completing = seq.gather(1, (start + m).clamp(min=0, max=width - 1))
        v = logits.shape[1]
        banned = torch.zeros(logits.shape[0], v + 1, dtype=torch.bool, device=logits.device)
        banned.scatter_(1, torch.where(hit, completing, v).to(logits.device), True)
        return logits.masked_fill_(banned[:, :v], float("-inf"))


class TargetTokenBoost(SlotLogitsProcessor):
    """extra_args["boost_token_ids"], extra_args["boost"]: add the boost (float32) to
    those tokens' logits."""

    @classmethod
    def validate_params(cls, params: SamplingParams, vocab_size: int) -> None:
        boost_args(params.extra_args, vocab_size)

    def __init__(self, ctx: SlotProcessorContext) -> None:
        super().__init__(ctx)
        r = ctx.max_num_reqs
        # ids padded with the slot's first id: every entry of a used slot adds the boost to
        # its cell, so duplicate writes of one cell all write the same value (scatter_ with
        # differing duplicates would be nondeterministic); an unused slot writes every
        # cell back unchanged
        self.token_ids = torch.zeros(r, MAX_BOOST_TOKENS, dtype=torch.int64, device=ctx.device)
        self.used = torch.zeros(r, dtype=torch.bool, device=ctx.device)
        self.boost = torch.zeros(r, dtype=torch.float32, device=ctx.device)
        self.used_np = np.zeros(r, dtype=bool)

    def add_request(self, slot: int, params: SamplingParams) -> None:
        args = boost_args(params.extra_args, self.ctx.vocab_size)
        ids = np.zeros(MAX_BOOST_TOKENS, dtype=np.int64)
        if args.token_ids:
            ids[:] = args.token_ids[0]
            ids[: len(args.token_ids)] = args.token_ids
        # through a fresh pinned temporary, not a (synchronising) copy from pageable memory
        async_copy_to_device(ids, self.ctx.device, out=self.token_ids[slot])
        self.used[slot] = bool(args.token_ids)
        self.boost[slot] = float(np.float32(args.boost))
        self.used_np[slot] = bool(args.token_ids)

    def remove_request(self, slot: int) -> None:
        self.used_np[slot] = False
        self.used[slot] = False

    def apply(self, logits: torch.Tensor, idx_mapping: torch.Tensor) -> torch.Tensor:
        if not self.used_np.any():
            return logits
        idx = idx_mapping.long()
        ids = self.token_ids.index_select(0, idx)  # [N, B]
        used = self.used.index_select(0, idx)[:, None]
        boost = self.boost.index_select(0, idx).to(logits.dtype)[:, None]  # widened exactly
        current = logits.gather(1, ids)
        updated = torch.where(used, current + boost, current)
        return logits.scatter_(1, ids, updated)
