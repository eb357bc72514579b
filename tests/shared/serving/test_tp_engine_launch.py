"""Tensor parallelism, the launches and the failures, with the real engine:
- a `torchrun --nproc-per-node 2` launch of the offline LLM gives the one-rank outputs;
- a worker killed mid-run makes rank 0 raise TPWorkerError within distributed_timeout_s,
  and no process is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from policy import EngineArgs
from shared.contract.sampling_params import SamplingParams
from shared.distributed.init import free_port
from shared.serving.engine import LLMEngine
from shared.serving.llm import LLM
from shared.serving.tp_runner import TPWorkerError
from tests.shared.serving import tp_llm_script
from tests.shared.serving.tp_fakes import live_children, process_guard

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_torchrun_launch_equals_one_rank(runner, tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(Path(tp_llm_script.__file__)), str(out), runner]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log[-3000:]
    assert "TP rank 1/2: Model runner" in log and "TP rank 0/2: Model runner" in log
    llm = LLM("tiny-llama", dtype="float64", device="cpu", seed=0, model_runner=runner)
    want = tp_llm_script.outputs(llm)
    got = json.loads(out.read_text())
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    for g, w in zip(got, want):
        for dg, dw in zip(g["logprobs"], w["logprobs"], strict=True):
            assert dg.keys() == dw.keys()
            assert all(abs(dg[k] - dw[k]) <= 1e-9 for k in dg)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_killed_worker_fails_the_step_within_the_timeout(runner):
    timeout_s = 8.0
    with process_guard(90):
        before = {p.pid for p in live_children()}
        engine = LLMEngine.from_engine_args(EngineArgs(
            model="tiny-llama", dtype="float64", device="cpu", seed=0, model_runner=runner,
            tensor_parallel_size=2, distributed_timeout_s=timeout_s))
        try:
            for i in range(3):
                engine.add_request(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=50))
            engine.step()
            engine.step()
            (pid,) = engine.runner.worker_pids.values()
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(TPWorkerError) as err:
                for _ in range(50):
                    engine.step()
            assert time.monotonic() - start <= timeout_s + 5
            assert "rank 1" in str(err.value) and "distributed_timeout_s" in str(err.value)
        finally:
            engine.shutdown()
        assert {p.pid for p in live_children()} <= before
