"""StepSamples reads a step's GPU times only after the run: a read waits for the step's GPU
work (CUDA events), so reading while the run goes on would serialise an async loop. A
fake step record stands in for the CUDA events and logs when they are read."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.harness.measure import StepSamples
from shared.harness.workloads import RunResult, summarise


@dataclass
class FakeStats:
    gpu_ms: float
    reads: list[float]
    stage_ms: dict[str, float] = field(default_factory=lambda: {"forward": 1.0})
    cudagraph_mode: str = "FULL"

    def forward_gpu_ms(self) -> float:
        self.reads.append(self.gpu_ms)  # a real read synchronises on the step's end event
        return self.gpu_ms

    def step_gpu_ms(self) -> float:
        return self.gpu_ms + 0.5


@dataclass
class FakeEngine:
    step_stats: FakeStats


def test_gpu_times_are_read_after_the_run_not_per_step():
    reads: list[float] = []
    samples = StepSamples()
    for ms in (3.0, 1.0, 2.0):
        samples.add(FakeEngine(FakeStats(ms, reads)), wall_ms=10.0)
    assert reads == []  # nothing waited on a step while the run went on
    assert samples.forward_gpu_ms == [3.0, 1.0, 2.0] and reads == [3.0, 1.0, 2.0]
    assert samples.step_gpu_ms == [3.5, 1.5, 2.5]
    assert samples.forward_gpu_ms == [3.0, 1.0, 2.0] and len(reads) == 3  # read once


def test_summaries_of_several_runs_read_every_step():
    reads: list[float] = []
    runs = []
    for values in ((1.0, 5.0), (3.0,)):
        samples = StepSamples()
        for ms in values:
            samples.add(FakeEngine(FakeStats(ms, reads)), wall_ms=ms)
        runs.append(RunResult(samples, {}, {}))
    out = summarise(runs)
    assert out["forward_gpu_ms"] == {"median": 3.0, "p90": 4.6, "n": 3}
    assert out["step_gpu_ms"]["median"] == 3.5 and sorted(reads) == [1.0, 3.0, 5.0]
