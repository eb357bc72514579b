"""V1's custom logits-processor interface (BatchUpdate-driven) and the runner's holder.

A V1 processor keeps its per-request state indexed by BATCH ROW, because that is what
`apply(logits)` sees: row i of the logits is row i of the dense persistent batch. Rows
move (condense() fills holes from the top, reordering swaps decodes to the front), so
every step the processor receives the step's BatchUpdate (runner_v1/batch_update.py)
and must replay it, in its order: removed, then added, then moved (SWAP or
UNIDIRECTIONAL). A processor that ignores moves applies one request's state to another
request's row (tests/runner_v1/test_logits_processor.py shows one failing).

The runner calls `update_state` on every step that touched the batch, including steps
that run nothing (a finish-only step), so no record is ever folded into another's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from policy.logits_processors import LogitsProcessorSpec, load_class
from runner_v1.batch_update import BatchUpdate
from shared.contract.sampling_params import SamplingParams


@dataclass(frozen=True)
class BatchProcessorContext:
    """What a V1 processor is built with."""

    max_num_reqs: int
    vocab_size: int
    device: torch.device


class BatchUpdateLogitsProcessor(ABC):
    """Subclass this (or implement the same three methods) and list the class in
    EngineArgs.logits_processors."""

    @classmethod
    def validate_params(cls, params: SamplingParams, vocab_size: int) -> None:
        """Refuse a request this processor cannot serve (raise ValueError naming the
        setting); the engine calls it at admission, so a bad request fails alone instead
        of failing a step. Optional: the default accepts everything."""
        return None

    def __init__(self, ctx: BatchProcessorContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """The rows' changes since the last call (None: nothing moved)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [num_reqs, V] in the compute dtype, rows = batch rows; may modify them in
        place; returns the processed logits."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when apply never changes a row's argmax: a greedy batch skips it."""


class V1LogitsProcessors:
    """The runner's instances of the configured V1-interface processors."""

    def __init__(self, specs: list[LogitsProcessorSpec], ctx: BatchProcessorContext) -> None:
        wrong = [s.name for s in specs if s.interface != "v1"]
        if wrong:  # the policy's feature gate refuses this first
            raise ValueError(f"the V1 runner cannot run V2-interface logits processors {wrong}")
        self.processors = [load_class(s)(ctx) for s in specs]

    def __bool__(self) -> bool:
        return bool(self.processors)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        for p in self.processors:
            p.update_state(batch_update)

    def apply(self, logits: torch.Tensor, all_greedy: bool) -> torch.Tensor:
        """logits: a private compute-dtype tensor (the raw logits stay untouched for the
        logprobs)."""
        for p in self.processors:
            if all_greedy and p.is_argmax_invariant():
                continue
            logits = p.apply(logits)
        return logits
