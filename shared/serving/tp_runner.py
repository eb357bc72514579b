"""TPRunner: what the engine uses as its runner under tensor parallelism.

It holds rank 0's runner; each call that changes a runner's state is sent to the other
ranks (shared/serving/tp_worker.py replays it) and then run locally; results and attribute
reads come from rank 0's runner. The protocol (HostChannel messages, rank 0 -> every
worker, in order):
  ("init", seq, config, runner_class, device)        build the runner; every rank reports
  ("call", seq, name, args, kwargs, sync)            runner.name(*args, **kwargs); with sync
                                                     (the set-up calls) every rank reports
                                                     its int result or -1 for a failure
  ("step", seq, scheduler_output)                    execute_model, then sample_tokens(None)
  ("shutdown", seq)                                  leave the loop
A step is ONE message: the engine always calls sample_tokens(None) right after
execute_model, so the worker runs both on the SchedulerOutput; only that crosses per step.
determine_num_blocks takes the minimum over the ranks, so every rank allocates the same
number of KV blocks.

Why gloo point-to-point sends and not a shared-memory ring (vLLM's broadcast queue): the
same code serves ranks on other hosts (multi-node torchrun); every send can be waited on
with a deadline, so a dead or hung worker becomes an error instead of a spin; a crashed
process leaves no /dev/shm segment behind; and the message is a few KB per step even
for a few hundred requests, whose hand-off costs a fraction of a millisecond on a CPU,
small next to a tensor-parallel forward of a model worth splitting.
A ring would pay off only at step rates where that hand-off shows in a profile.

Failures: a worker that died (its exit code is checked before every message) or that does
not take a message, report, or join a collective within distributed_timeout_s makes rank
0 raise TPWorkerError, naming the rank (its exit code, or the call it has posted being
stuck in) and the setting; the TPRunner is then closed and its workers killed. A runner's
own error (the same on every rank) propagates as it is, and the engine's recovery call
(reset_request_states) reaches the workers too. A KeyboardInterrupt inside a call stops
the workers (the group may be mid-collective).
"""

from __future__ import annotations

import functools
import inspect
import logging
import signal
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from shared.distributed.channel import ChannelError, busy_ranks
from shared.distributed.group import building_for

logger = logging.getLogger("runnerlab")

