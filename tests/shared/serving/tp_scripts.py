"""Programs the tensor-parallel tests run in processes of their own.

    python tp_scripts.py torchrun OUT.json   (under torchrun, 2 ranks) rank 0 drives a
        TPRunner over the fake runner and writes what it saw; rank 1 serves it
    python tp_scripts.py orphan               spawns a group of 2, prints the worker's pid,
        then waits to be killed (the worker must not outlive it)
"""

from __future__ import annotations

import json
import sys
import time

from shared.distributed.init import torchrun_env
from shared.serving.tp_worker import run_worker_from_torchrun
from shared.serving.tp_workers import start_tp_runner
from tests.shared.serving.tp_fakes import (
    FakeTPRunner,
    digest,
    fake_config,
    scheduler_output,
)


def torchrun_main(out_path: str) -> None:
    config = fake_config(2)
    env = torchrun_env()
    assert env is not None, "run me under torchrun"
    if env[0] != 0:
        run_worker_from_torchrun(config.parallel_config, "cpu")
        return
    tp = start_tp_runner(config, "cpu", FakeTPRunner)
    tp.load_model()
    num_blocks = tp.determine_num_blocks()
    tp.initialize_kv_cache(num_blocks)
    tp.capture_model()
    rows, digests = [], []
    for step in range(3):
        so = scheduler_output(step, [f"r{step}", "s"])
        tp.execute_model(so)
        rows.append(tp.sample_tokens(None).get_output())
        digests.append(digest(so))
    tp.shutdown()
    with open(out_path, "w") as f:
        json.dump({"num_blocks": num_blocks, "rows": rows, "digests": digests}, f)


def orphan_main() -> None:
    tp = start_tp_runner(fake_config(2), "cpu", FakeTPRunner)
    print(json.dumps(tp.worker_pids), flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    if sys.argv[1] == "torchrun":
        torchrun_main(sys.argv[2])
    else:
        orphan_main()
