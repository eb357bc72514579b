"""V1 under tensor parallelism: rank 0 samples, every other rank receives its result.

Why V1 does it this way (V2 samples on every rank instead, runner_v2/model_runner.py):
V1's sampler is its most expensive stage, and part of it is host work (the bad-word
match, the custom processors' per-request state, the penalty tables built from Python
lists). Running it once and broadcasting a few [N] / [N, 1 + k] tensors costs one
small collective per step; every rank then does the same bookkeeping from the same
tokens, so the host token tables, the in-flight device tokens of async scheduling and
the draft proposers stay identical on every rank.

Only the sampler call is on rank 0: everything around it (the LM head's all-gather,
prompt logprobs, the draft model's forwards) is collective and runs on every rank.
The result's tensor shapes go first, over the gloo CPU group (host values, no device
sync); then each tensor over the device group, stream-ordered, so under async
scheduling the broadcast sits in the step's stream like the sampler it replaces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from shared.distributed.group import TPGroup

T = TypeVar("T")
_SRC = 0  # the engine's rank


class RankZeroSampling:
    def __init__(self, group: TPGroup, device: torch.device):
        self.group = group
        self.device = device

    def run(self, sample: Callable[[], T]) -> T:
        """`sample()` on rank 0 (its result returned and sent), or its result received.
        T is a frozen dataclass of tensors (or None fields): SamplerOutput, RejectionOutput."""
        if not self.group.distributed:
            return sample()
        if self.group.rank == _SRC:
            return self._send(sample())
        return self._receive()

    def _send(self, out: T) -> T:
        fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
        header = (type(out), {name: None if t is None else (tuple(t.shape), t.dtype)
                              for name, t in fields.items()})
        dist.broadcast_object_list([header], src=_SRC, group=self.group.cpu_group)
        for t in fields.values():
            if t is not None:
                dist.broadcast(t.contiguous(), src=_SRC, group=self.group.device_group)
        return out

    def _receive(self) -> T:
        box: list = [None]
        dist.broadcast_object_list(box, src=_SRC, group=self.group.cpu_group)
        cls, shapes = box[0]
        fields = {}
        for name, spec in shapes.items():
            if spec is None:
                fields[name] = None
                continue
            shape, dtype = spec
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(t, src=_SRC, group=self.group.device_group)
            fields[name] = t
        return cls(**fields)
