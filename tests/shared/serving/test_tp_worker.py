"""The worker side of tensor parallelism (shared/serving/tp_worker.py): the config and the
runner decision cross from rank 0, a failing call leaves the loop serving, torchrun's
ranks run the loop, and a worker never outlives rank 0."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from shared.distributed.init import free_port
from shared.serving.tp_worker import _watch
from shared.serving.tp_workers import start_tp_runner
from tests.shared.serving.tp_fakes import (
    BLOCKS,
    CHAIN,
    DIGEST,
    FAKE_RUNNER,
    FakeTPRunner,
    blocks_for,
    digest,
    fake_config,
    process_guard,
    run_step,
    scheduler_output,
    wait_gone,
)

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).with_name("tp_scripts.py")


@pytest.fixture(autouse=True)
def guard():
    with process_guard(90):
        yield


def consistent(rows: list[list[int]], so) -> bool:
    """Every rank saw `so` after the same calls."""
    return {r[DIGEST] for r in rows} == {digest(so)} and len({r[CHAIN] for r in rows}) == 1


def test_an_engine_config_crosses_and_the_worker_logs_rank_0s_decision(capfd):
    from policy import EngineArgs

    config = EngineArgs(model="tiny-llama", dtype="float64", device="cpu",
                        seed=0).create_engine_config()
    assert pickle.loads(pickle.dumps(config)).model_dump() == config.model_dump()
    decision = config.runner_decision.model_copy(update={"runner_class": FAKE_RUNNER})
    config = dataclasses.replace(
        config, runner_decision=decision,
        parallel_config=config.parallel_config.model_copy(update={"tensor_parallel_size": 2}))
    tp = start_tp_runner(config, "cpu", FakeTPRunner)
    tp.load_model()
    so = scheduler_output(0, ["a"])
    assert consistent(run_step(tp, so), so)
    tp.shutdown()
    assert tp.worker_exitcodes == {1: 0}
    err = capfd.readouterr().err
    line = f"TP rank 1/2: {decision.log_line()} (decided once, on rank 0)"
    assert line in err and "LlamaForCausalLM" in line


def test_a_failing_call_leaves_the_worker_serving(capfd):
    tp = start_tp_runner(fake_config(2), "cpu", FakeTPRunner)
    tp.load_model()
    assert tp.explode(1) == 0  # fails on rank 1 only; rank 0's result is returned
    so = scheduler_output(1, ["a"])
    assert consistent(run_step(tp, so), so)
    with pytest.raises(ValueError, match="deterministic"):  # every rank fails this step
        run_step(tp, scheduler_output(2, ["fail"]))
    tp.reset_request_states()  # the engine's recovery, replayed on the worker
    os.kill(tp.worker_pids[1], signal.SIGINT)  # Ctrl-C is rank 0's to handle
    so = scheduler_output(3, ["a", "b"])
    assert consistent(run_step(tp, so), so)
    tp.shutdown()
    assert tp.worker_exitcodes == {1: 0}
    err = capfd.readouterr().err
    assert "TP rank 1: explode (message 3) failed; this worker keeps serving" in err
    assert "TP rank 1: step (message 5) failed; this worker keeps serving" in err


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_torchrun_ranks_run_the_worker_loop(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(SCRIPTS), "torchrun", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log[-3000:]
    result = json.loads(out.read_text())
    assert result["num_blocks"] == min(blocks_for(0), blocks_for(1))
    for rows, expected in zip(result["rows"], result["digests"], strict=True):
        assert [r[DIGEST] for r in rows] == [expected, expected]
        assert rows[0][CHAIN] == rows[1][CHAIN] and rows[1][BLOCKS] == result["num_blocks"]
    assert "TP rank 1/2: Model runner" in log


def test_a_worker_does_not_outlive_rank_0():
    driver = subprocess.Popen([sys.executable, str(SCRIPTS), "orphan"], cwd=ROOT, env=_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([driver.stdout], [], [], 60)
        assert ready, "the driver did not start its worker"
        worker_pid = json.loads(driver.stdout.readline())["1"]
    finally:
        driver.kill()
        driver.wait()
    assert wait_gone([worker_pid], 10) == []


def test_the_watcher_exits_when_the_parent_is_gone():
    # a parent pid that is not this process's parent: the watcher's first check fires
    stub = types.SimpleNamespace(rank=1, busy=None)
    child = multiprocessing.get_context("fork").Process(target=_watch,
                                                        args=(stub, -1, threading.Event()))
    child.start()
    child.join(10)
    if child.exitcode is None:
        child.kill()
        child.join()
    assert child.exitcode == 1
