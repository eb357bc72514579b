"""Tensor parallelism's GPU path on one GPU (issue 25; two GPUs are issue 28): a group of
size 1 launched by torchrun runs NCCL collectives eagerly and inside FULL and PIECEWISE
CUDA graphs, and gives the tokens of the engine without any group (float32, both
runners, greedy and seeded rows)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from policy import EngineArgs
from shared.distributed.init import free_port
from shared.serving.engine import LLMEngine
from tests.gpu.shared.serving import tp_gpu_script

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.gpu
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_size_one_nccl_group_in_graphs_equals_no_group(runner, tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(Path(tp_gpu_script.__file__)), str(out), runner]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log[-4000:]
    got = json.loads(out.read_text())
    assert got["backends"] == ["nccl", "gloo"] and got["world_size"] == 1
    assert {"FULL", "PIECEWISE"} <= set(got["modes"]), got["modes"]
    engine = LLMEngine.from_engine_args(EngineArgs(model_runner=runner, **tp_gpu_script.ENGINE))
    want = tp_gpu_script.run(engine)
    engine.shutdown()
    assert got["tokens"] == want["tokens"]
