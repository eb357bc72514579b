"""Rank 0's side of tensor parallelism, its processes (shared/serving/tp_workers.py): start,
lockstep, stop, and a worker's death, on gloo over 127.0.0.1 with spawned workers running
tests/shared/serving/tp_fakes.py's runner.

What rank 0 gets back is the fake's all-gather over the device group, so every check
reads what each rank actually saw: the SchedulerOutput digest (against the digest of the
object the test sent), the CRC chain of the calls in order (equal on every rank), the KV
block count (the minimum of the ranks' own numbers), and the rank order."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import pytest

from shared.serving.tp_workers import TPWorkerError, start_tp_runner
from tests.shared.serving.tp_fakes import (
    BLOCKS,
    CHAIN,
    DIGEST,
    MATERIALIZED,
    RANK,
    FakeTPRunner,
    blocks_for,
    digest,
    fake_config,
    process_guard,
    run_step,
    scheduler_output,
    set_up,
    wait_gone,
)


@pytest.fixture(autouse=True)
def guard():
    with process_guard(60):
        yield


def check_rows(rows: list[list[int]], so, size: int, steps_before: int) -> None:
    assert [r[RANK] for r in rows] == list(range(size))
    assert {r[DIGEST] for r in rows} == {digest(so)}  # every rank saw this very output
    assert len({r[CHAIN] for r in rows}) == 1          # ... after the same calls in order
    assert {r[BLOCKS] for r in rows} == {min(blocks_for(r) for r in range(size))}
    assert rows[0][MATERIALIZED] == steps_before      # the test resolves each step at once
    # a worker resolves a step's output once the next one is launched: at most one behind
    assert all(r[MATERIALIZED] >= steps_before - 1 for r in rows[1:])


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_replays_the_calls_in_order_and_shuts_down_cleanly(size):
    tp = start_tp_runner(fake_config(size), "cpu", FakeTPRunner)
    assert set(tp.worker_pids) == set(range(1, size))
    num_blocks = set_up(tp)
    assert num_blocks == min(blocks_for(r) for r in range(size))
    assert tp.local_runner.num_blocks == num_blocks
    # the second step's prompt does not fit a message header: it crosses in two parts
    for i, prompt_len in enumerate([4, 20_000, 3]):
        so = scheduler_output(i, ["a", f"b{i}"], prompt_len)
        check_rows(run_step(tp, so), so, size, steps_before=i)
    assert tp.supports_async_scheduling is True  # attribute reads: rank 0's runner
    tp.shutdown()
    assert tp.closed and tp.worker_exitcodes == {r: 0 for r in range(1, size)}
    with pytest.raises(TPWorkerError, match="closed"):
        tp.execute_model(scheduler_output(9, ["a"]))
    tp.shutdown()  # idempotent


def test_garbage_collection_stops_the_workers():
    tp = start_tp_runner(fake_config(2), "cpu", FakeTPRunner)
    pids = list(tp.worker_pids.values())
    del tp
    gc.collect()
    assert wait_gone(pids, 10) == []


def test_a_killed_worker_fails_the_next_call_naming_it():
    tp = start_tp_runner(fake_config(3, timeout_s=8), "cpu", FakeTPRunner)
    set_up(tp)
    run_step(tp, scheduler_output(0, ["a"]))
    os.kill(tp.worker_pids[2], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TPWorkerError) as info:
        run_step(tp, scheduler_output(1, ["a"]))
    assert time.monotonic() - start < 8
    assert (info.value.rank, info.value.exitcode) == (2, -signal.SIGKILL)
    assert "rank 2 died" in str(info.value) and "SIGKILL" in str(info.value)
    assert "distributed_timeout_s=8" in str(info.value)
    assert tp.closed and all(code is not None for code in tp.worker_exitcodes.values())
    tp.reset_request_states()  # the engine's recovery after the error: a no-op now


def test_a_worker_killed_inside_a_collective_fails_the_step_at_once():
    tp = start_tp_runner(fake_config(2, timeout_s=20), "cpu", FakeTPRunner)
    set_up(tp)
    pid = tp.worker_pids[1]
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(TPWorkerError) as info:  # rank 1 hangs, then dies mid-step
        run_step(tp, scheduler_output(0, ["hang-1"]))
    assert time.monotonic() - start < 10  # the closed connection, not the 20 s timeout
    assert (info.value.rank, info.value.exitcode) == (1, -signal.SIGKILL)


def test_keyboard_interrupt_on_rank_0_stops_the_workers():
    tp = start_tp_runner(fake_config(2), "cpu", FakeTPRunner)
    set_up(tp)
    tp.local_runner.interrupt = True  # rank 0 only: the worker waits in the all-gather
    with pytest.raises(KeyboardInterrupt):
        run_step(tp, scheduler_output(0, ["a"]))
    assert tp.closed and tp.worker_exitcodes[1] is not None
    tp.reset_request_states()  # what the engine's recovery calls: no error over the Ctrl-C
    with pytest.raises(TPWorkerError, match="KeyboardInterrupt"):
        run_step(tp, scheduler_output(1, ["a"]))
