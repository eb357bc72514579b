"""Tensor parallelism, rank 0's side: start the other ranks, and stop them.

`start_tp_runner` spawns ranks 1..N-1 (torch.multiprocessing, spawn, daemon processes) on
a free localhost port, or, under torchrun, joins the ranks torchrun started (env://); rank
0 joins the group too and builds its runner inside `building_for(group)`, as every worker
does (shared/serving/tp_worker.py). The engine then drives the returned TPRunner
(shared/serving/tp_runner.py: the protocol, the failures).

Stopping (`Workers.stop`; TPRunner.shutdown(), also on garbage collection and at exit):
a shutdown message, a wait, then terminate and kill what is left, then the process groups
are destroyed; after an error, the kill comes at once. A spawned worker exits by itself
when rank 0 is gone. The user's script must keep its top level under
`if __name__ == "__main__":`, as for any spawned process (the spawn re-imports it).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from policy.parallel import check_launch
from shared.distributed.channel import HostChannel
from shared.distributed.group import TPGroup
from shared.distributed.init import (
    destroy_tp_group,
    free_port,
    init_tp_group,
    torchrun_env,
)
from shared.serving.tp_runner import TPRunner, TPWorkerError, exit_words
from shared.serving.tp_worker import WorkerArgs, spawned_worker_main

__all__ = ["TPRunner", "TPWorkerError", "Workers", "start_tp_runner"]

logger = logging.getLogger("runnerlab")

_SHUTDOWN_WAIT_S = 5.0  # a worker asked to leave gets this long before it is terminated


def start_tp_runner(config: Any, device: str | torch.device, runner_cls: type) -> TPRunner:
    """Rank 0's runner of a group of config.parallel_config.tensor_parallel_size ranks."""
    parallel = config.parallel_config
    size, timeout_s = parallel.tensor_parallel_size, parallel.distributed_timeout_s
    if torch.distributed.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group (another "
            "tensor-parallel engine is alive, or the caller initialised one): a process joins "
            "one group at a time; shut the other engine down first (engine.shutdown())")
    device = torch.device(device)
    env = torchrun_env()
    if env is not None:
        rank, world_size, local_rank = env
        if rank != 0:
            raise RuntimeError(f"torchrun rank {rank} must run run_worker_from_torchrun(), "
                               "not an engine: only rank 0 drives the runners")
        if world_size != size:
            raise ValueError(f"torchrun started WORLD_SIZE={world_size} processes but "
                             f"tensor_parallel_size={size}; they must match")
        init_method, procs = "env://", {}
    else:
        # (the config checked this already; a hand-made config meets it here)
        check_launch(size, device.type, visible_devices=torch.cuda.device_count()
                     if device.type == "cuda" else None)
        local_rank, init_method = 0, f"tcp://127.0.0.1:{free_port()}"
        procs = _spawn_workers(size, init_method, device, timeout_s)
    if device.type == "cuda":  # the current device is per thread: this one's, and _join's
        torch.cuda.set_device(local_rank)
    workers = Workers(procs, timeout_s)
    try:
        workers.group = _join(workers, init_method, size, device, timeout_s, local_rank)
        workers.channel = HostChannel(workers.group, timeout_s)
        tp = TPRunner(workers)
        tp._build(config, device, runner_cls)
    except BaseException:
        workers.stop(graceful=False)
        raise
    logger.info("TP rank 0/%d: %s (decided here, once)", size,
                config.runner_decision.log_line())
    logger.info("Tensor parallel: %d ranks on %s (%s); step messages over a gloo CPU group, "
                "distributed_timeout_s=%g", size, device,
                "torchrun" if env is not None else f"worker pids {tp.worker_pids}", timeout_s)
    return tp


