"""TPRunner's protocol under failure (shared/serving/tp_runner.py): a hung worker is named
within distributed_timeout_s, and a set-up call that fails anywhere stops the group."""

from __future__ import annotations

import time

import pytest

from shared.serving.tp_workers import TPWorkerError, start_tp_runner
from tests.shared.serving.tp_fakes import (
    FakeTPRunner,
    fake_config,
    process_guard,
    run_step,
    scheduler_output,
    set_up,
)


@pytest.fixture(autouse=True)
def guard():
    with process_guard(60):
        yield


def test_a_hung_worker_fails_the_step_within_the_timeout_naming_it():
    # (the same timeout bounds the workers' start: a spawned worker imports torch, which
    # took more than 3 s with two test workers on the CI machine's two cores)
    timeout_s = 10.0
    tp = start_tp_runner(fake_config(2, timeout_s=timeout_s), "cpu", FakeTPRunner)
    set_up(tp)
    start = time.monotonic()
    with pytest.raises(TPWorkerError) as info:
        run_step(tp, scheduler_output(0, ["hang-1"]))
    elapsed = time.monotonic() - start
    assert timeout_s - 0.5 < elapsed < timeout_s + 3
    assert (info.value.rank, info.value.exitcode) == (1, None)
    assert "rank 1 hangs" in str(info.value) and "execute_model" in str(info.value)
    assert f"distributed_timeout_s={timeout_s:g}" in str(info.value)
    assert tp.closed and all(code is not None for code in tp.worker_exitcodes.values())


def test_a_set_up_failure_on_a_worker_names_it_and_closes():
    tp = start_tp_runner(fake_config(2, fail_load_on_rank=1), "cpu", FakeTPRunner)
    with pytest.raises(TPWorkerError, match=r"load_model failed on tensor-parallel rank\(s\) \[1\]"):
        tp.load_model()
    assert tp.closed and tp.worker_exitcodes == {1: 0}  # it was asked to leave, and left


def test_a_set_up_failure_on_rank_0_is_its_own_error():
    tp = start_tp_runner(fake_config(2, fail_load_on_rank=0), "cpu", FakeTPRunner)
    with pytest.raises(OSError, match="no weights on rank 0"):
        tp.load_model()
    assert tp.closed and tp.worker_exitcodes == {1: 0}
