"""Run a function on N gloo ranks on localhost, in spawned processes, bounded in time.

`run_ranks(fn, world_size, timeout_s=...)` -> [fn's result on rank 0, on rank 1, ...].
fn(group: TPGroup, *args) runs in each rank with a gloo device group and a gloo CPU group
(what CPU tensor parallelism uses); it must be a module-level function (spawn pickles it).
Every process is joined, and killed if it outlives the timeout: no test leaves one behind.
Results come back through one pipe per rank, by value: a multiprocessing queue would put
named semaphores in /dev/shm for its lifetime (which the process guards of tests running
beside these in another xdist worker count as leaks), and torch's pickler would pass a
tensor's storage as a descriptor fetched from the rank after it may have exited.
"""

from __future__ import annotations

import pickle
import socket
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world_size: int, port: int, timeout_s: float, args: tuple,
               result) -> None:
    import torch.distributed as dist

    from shared.distributed.group import TPGroup

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        cpu = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        group = TPGroup(rank=rank, world_size=world_size, device_group=dist.group.WORLD,
                        cpu_group=cpu)
        result.send_bytes(pickle.dumps((rank, "ok", fn(group, *args))))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (reported to the parent, which raises)
        result.send_bytes(pickle.dumps((rank, "error", traceback.format_exc())))
    finally:
        result.close()


def run_ranks(fn, world_size: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]  # (receive, send) ends
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, r, world_size, port, timeout_s, args, pipes[r][1]))
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        for _, send in pipes:
            send.close()  # the ranks hold theirs: a dead rank's pipe then reads as closed
        got: dict[int, Any] = {}
        pending = [receive for receive, _ in pipes]
        deadline = time.monotonic() + timeout_s + 30
        while pending:  # in the order the ranks answer: the first failure is reported
            ready = wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"ranks still silent after {timeout_s + 30:g} s")
            for receive in ready:
                pending.remove(receive)
                try:
                    rank, status, value = pickle.loads(receive.recv_bytes())
                except EOFError:
                    raise AssertionError("a rank exited without a result") from None
                if status != "ok":
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                got[rank] = value
        return [got[r] for r in range(world_size)]
    finally:
        for receive, _ in pipes:
            receive.close()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
