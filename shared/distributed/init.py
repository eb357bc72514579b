"""How one process joins its tensor-parallel group, and leaves it.

Two process groups per rank, as vLLM keeps them: the *device* group (NCCL on CUDA, gloo
on CPU) carries the layers' collectives; a *CPU* group (always gloo) beside it carries the
host-side messages (the per-step SchedulerOutput, the KV-size agreement). A separate CPU
group keeps those messages off the device stream and lets its timeout differ from the
collectives' (a worker waits on it for the next step, however long the engine idles).

The rendezvous store (rank 0 hosts it for tcp://; torchrun's agent for env://) is kept
for the group's life: the workers post there which call they have been busy in for a
while, so that rank 0 can name a hung rank (shared/distributed/channel.py).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.distributed.group import TPGroup

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when launched by torchrun (its variables, read for an
    env:// rendezvous), else None."""
    if not all(os.environ.get(name) for name in _TORCHRUN_VARS):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on `host` (rank 0's rendezvous store binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_tp_group(
    rank: int, world_size: int, *, init_method: str, device: str | torch.device,
    timeout_s: float, local_rank: int | None = None, message_timeout_s: float | None = None,
) -> TPGroup:
    """Join the group: the default process group (the device group) and a gloo CPU group.

    timeout_s bounds every collective of the device group and the rendezvous;
    message_timeout_s (default timeout_s) bounds the CPU group's operations on this rank
    alone: rank 0 gives its sends timeout_s, a worker waits for the next message far
    longer. On CUDA the rank's device (cuda:local_rank; local_rank defaults to rank) is
    made current first, so NCCL and every later "cuda" tensor land on it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # the prefix init_process_group gives a store it makes itself, so keys cannot collide
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    cpu_timeout = timedelta(seconds=timeout_s if message_timeout_s is None else message_timeout_s)
    cpu_group = dist.new_group(backend="gloo", timeout=cpu_timeout)
    return TPGroup(rank=rank, world_size=world_size, device_group=dist.group.WORLD,
                   cpu_group=cpu_group, store=dist.PrefixStore("runnerlab_tp/", store))


def destroy_tp_group(group: TPGroup) -> None:
    """Leave the group: the CPU group, then the default group. Idempotent."""
    if not group.distributed or not dist.is_initialized():
        return
    if group.cpu_group is not None:
        dist.destroy_process_group(group.cpu_group)
    dist.destroy_process_group()
