"""The tensor-parallel group of one rank, and the collectives the model's layers call.

A model is built for one TPGroup (`building_for`): its parallel layers read the group
at construction, the way they read the default dtype and device, and keep it. A model
built outside `building_for` gets SINGLE (rank 0 of 1, no process group): every
collective is then the identity and the layers run exactly the single-GPU arithmetic.

A group of size 1 *with* process groups (the distributed path on one GPU) still calls
the collectives, so a size-1 run exercises what a size-N run does, graphs included.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    # torch.distributed process groups: the device group carries the activations' collectives
    # (NCCL on CUDA, gloo on CPU); the CPU group (always gloo) carries host-side messages
    # (the per-step SchedulerOutput, the KV-size agreement). None: a single process.
    device_group: Any = None
    cpu_group: Any = None
    # The group's rendezvous store (prefixed): where a worker posts a call it has been
    # busy in for a while, so rank 0 can name a hung rank (shared/distributed/channel.py).
    store: Any = None

    @property
    def distributed(self) -> bool:
        return self.device_group is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns x. Capturable in a CUDA graph on NCCL."""
        if self.device_group is not None:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along `dim` in rank order (on every rank)."""
        if self.device_group is None:
            return x
        x = x.contiguous()
        if x.is_cuda:  # one output buffer, no list: what NCCL captures in a graph
            out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.device_group)
            parts = out.unbind(0)
        else:  # gloo has no all_gather_into_tensor
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def shard(self, size: int, what: str) -> int:
        """This rank's share of `size` items that must split evenly; else a clear error."""
        if size % self.world_size:
            raise ValueError(
                f"tensor_parallel_size={self.world_size} does not divide {what} ({size}); "
                f"choose a tensor_parallel_size that divides {size}")
        return size // self.world_size


SINGLE = TPGroup()

_BUILDING: contextvars.ContextVar[TPGroup] = contextvars.ContextVar(
    "runnerlab_tp_group", default=SINGLE)


def current_tp_group() -> TPGroup:
    """The group the model under construction is built for (SINGLE outside `building_for`)."""
    return _BUILDING.get()


@contextlib.contextmanager
def building_for(group: TPGroup) -> Iterator[TPGroup]:
    token = _BUILDING.set(group)
    try:
        yield group
    finally:
        _BUILDING.reset(token)