def _spawn_workers(size: int, init_method: str, device: torch.device,
                   timeout_s: float) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    procs = {}
    try:
        for rank in range(1, size):
            args = WorkerArgs(rank, size, rank, init_method, device.type, timeout_s, os.getpid())
            proc = ctx.Process(target=spawned_worker_main, args=(args,), daemon=True,
                               name=f"runnerlab-tp-rank{rank}")
            proc.start()
            procs[rank] = proc
    except BaseException:
        Workers(procs, timeout_s).stop(graceful=False)
        raise
    return procs


def _join(workers: Workers, init_method: str, size: int, device: torch.device,
          timeout_s: float, local_rank: int) -> TPGroup:
    """Rank 0 joins in a thread while it watches the workers: one that dies while starting
    (an import error, a bad device) is reported at once, not after the rendezvous timeout."""
    box: dict[str, Any] = {}

    def join() -> None:
        try:
            box["group"] = init_tp_group(0, size, init_method=init_method, device=device,
                                         timeout_s=timeout_s, local_rank=local_rank)
        except BaseException as err:  # noqa: BLE001 (re-raised below, in the caller's thread)
            box["error"] = err

    thread = threading.Thread(target=join, daemon=True, name="runnerlab-tp-join")
    thread.start()
    while thread.is_alive():
        thread.join(0.05)
        dead = workers.dead()
        if dead:
            rank, code = next(iter(dead.items()))
            raise TPWorkerError(f"tensor-parallel worker rank {rank} died while joining the "
                                f"group ({exit_words(code)}); its log has the reason",
                                rank=rank, exitcode=code)
    if "error" in box:
        raise TPWorkerError(f"joining the tensor-parallel group of {size} ranks failed within "
                            f"distributed_timeout_s={timeout_s:g}: {box['error']}") from box["error"]
    return box["group"]


class Workers:
    """Rank 0's hold on the other ranks: their processes (none under torchrun), the group
    and its channel. Kept apart from TPRunner so that the finalizer can hold it."""

    def __init__(self, procs: dict[int, Any], timeout_s: float):
        self.procs = procs
        self.timeout_s = timeout_s
        self.group: TPGroup | None = None
        self.channel: HostChannel | None = None
        # Rank 0's own runner. Its model's layers hold the process groups: it is dropped
        # (and collected) before the groups are destroyed, for the reason the workers drop
        # theirs (shared/serving/tp_worker.py: a group alive at interpreter exit aborts it).
        self.local_runner: Any = None
        self.stopped = False

    def dead(self) -> dict[int, int]:
        """rank -> exit code of the workers that have exited."""
        return {r: p.exitcode for r, p in self.procs.items() if p.exitcode is not None}

    def wait_for_exit(self, seconds: float) -> dict[int, int]:
        """The exited workers, after waiting up to `seconds` for one to exit (a worker whose
        connection just closed may take a moment to become reapable)."""
        deadline = time.monotonic() + seconds
        while not self.dead() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.dead()

    def stop(self, graceful: bool) -> None:
        """Idempotent. graceful: a shutdown message first; then terminate, then kill."""
        if self.stopped:
            return
        self.stopped = True
        if graceful and self.channel is not None:
            self.channel.timeout_s = min(self.timeout_s, _SHUTDOWN_WAIT_S)
            try:
                self.channel.send(("shutdown", -1))
            except Exception as err:  # noqa: BLE001 (the workers are stopped below anyway)
                logger.warning("Tensor parallel: a worker did not take the shutdown message "
                               "(%s); stopping it", err)
        wait_s = _SHUTDOWN_WAIT_S if graceful else 0.0
        for proc in self.procs.values():
            proc.join(wait_s)
        for stop in ("terminate", "kill"):
            for proc in self.procs.values():
                if proc.exitcode is None:
                    getattr(proc, stop)()
            for proc in self.procs.values():
                proc.join(_SHUTDOWN_WAIT_S)
        self.local_runner = None
        gc.collect()  # the model's reference cycles, too
        if self.group is not None:
            try:
                destroy_tp_group(self.group)
            except Exception as err:  # noqa: BLE001
                logger.warning("Tensor parallel: destroying the process groups failed: %s", err)
        self.channel = None  # it holds the groups too
