"""Example V1-interface logits processors (BatchUpdate-driven); their V2-interface twins,
with the same behaviour, are in runner_v2/example_logits_processors.py. The per-request
settings come from SamplingParams.extra_args (shared/sampling/example_processor_args.py).

Use: EngineArgs(logits_processors=["runner_v1.example_logits_processors:NoRepeatNGram"]).
Both keep their state by batch row and replay every BatchUpdate (`RowStates`), which is
the whole difficulty of the V1 interface: a row's request changes under condense() and
reordering, and a processor that forgets a move applies the wrong request's state.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from runner_v1.batch_update import AddedRequest, BatchUpdate, MoveDirectionality
from runner_v1.logits_processor import BatchProcessorContext, BatchUpdateLogitsProcessor
from shared.contract.sampling_params import SamplingParams
from shared.sampling.example_processor_args import boost_args, ngram_args


class RowStates:
    """Per-row state of a V1 processor, kept aligned with the persistent batch by
    replaying each BatchUpdate in its order: removed, added, moved."""

    def __init__(self) -> None:
        self.rows: dict[int, Any] = {}

    def replay(self, update: BatchUpdate | None, make) -> None:
        """make(added) -> the row's state, or None when the processor ignores the request."""
        if update is None:
            return
        for row in update.removed:
            self.rows.pop(row, None)
        for added in update.added:
            state = make(added)
            if state is None:
                self.rows.pop(added.row, None)  # the row's previous request is gone
            else:
                self.rows[added.row] = state
        for move in update.moved:
            src, dst = self.rows.pop(move.src, None), self.rows.pop(move.dst, None)
            if src is not None:
                self.rows[move.dst] = src
            if move.directionality is MoveDirectionality.SWAP and dst is not None:
                self.rows[move.src] = dst


class NoRepeatNGram(BatchUpdateLogitsProcessor):
    """extra_args["no_repeat_ngram_size"] = n: ban every token that would complete an
    n-gram already present in prompt + output."""

    @classmethod
    def validate_params(cls, params: SamplingParams, vocab_size: int) -> None:
        ngram_args(params.extra_args)

    def __init__(self, ctx: BatchProcessorContext) -> None:
        super().__init__(ctx)
        self.states = RowStates()

    @staticmethod
    def _make(added: AddedRequest):
        n = ngram_args(added.sampling_params.extra_args).size
        # the output list is the request's live list: it grows as the request decodes
        return None if n == 0 else (n, added.prompt_token_ids, added.output_token_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.states.replay(batch_update, self._make)

    def is_argmax_invariant(self) -> bool:
        return False

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        for row, (n, prompt, outputs) in self.states.rows.items():  # per request
            banned = banned_ngram_tokens(np.asarray(prompt + tuple(outputs), dtype=np.int64), n)
            rows.append(np.full(len(banned), row))
            cols.append(banned)
        if rows:
            r = torch.from_numpy(np.concatenate(rows)).to(logits.device)
            c = torch.from_numpy(np.concatenate(cols)).to(logits.device)
            logits[r, c] = float("-inf")
        return logits


def banned_ngram_tokens(seq: np.ndarray, n: int) -> np.ndarray:
    """Tokens t such that (last n - 1 tokens of seq, t) is an n-gram of seq."""
    m = n - 1
    if len(seq) < n:
        return seq[:0]
    windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], m)  # starts 0..L-n
    hits = (windows == seq[len(seq) - m:]).all(axis=1)
    return np.unique(seq[m:][hits])


class TargetTokenBoost(BatchUpdateLogitsProcessor):
    """extra_args["boost_token_ids"], extra_args["boost"]: add the boost (float32) to
    those tokens' logits."""

    @classmethod
    def validate_params(cls, params: SamplingParams, vocab_size: int) -> None:
        boost_args(params.extra_args, vocab_size)

    def __init__(self, ctx: BatchProcessorContext) -> None:
        super().__init__(ctx)
        self.states = RowStates()

    def _make(self, added: AddedRequest):
        args = boost_args(added.sampling_params.extra_args, self.ctx.vocab_size)
        return args if args.token_ids else None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.states.replay(batch_update, self._make)

    def is_argmax_invariant(self) -> bool:
        return False

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        items = list(self.states.rows.items())
        if not items:
            return logits
        rows = np.concatenate([np.full(len(a.token_ids), row) for row, a in items])
        cols = np.concatenate([np.asarray(a.token_ids, dtype=np.int64) for _, a in items])
        vals = np.concatenate([np.full(len(a.token_ids), np.float32(a.boost)) for _, a in items])
        r = torch.from_numpy(rows).to(logits.device)
        c = torch.from_numpy(cols).to(logits.device)
        v = torch.from_numpy(vals).to(logits.device, logits.dtype)  # float32, widened exactly
        logits[r, c] = logits[r, c] + v
        return logits
