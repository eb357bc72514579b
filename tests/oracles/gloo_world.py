"""Run a function on N gloo ranks on localhost, in spawned processes, bounded in time.

`run_ranks(fn, world_size, timeout_s=...)` -> [fn's result on rank 0, on rank 1, ...].
fn(group: TPGroup, *args) runs in each rank with a gloo device group and a gloo CPU group
(what CPU tensor parallelism uses); it must be a module-level function (spawn pickles it).
Every process is joined, and killed if it outlives the timeout: no test leaves one behind.
"""

from __future__ import annotations

import socket
import traceback
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world_size: int, port: int, timeout_s: float, args: tuple,
               results) -> None:
    import torch.distributed as dist

    from shared.distributed.group import TPGroup

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        cpu = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        group = TPGroup(rank=rank, world_size=world_size, device_group=dist.group.WORLD,
                        cpu_group=cpu)
        results.put((rank, "ok", fn(group, *args)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (reported to the parent, which raises)
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, r, world_size, port, timeout_s, args, results))
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        for _ in procs:
            rank, status, value = results.get(timeout=timeout_s + 30)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = value
        return [got[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
