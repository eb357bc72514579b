"""AsyncEngine: an LLMEngine stepped by a background thread, fed by an asyncio server.

The engine is not thread-safe, so one thread owns it: the engine thread adds and aborts
requests between steps (commands arrive on a queue) and steps while anything is
unfinished. Handlers on the event loop never touch the engine: a ResponseStream queues
an add and awaits its admission (a bad request raises its EngineInputError there, before
anything streams), then reads its requests' outputs from an asyncio queue the engine
thread fills with `call_soon_threadsafe`, once per step for all requests at once. A
response that ends early (a disconnected client) aborts its unfinished requests, so
their KV blocks return to the pool at the next step.

A step that raises is rolled back by the engine (its requests are requeued); if the
retry fails too, every request in flight fails with the error (a 500 for its client)
and the engine goes on serving new requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from shared.contract.outputs import RequestOutput
from shared.contract.sampling_params import RequestOutputKind, SamplingParams
from shared.serving.api.coalesce import coalesce
from shared.serving.engine import LLMEngine

logger = logging.getLogger("runnerlab")

# Consecutive failed steps after which the requests in flight are failed, not retried:
# the engine's recovery has requeued them once and the step failed again.
_MAX_FAILED_STEPS = 2


class EngineStepError(RuntimeError):
    """The engine could not run a request's steps (the cause is chained)."""


@dataclass
class _Stream:
    """One request, as the engine thread sees it: where its outputs go, and its times."""

    queue: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    num_tokens: int = 0
    aborted: bool = False  # by its client: its outputs are counted, never delivered
    # each sample's finish reason, as its outputs report it (a DELTA output carries only
    # the samples a step advanced, so the final one may not name them all)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    delta: bool = False  # its outputs are DELTA (what each step added), else CUMULATIVE


class ResponseStream:
    """The requests of one HTTP response (one per prompt), on the event loop: their
    outputs arrive on one queue, in step order; a request's outputs that waited there
    together come out merged into one (api/coalesce.py). Iterate it; abort() what is
    unfinished when the response ends early (the handler's finally)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self.pending: set[str] = set()
        self._delta: set[str] = set()  # requests whose outputs are DELTA (coalesce)

    async def add(self, request_id: str, prompt_token_ids: list[int],
                  params: SamplingParams) -> None:
        """Queue one request; raises the engine's EngineInputError if it is refused."""
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        self._engine._send(("add", request_id, prompt_token_ids, params,
                            _Stream(self._queue), admitted))
        await asyncio.wrap_future(admitted)
        self.pending.add(request_id)
        if params.output_kind is RequestOutputKind.DELTA:
            self._delta.add(request_id)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        while self.pending:
            waiting = [await self._queue.get()]
            while not self._queue.empty():  # fallen behind: one output a request (coalesce)
                waiting.append(self._queue.get_nowait())
            for out in coalesce(waiting, self._delta):
                if isinstance(out, BaseException):
                    self.pending.clear()  # the engine has dropped every request in flight
                    raise out
                if out.finished:
                    self.pending.discard(out.request_id)
                yield out

    def abort(self) -> None:
        for request_id in self.pending:
            self._engine.abort(request_id)
        self.pending.clear()


