"""A tensor-parallel worker: ranks 1..N-1 run this loop instead of an engine.

It joins the group, receives its runner's configuration from rank 0 (the runner decision
was made once, there, and travels inside the config: a worker logs it with its rank and
never decides again), builds the runner inside `building_for(group)`, then replays rank
0's runner calls one message at a time until a shutdown message (the protocol is in
shared/serving/tp_runner.py).

A call that raises is logged with the rank and the loop goes on: a runner's failures are
deterministic (the same request fails the same way on every rank), so rank 0 fails too
and its recovery (reset_request_states) arrives as the next messages. A worker never
outlives rank 0: losing the connection to it ends the loop, and a watcher thread exits
the process when its parent (a spawned worker's rank 0) is gone.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from shared.distributed.channel import HostChannel, post_busy
from shared.distributed.group import TPGroup, building_for
from shared.distributed.init import destroy_tp_group, init_tp_group, torchrun_env

logger = logging.getLogger("runnerlab")

# A worker waits for rank 0's next message this long: an engine may idle for hours
# between requests, and a dead rank 0 is seen at once anyway (its connections close).
IDLE_TIMEOUT_S = 365 * 24 * 3600.0
# A call running longer than this is posted to the rendezvous store (channel.post_busy),
# so a rank 0 whose collective times out can name the rank that hangs.
POST_BUSY_AFTER_S = 1.0
_WATCH_PERIOD_S = 0.2


@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    world_size: int
    local_rank: int
    init_method: str
    device: str
    timeout_s: float               # ParallelConfig.distributed_timeout_s
    parent_pid: int | None = None  # a spawned worker exits when this process is gone


def spawned_worker_main(args: WorkerArgs) -> None:
    """The target of a worker process rank 0 spawned."""
    raise SystemExit(serve(args))


def run_worker_from_torchrun(parallel: Any, device: str) -> None:
    """Under torchrun, ranks other than 0 call this instead of building an engine: they
    serve rank 0's runner until it shuts down, then return (an error exit raises
    SystemExit). Only the ParallelConfig and the device are needed here: the runner's
    configuration, and the runner decision in it, are rank 0's, received over the group
    (the policy decides once)."""
    env = torchrun_env()
    if env is None or env[0] == 0:
        raise RuntimeError("run_worker_from_torchrun() is for torchrun's ranks other than 0 "
                           f"(torchrun env: {env}); rank 0 builds the engine")
    rank, world_size, local_rank = env
    if world_size != parallel.tensor_parallel_size:
        raise ValueError(f"torchrun started WORLD_SIZE={world_size} processes but "
                         f"tensor_parallel_size={parallel.tensor_parallel_size}; they must match")
    code = serve(WorkerArgs(rank, world_size, local_rank, "env://",
                            device, parallel.distributed_timeout_s))
    if code:
        raise SystemExit(code)


def serve(args: WorkerArgs) -> int:
    """Join, serve until shutdown, leave. -> the exit code (0: shut down by rank 0)."""
    # Ctrl-C reaches the whole foreground process group: rank 0 decides what it means
    # (it stops the workers); a worker interrupted on its own would desynchronise them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    group = init_tp_group(args.rank, args.world_size, init_method=args.init_method,
                          device=args.device, timeout_s=args.timeout_s,
                          local_rank=args.local_rank, message_timeout_s=IDLE_TIMEOUT_S)
    stop, watcher = threading.Event(), None
    try:
        worker = Worker(group, HostChannel(group, args.timeout_s))
        watcher = threading.Thread(target=_watch, args=(worker, args.parent_pid, stop),
                                   daemon=True, name=f"runnerlab-tp-watch-{args.rank}")
        watcher.start()
        return worker.run()
    finally:
        # Nothing may hold a process group once it is destroyed: a gloo group whose last
        # reference (the runner's, the watcher's) goes only at interpreter exit can abort
        # the process there ("terminate called without an active exception").
        stop.set()
        if watcher is not None:
            watcher.join(_WATCH_PERIOD_S + 1.0)
        worker = watcher = None
        destroy_tp_group(group)
        gc.collect()  # a model's reference cycles, too


class Worker:
    def __init__(self, group: TPGroup, channel: HostChannel):
        self.group = group
        self.rank = group.rank
        self.channel = channel
        self.runner: Any = None
        # The last step's async output, materialised after the next step is launched (as
        # the engine does under async scheduling), so its pinned slot is freed.
        self._pending: Any = None
        # (message number, what, wall-clock start) while a call runs: the watcher's view
        self.busy: tuple[int, str, float] | None = None

    def run(self) -> int:
        while True:
            try:
                message = self.channel.recv()
            except Exception as err:  # noqa: BLE001 (any failure here means rank 0 is gone)
                logger.error("TP rank %d: lost rank 0 (%s); exiting", self.rank, err)
                return 1
            kind, seq = message[0], message[1]
            if kind == "shutdown":
                self._settle_pending()
                return 0
            self.busy = (seq, _label(message), time.time())
            try:
                self._handle(kind, seq, *message[2:])
            except Exception as err:  # noqa: BLE001 (the runner's own errors are caught below)
                logger.error("TP rank %d: lost rank 0 during message %d (%s); exiting",
                             self.rank, seq, err)
                return 1
            finally:
                self.busy = None

    def _handle(self, kind: str, seq: int, *payload: Any) -> None:
        if kind == "step":
            self._step(seq, *payload)
        elif kind == "call":
            self._call(seq, *payload)
        elif kind == "init":
            self._init(seq, *payload)
        else:
            raise RuntimeError(f"unknown message kind {kind!r}")

    def _init(self, seq: int, config: Any, runner_class: str, device: str) -> None:
        from shared.serving.engine import resolve_runner_class  # the engine imports us

        logger.info("TP rank %d/%d: %s (decided once, on rank 0)", self.rank,
                    self.group.world_size, config.runner_decision.log_line())
        status = 0
        try:
            with building_for(self.group):
                self.runner = resolve_runner_class(runner_class)(config, torch.device(device))
        except Exception:  # noqa: BLE001 (reported to rank 0 through the gather)
            logger.exception("TP rank %d: building %s failed", self.rank, runner_class)
            status = -1
        self.channel.gather_int(status)

    def _call(self, seq: int, name: str, args: tuple, kwargs: dict, sync: bool) -> None:
        self._settle_pending()
        value = 0
        try:
            result = getattr(self.runner, name)(*args, **kwargs)
            if hasattr(result, "get_output"):
                result.get_output()
            if type(result) is int:
                value = result
        except Exception:  # noqa: BLE001 (logged; rank 0 fails the same way)
            logger.exception("TP rank %d: %s (message %d) failed; this worker keeps serving",
                             self.rank, name, seq)
            value = -1
        if sync:  # a set-up call: every rank reports (its result, or -1 for a failure)
            self.channel.gather_int(value)

    def _step(self, seq: int, scheduler_output: Any) -> None:
        output = None
        try:
            self.runner.execute_model(scheduler_output)
            output = self.runner.sample_tokens(None)
        except Exception:  # noqa: BLE001 (logged; rank 0 fails the same way)
            logger.exception("TP rank %d: step (message %d) failed; this worker keeps serving",
                             self.rank, seq)
        self._settle_pending()
        self._pending = output if hasattr(output, "get_output") else None

    def _settle_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.get_output()
        except Exception:  # noqa: BLE001
            logger.exception("TP rank %d: resolving a step's output failed", self.rank)


def _label(message: tuple) -> str:
    if message[0] == "step":
        return "execute_model + sample_tokens"
    return message[2] if message[0] == "call" else "building the runner"


def _watch(worker: Worker, parent_pid: int | None, stop: threading.Event) -> None:
    """Exit when the parent is gone; post a call that runs long (channel.post_busy)."""
    posted: int | None = None
    while not stop.wait(_WATCH_PERIOD_S):
        if parent_pid is not None and os.getppid() != parent_pid:
            logger.error("TP rank %d: rank 0 (pid %d) is gone; exiting", worker.rank, parent_pid)
            os._exit(1)
        busy = worker.busy
        long_call = busy is not None and time.time() - busy[2] >= POST_BUSY_AFTER_S
        key = busy[0] if long_call else None
        if key != posted:
            if key is None:
                post_busy(worker.group, None)
            else:
                post_busy(worker.group, busy[1], busy[0], busy[2])
            posted = key
