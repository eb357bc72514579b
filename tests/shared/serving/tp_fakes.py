"""Test doubles for the tensor-parallel process machinery: a stand-in runner (no model),
the slice of an EngineConfig it needs, and a guard that bounds a test and checks that it
left no process and no shared-memory segment behind.

Every rank keeps a CRC chain over the calls it receives, in order; each execute_model
all-gathers over the device group [digest of the SchedulerOutput, the chain, the KV block
count, outputs materialised, rank], so a rank that missed, reordered or misread a message,
or that is absent from the collective, shows in what rank 0 returns. Behaviours are keyed
by request ids in the SchedulerOutput, so that every rank sees the same trigger:
"fail" raises on every rank (a deterministic runner error), "hang-<r>" makes rank r sleep
forever. `interrupt` (set on rank 0's runner only) raises KeyboardInterrupt there;
FakeConfig.fail_load_on_rank makes load_model fail on that rank.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import torch

from policy.config import DeviceConfig, ParallelConfig
from policy.selection import RunnerDecision
from shared.contract.sampling_params import SamplingParams
from shared.contract.step import CachedRequestData, NewRequestData, SchedulerOutput
from shared.distributed.group import current_tp_group

FAKE_RUNNER = "tests.shared.serving.tp_fakes:FakeTPRunner"
COLUMNS = ("digest", "chain", "num_blocks", "materialized", "rank")
DIGEST, CHAIN, BLOCKS, MATERIALIZED, RANK = range(len(COLUMNS))  # indices into a row


@dataclass(frozen=True)
class FakeConfig:
    """What the TP machinery reads of an EngineConfig, without a model to resolve."""

    parallel_config: ParallelConfig
    device_config: DeviceConfig
    runner_decision: RunnerDecision
    fail_load_on_rank: int = -1


def fake_config(tensor_parallel_size: int, timeout_s: float = 20.0,
                fail_load_on_rank: int = -1) -> FakeConfig:
    decision = RunnerDecision(runner="v2", source="argument", reasons=["the TP test's fake"],
                              unsupported_v2=[], runner_class=FAKE_RUNNER)
    return FakeConfig(ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                     distributed_timeout_s=timeout_s),
                      DeviceConfig(device="cpu"), decision, fail_load_on_rank)


def blocks_for(rank: int) -> int:
    """Rank-dependent KV capacity: the last rank has the fewest blocks."""
    return 1000 - 100 * rank


def digest(so: SchedulerOutput) -> int:
    new = [(r.req_id, r.prompt_token_ids) for r in so.scheduled_new_reqs]
    text = repr((sorted(so.num_scheduled_tokens.items()), new, sorted(so.finished_req_ids)))
    return zlib.crc32(text.encode())


def scheduler_output(step: int, req_ids: list[str], prompt_len: int = 4) -> SchedulerOutput:
    """One new request per id, with a prompt that depends on the step."""
    new = [NewRequestData(rid, [(step * 7 + i) % 1000 for i in range(prompt_len)],
                          SamplingParams(), [0], 0, prompt_len) for rid in req_ids]
    return SchedulerOutput(new, CachedRequestData(), {rid: prompt_len for rid in req_ids},
                           prompt_len * len(req_ids), {f"done-{step}"})


def set_up(tp: object) -> int:
    """The engine's set-up calls, in its order. -> the number of KV blocks."""
    tp.load_model()
    num_blocks = tp.determine_num_blocks()
    tp.initialize_kv_cache(num_blocks)
    tp.capture_model()
    return num_blocks


def run_step(tp: object, so: SchedulerOutput) -> list[list[int]]:
    """What the engine does per step: execute, sample, resolve. -> the ranks' rows."""
    tp.execute_model(so)
    return tp.sample_tokens(None).get_output()


class FakeOutput:
    def __init__(self, runner: FakeTPRunner, rows: list[list[int]]):
        self.runner, self.rows, self.done = runner, rows, False

    def get_output(self) -> list[list[int]]:
        if not self.done:
            self.done = True
            self.runner.materialized += 1
        return self.rows


class FakeTPRunner:
    supports_async_scheduling = True
    keeps_drafts_on_device = False

    def __init__(self, config: FakeConfig, device: torch.device):
        self.group = current_tp_group()  # the group `building_for` set, as a model reads it
        self.rank = self.group.rank
        self.device = device
        self.fail_load = getattr(config, "fail_load_on_rank", -1) == self.rank
        self.chain = 0
        self.num_blocks = -1
        self.materialized = 0
        self.interrupt = False
        self._rows: list[list[int]] = []

    def _record(self, *call: object) -> None:
        self.chain = zlib.crc32(repr(call).encode(), self.chain)

    def load_model(self) -> None:
        self._record("load_model")
        if self.fail_load:
            raise OSError(f"no weights on rank {self.rank}")

    def determine_num_blocks(self) -> int:
        self._record("determine_num_blocks")
        return blocks_for(self.rank)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._record("initialize_kv_cache", num_blocks)
        self.num_blocks = num_blocks

    def capture_model(self) -> None:
        self._record("capture_model")

    def execute_model(self, so: SchedulerOutput) -> None:
        self._record("execute_model", digest(so))
        if "fail" in so.num_scheduled_tokens:
            raise ValueError("a deterministic runner failure")
        if f"hang-{self.rank}" in so.num_scheduled_tokens:
            while True:
                time.sleep(0.05)
        if self.interrupt:
            raise KeyboardInterrupt
        row = torch.tensor([[digest(so), self.chain, self.num_blocks, self.materialized,
                             self.rank]], dtype=torch.int64)
        self._rows = self.group.all_gather(row, dim=0).tolist()

    def sample_tokens(self, grammar_output: object = None) -> FakeOutput:
        self._record("sample_tokens")
        return FakeOutput(self, self._rows)

    def reset_request_states(self) -> None:
        self._record("reset_request_states")

    def explode(self, rank: int) -> int:
        """A call that fails on one rank only (the others return their rank)."""
        self._record("explode", rank)
        if self.rank == rank:
            raise RuntimeError(f"explode on rank {rank}")
        return self.rank


# ---- process hygiene ---------------------------------------------------------------
def live_children() -> list[psutil.Process]:
    """This process's descendants, without Python's multiprocessing resource tracker (one
    per parent, started by the first spawn; it exits with the parent)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "resource_tracker" not in " ".join(proc.cmdline()):
                found.append(proc)
    return found


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@contextlib.contextmanager
def process_guard(seconds: int) -> Iterator[None]:
    """Bound the block to `seconds` (SIGALRM raises TimeoutError in it; a wait stuck in C,
    which the alarm cannot interrupt, ends the whole run 30 s later with the tracebacks),
    then kill and report any descendant or /dev/shm entry it left behind."""
    before_children = {p.pid for p in live_children()}
    before_shm = _shm()

    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError(f"the test ran over its bound of {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    faulthandler.dump_traceback_later(seconds + 30, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        left = [p for p in live_children() if p.pid not in before_children]
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    assert not left, f"processes left behind: {left}"
    assert _shm() - before_shm == set(), "shared-memory segments left behind"


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    """The pids still running (not exited, not a zombie) after up to `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)