@dataclass(frozen=True)
class EngineSnapshot:
    """What /metrics reads, copied by the engine thread after each step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observer: Any = None, idle_wait_s: float = 0.5):
        # every request reports each step that advanced it (the TTFT / ITL metrics read
        # them): streamed ones as DELTA (streaming.stream_params), the others with the
        # default CUMULATIVE
        self.engine = engine
        self.observer = observer  # ServerMetrics or None: TTFT / ITL / step times
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failed_steps = 0
        self.snapshot = EngineSnapshot(kv_blocks_total=engine.num_total_kv_blocks())

    # ---- lifecycle (event loop) -------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="runnerlab-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort everything, stop the engine thread and the engine's workers."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests (event loop) --------------------------------------------------------
    def stream(self) -> ResponseStream:
        """A new response's stream: add() its requests, then iterate it."""
        return ResponseStream(self)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        if not self.is_running:
            raise EngineStepError("the engine loop is not running")
        self._commands.put(command)
        self._wake.set()

    # ---- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()  # before draining: a command queued after it wakes us
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(self._idle_wait_s)
                    continue
                self._step()
        except BaseException:  # a bug here must not leave clients waiting forever
            logger.exception("The engine loop stopped")
            self._fail_all(EngineStepError("the engine loop stopped"))
            raise
        finally:
            self._abort_all_on_stop()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._add(*command[1:])
            elif command[1] in self._streams:  # abort: only a request still streaming
                # kept until the engine reports the abort, for the finished counts
                self._streams[command[1]].aborted = True
                self.engine.abort_request(command[1])

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams,
             stream: _Stream, admitted: concurrent.futures.Future) -> None:
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as exc:  # noqa: BLE001 (handed to the request's handler)
            admitted.set_exception(exc)
            return
        stream.delta = params.output_kind is RequestOutputKind.DELTA
        self._streams[request_id] = stream
        admitted.set_result(None)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 (the engine has rolled the step back)
            self._failed_steps += 1
            logger.exception("Engine step failed (%d in a row)", self._failed_steps)
            if self._failed_steps >= _MAX_FAILED_STEPS:
                self._failed_steps = 0
                error = EngineStepError(f"the engine failed this request's step: {exc!r}")
                error.__cause__ = exc
                self._fail_all(error)
            return
        self._failed_steps = 0
        now = time.perf_counter()
        if self.observer is not None:
            self.observer.observe_step(now - start, self.engine.step_stats)
        self._dispatch(outputs, now)
        self._take_snapshot()

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            self._observe_tokens(stream, out, now)
            if out.finished:
                del self._streams[out.request_id]
            if not stream.aborted:  # nobody reads an aborted request's outputs
                batch.append((stream, out))
        if batch:
            self._call_on_loop(batch)

    def _observe_tokens(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        reported = sum(len(c.token_ids) for c in out.outputs)
        # DELTA: this step's tokens only; CUMULATIVE: every token so far
        new = reported if stream.delta else reported - stream.num_tokens
        if new > 0 and self.observer is not None:
            if stream.last_token is None:
                self.observer.observe_ttft(now - stream.arrival)
            else:
                self.observer.observe_itl(now - stream.last_token, new)
        if new > 0:
            stream.num_tokens, stream.last_token = stream.num_tokens + new, now
        for c in out.outputs:
            if c.finish_reason is not None:
                stream.finish_reasons[c.index] = c.finish_reason
        if out.finished and self.observer is not None:
            self.observer.observe_finished(len(out.prompt_token_ids), stream.num_tokens,
                                           list(stream.finish_reasons.values()),
                                           now - stream.arrival)

    def _take_snapshot(self) -> None:
        scheduler = self.engine.scheduler
        total = self.engine.num_total_kv_blocks()
        self.snapshot = EngineSnapshot(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_blocks_used=total - self.engine.num_free_kv_blocks(), kv_blocks_total=total)

    def _fail_all(self, error: BaseException) -> None:
        """Fail every request in flight with `error` and abort it in the engine."""
        streams, self._streams = self._streams, {}
        if streams:
            self.engine.abort_request(list(streams))
            self._call_on_loop([(s, error) for s in streams.values() if not s.aborted])

    def _call_on_loop(self, batch: list[tuple[_Stream, Any]]) -> None:
        try:
            self._loop.call_soon_threadsafe(_deliver, batch)  # type: ignore[union-attr]
        except RuntimeError:  # the loop has closed (shutdown): nobody is reading
            pass

    def _abort_all_on_stop(self) -> None:
        if self._streams:
            self._fail_all(EngineStepError("the server is shutting down"))
        try:
            while self.engine.has_unfinished_requests():  # report the aborts, free blocks
                self.engine.step()
        except Exception:  # noqa: BLE001 (shutting down: nothing is waiting for these)
            logger.exception("Draining the engine at shutdown failed")


def _deliver(batch: list[tuple[_Stream, Any]]) -> None:
    """On the event loop: hand each output (or error) to its response's queue."""
    for stream, item in batch:
        stream.queue.put_nowait(item)
