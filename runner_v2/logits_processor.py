"""V2's custom logits-processor interface (slot-keyed) and the runner's holder.

V2 never moves a request: it keeps one state row (its "slot") from add to finish, and
each step's batch is a gather through `idx_mapping` (batch row -> slot). So a V2
processor keeps its per-request state indexed by SLOT, is told `add_request(slot,
params)` / `remove_request(slot)`, and `apply(logits, idx_mapping)` reads its state
through the mapping. There is no BatchUpdate and no move, which is why a V1-interface
processor cannot run here (policy/logits_processors.py tells them apart).

A slot is reused after its request leaves, and nothing is cleared: add_request must
overwrite whatever the slot's previous request left (the same rule as every other
per-slot table of V2, runner_v2/states.py). Processors that need the token history read
the runner's device token table through the context (`all_token_ids[slot, :total_len]`,
prompt first), which post_update has advanced before the next step's sampler runs, so
no host copy and no sync is needed, with or without async scheduling.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from policy.logits_processors import LogitsProcessorSpec, load_class
from shared.contract.sampling_params import SamplingParams


@dataclass(frozen=True)
class SlotProcessorContext:
    """What a V2 processor is built with. The token tensors are the runner's own device
    state: read them, never write them."""

    max_num_reqs: int
    vocab_size: int
    device: torch.device
    all_token_ids: torch.Tensor  # int32 [R, max_model_len]: prompt + outputs per slot
    total_len: torch.Tensor  # int32 [R]: valid length of each slot's row
    prompt_len: torch.Tensor  # int32 [R]: the user prompt's length


class SlotLogitsProcessor(ABC):
    """Subclass this (or implement the same three methods) and list the class in
    EngineArgs.logits_processors."""

    @classmethod
    def validate_params(cls, params: SamplingParams, vocab_size: int) -> None:
        """Refuse a request this processor cannot serve (raise ValueError naming the
        setting); the engine calls it at admission, so a bad request fails alone instead
        of failing a step. Optional: the default accepts everything."""
        return None

    def __init__(self, ctx: SlotProcessorContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def add_request(self, slot: int, params: SamplingParams) -> None:
        """A request now owns `slot` (overwrite every bit of the slot's state)."""

    @abstractmethod
    def remove_request(self, slot: int) -> None:
        """The slot's request left (finished, aborted or preempted)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, idx_mapping: torch.Tensor) -> torch.Tensor:
        """logits [N, V] in the compute dtype, row b belongs to slot idx_mapping[b] (int32
        [N], on the device); may modify them in place; returns the processed logits."""


class V2LogitsProcessors:
    """The runner's instances of the configured V2-interface processors."""

    def __init__(self, specs: list[LogitsProcessorSpec], ctx: SlotProcessorContext) -> None:
        wrong = [s.name for s in specs if s.interface != "v2"]
        if wrong:  # the policy's feature gate refuses this first
            raise ValueError(f"the V2 runner cannot run V1-interface logits processors {wrong}")
        self.processors = [load_class(s)(ctx) for s in specs]
        self._slots: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.processors)

    def add_request(self, slot: int, params: SamplingParams) -> None:
        self._slots.add(slot)
        for p in self.processors:
            p.add_request(slot, params)

    def remove_request(self, slot: int) -> None:
        if slot in self._slots:
            self._slots.discard(slot)
            for p in self.processors:
                p.remove_request(slot)

    def reset(self) -> None:
        """Every slot left (the engine's recovery after a failed step)."""
        for slot in sorted(self._slots):
            self.remove_request(slot)

    def apply(self, logits: torch.Tensor, idx_mapping: torch.Tensor) -> torch.Tensor:
        for p in self.processors:
            logits = p.apply(logits, idx_mapping)
        return logits