_SETTLE_S = 0.6  # > two of a worker watcher's periods (tp_worker._WATCH_PERIOD_S)


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died, hung or failed to set up; the TPRunner is closed."""

    def __init__(self, message: str, *, rank: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class TPRunner:
    """The engine's runner under tensor parallelism: rank 0's runner, with every call that
    changes state sent to the workers first (module docstring)."""

    def __init__(self, workers: Any):  # tp_workers.Workers
        self._workers = workers
        self._seq = 0
        self._sample_owed = False  # a step message was sent; its sample_tokens is local
        self._closed: str | None = None  # the reason, once closed
        self._finalizer = weakref.finalize(self, workers.stop, True)

    @property
    def _runner(self) -> Any:
        return self._workers.local_runner

    # ---- set-up: every rank reports, so a failure anywhere stops here -----------------
    def _build(self, config: Any, device: torch.device, runner_cls: type) -> None:
        path = f"{runner_cls.__module__}:{runner_cls.__qualname__}"

        def build() -> None:
            with building_for(self._workers.group):
                self._workers.local_runner = runner_cls(config, device)

        self._agree(("init", path), build, (config, path, device.type))

    def load_model(self) -> None:
        self._setup_call("load_model")

    def determine_num_blocks(self) -> int:
        """The minimum over the ranks: every rank allocates the same number of blocks."""
        per_rank = self._setup_call("determine_num_blocks")
        logger.info("Tensor parallel: KV blocks per rank %s; every rank allocates %d",
                    per_rank, min(per_rank))
        return min(per_rank)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._setup_call("initialize_kv_cache", num_blocks)

    def capture_model(self) -> None:
        self._setup_call("capture_model")

    def _setup_call(self, name: str, *args: Any) -> list[int]:
        return self._agree(("call", name), lambda: getattr(self._runner, name)(*args),
                           (name, args, {}, True))

    def _agree(self, what: tuple[str, str], local: Any, payload: tuple) -> list[int]:
        """Send, run locally, then gather every rank's int result (-1: it failed)."""
        self._send(what[0], *payload)
        status, error = 0, None
        try:
            result = local()
            status = result if type(result) is int else 0
        except KeyboardInterrupt:
            self._close("interrupted (KeyboardInterrupt)", graceful=False)
            raise
        except Exception as err:  # noqa: BLE001 (re-raised once the ranks have reported)
            status, error = -1, err
        try:
            per_rank = self._workers.channel.gather_int(status)
        except ChannelError as err:
            raise self._failure(err, what[1]) from (error or err)
        failed = [r for r, v in enumerate(per_rank) if v < 0 and r != 0]
        if error is not None or failed:
            self._close(f"{what[1]} failed", graceful=True)
        if error is not None:
            raise error
        if failed:
            raise TPWorkerError(f"{what[1]} failed on tensor-parallel rank(s) {failed} (their "
                                "log has the traceback); the tensor-parallel runner is closed",
                                rank=failed[0])
        return per_rank

    # ---- steps ----------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any) -> Any:
        self._send("step", scheduler_output)
        self._sample_owed = True
        try:
            return self._local("execute_model", self._runner.execute_model, scheduler_output)
        except BaseException:
            self._sample_owed = False  # the workers fail the same way and skip sampling
            raise

    def sample_tokens(self, grammar_output: Any = None) -> Any:
        if not self._sample_owed:
            return self._call("sample_tokens", grammar_output)
        self._sample_owed = False
        if grammar_output is not None:  # the workers already sampled with None
            self._close("sample_tokens got a grammar output", graceful=True)
            raise ValueError("structured output (a grammar output for sample_tokens) is not "
                             "supported with tensor_parallel_size > 1")
        return self._local("sample_tokens", self._runner.sample_tokens, None)

    def reset_request_states(self) -> None:
        self._sample_owed = False
        if self._closed is None:  # closed: nothing to reset, let the first error propagate
            self._call("reset_request_states")

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self._send("call", name, args, kwargs, False)
        return self._local(name, getattr(self._runner, name), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        workers = self.__dict__.get("_workers")
        runner = None if workers is None else workers.local_runner
        if runner is None or name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(runner, name)
        if inspect.ismethod(attr) and attr.__self__ is runner:  # a call: every rank runs it
            return functools.partial(self._call, name)
        return attr  # a read: rank 0's value

    # ---- lifecycle ------------------------------------------------------------------
    @property
    def local_runner(self) -> Any:
        return self._runner

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @property
    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of the workers rank 0 spawned (none under torchrun)."""
        return {rank: proc.pid for rank, proc in self._workers.procs.items()}

    @property
    def worker_exitcodes(self) -> dict[int, int | None]:
        return {rank: proc.exitcode for rank, proc in self._workers.procs.items()}

    def shutdown(self) -> None:
        """Stop the workers and leave the group. Idempotent."""
        if self._closed is None:
            self._closed = "shut down"
        self._finalizer()

    def _close(self, reason: str, graceful: bool) -> None:
        if self._closed is None:
            self._closed = reason
        self._finalizer.detach()
        self._workers.stop(graceful)

    # ---- sending, running, diagnosing -------------------------------------------------
    def _send(self, kind: str, *payload: Any) -> None:
        if self._closed is not None:
            raise TPWorkerError(f"the tensor-parallel runner is closed ({self._closed})")
        self._seq += 1
        label = {"init": "building the runner", "step": "the step"}.get(kind) or payload[0]
        what = f"message {self._seq} ({label})"
        dead = self._workers.dead()
        try:
            if dead:
                raise ChannelError(next(iter(dead)), "")
            self._workers.channel.send((kind, self._seq, *payload))
        except ChannelError as err:
            raise self._failure(err, what) from err
        except KeyboardInterrupt:
            self._close("interrupted (KeyboardInterrupt)", graceful=False)
            raise

    def _local(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            self._close("interrupted (KeyboardInterrupt)", graceful=False)
            raise
        except Exception as err:
            if self._workers.dead() or _is_distributed_error(err):
                raise self._failure(err, name) from err
            raise  # the runner's own error: every rank had it; the engine recovers

    def _failure(self, err: Exception, what: str) -> TPWorkerError:
        """The error that names who failed; closes the runner and kills the workers."""
        timeout_s = self._workers.timeout_s
        # a closed connection: its worker is exiting, and will be reapable in a moment
        lost = any(word in str(err).lower() for word in ("closed", "reset", "refused"))
        dead = self._workers.wait_for_exit(1.0 if lost else 0.0)
        if not dead:
            # The ranks that only waited on the stuck one in the collective time out at
            # about the same moment as rank 0 and withdraw their busy posts; let them.
            time.sleep(_SETTLE_S)
        busy = busy_ranks(self._workers.group) if self._workers.group else {}
        rank = getattr(err, "rank", None)
        if dead:
            rank = rank if rank in dead else next(iter(dead))
            head = f"tensor-parallel worker rank {rank} died ({exit_words(dead[rank])})"
        elif busy:
            rank = rank if rank in busy else next(iter(busy))
            head = f"tensor-parallel worker rank {rank} hangs ({busy.pop(rank)})"
        elif rank is not None:
            head = f"tensor-parallel worker rank {rank} did not answer"
        else:
            head = "a collective of the tensor-parallel group failed on rank 0"
        states = "; ".join(f"rank {r} {text}" for r, text in busy.items())
        cause = f": {err}" if str(err) else ""
        message = (f"{head} during {what}, within distributed_timeout_s={timeout_s:g}"
                   f"{'; ' + states if states else ''}{cause}. The tensor-parallel runner is "
                   "closed and its workers stopped; raise distributed_timeout_s if a step is "
                   "only slow")
        self._close(head, graceful=False)
        return TPWorkerError(message, rank=rank, exitcode=dead.get(rank) if dead else None)


def _is_distributed_error(err: BaseException) -> bool:
    """torch.distributed's own errors, and gloo's, which arrive as plain RuntimeErrors."""
    text = str(err).lower()
    return isinstance(err, dist.DistError) or "gloo" in text or "nccl" in text


def exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"exit code {code}, killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"
