"""Per-step stage timing: CPU wall time per stage, CUDA-event time of the forward on GPU,
and NVTX ranges with the same names when enabled.

Stages are the same in both runners: preprocess, forward, postprocess, sample. The
timer costs two perf_counter() calls per stage; NVTX ranges are pushed only when
enabled (RUNNERLAB_NVTX=1 or `runnerlab ab --nvtx`), so the disabled path adds nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from shared.runtime.kernel_options import kernel_options

STAGES = ("preprocess", "forward", "postprocess", "sample")


@dataclass
class StepStats:
    """Stage times of the last step, in milliseconds of CPU wall time."""

    stage_ms: dict[str, float] = field(default_factory=dict)
    num_reqs: int = 0
    num_tokens: int = 0
    cudagraph_mode: str = "NONE"
    # CUDA events around the forward, and one at the sample stage's end (the LM head runs
    # there, outside the graph); read lazily (elapsed_time needs the events done)
    _fwd_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    _sample_end: torch.cuda.Event | None = None

    @property
    def total_ms(self) -> float:
        return sum(self.stage_ms.values())

    def forward_gpu_ms(self) -> float | None:
        if self._fwd_events is None:
            return None
        start, end = self._fwd_events
        end.synchronize()
        return start.elapsed_time(end)

    def step_gpu_ms(self) -> float | None:
        """GPU time from the forward's start to the sample stage's end: the forward, the
        gather of the sampled rows, the LM head and the sampler. The forward alone leaves
        out the LM head (compute_logits runs in the sample stage), whose weight a decode
        step reads like any layer's; compare this one with a weight-read floor."""
        if self._fwd_events is None or self._sample_end is None:
            return None
        self._sample_end.synchronize()
        return self._fwd_events[0].elapsed_time(self._sample_end)


class StageTimer:
    """Owned by a runner; `begin_step()` starts a fresh StepStats each step."""

    def __init__(self, prefix: str, use_cuda_events: bool):
        self.prefix = prefix  # "runner_v1" | "runner_v2", the NVTX range prefix
        self.use_cuda_events = use_cuda_events
        self.stats = StepStats()

    def begin_step(self, num_reqs: int, num_tokens: int) -> None:
        self.stats = StepStats(num_reqs=num_reqs, num_tokens=num_tokens)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        nvtx = kernel_options().nvtx  # the engine's (RUNNERLAB_NVTX=1 turns it on)
        if nvtx:
            torch.cuda.nvtx.range_push(f"{self.prefix}: {name}")
        start = time.perf_counter()
        events = None
        if name == "forward" and self.use_cuda_events:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        try:
            yield
        finally:
            if events is not None:
                events[1].record()
                self.stats._fwd_events = events
            elif name == "sample" and self.use_cuda_events:
                self.stats._sample_end = torch.cuda.Event(enable_timing=True)
                self.stats._sample_end.record()
            elapsed = (time.perf_counter() - start) * 1e3
            self.stats.stage_ms[name] = self.stats.stage_ms.get(name, 0.0) + elapsed
            if nvtx:
                torch.cuda.nvtx.range_pop()
