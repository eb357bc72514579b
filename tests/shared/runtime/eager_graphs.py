"""Eager stand-ins for CUDA-graph recording, so the graph paths of both runners run on CPU.

A stand-in's replay() re-runs the body that a CUDA graph would have recorded: the same
closure, reading and writing the same persistent and static buffers. A value that travels
outside those buffers (a fresh tensor handed from one segment to the next, a wrong view,
a missing copy, inputs written inside the captured region) gives a wrong result here too.
What the stand-in cannot show is a capture-only fault (an allocation or a host sync
inside the graph); the GPU tests cover those.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

from shared.runtime import cudagraph_utils
from shared.runtime.piecewise_graphs import PiecewiseGraphs


class EagerReplay:
    """replay() re-runs `body`; with `output` (a FULL graph's), copies the result there,
    as a graph's replay overwrites the tensor its capture returned."""

    def __init__(self, body: Callable[[], Any], output: torch.Tensor | None = None) -> None:
        self.body, self.output = body, output

    def replay(self) -> None:
        result = self.body()
        if self.output is not None:
            self.output.copy_(result)


def record_full_eagerly(body: Callable[[], torch.Tensor], pool: Any) -> tuple[EagerReplay, torch.Tensor]:
    """capture_full_graphs' `record`: run the body once (the capture) and keep it."""
    output = body()
    return EagerReplay(body, output), output


def use_eager_graphs(monkeypatch: pytest.MonkeyPatch, *graph_modules: ModuleType) -> None:
    """Graph capture without CUDA for the runners' graph modules (runner_v1.cudagraph,
    runner_v2.cudagraph): FULL graphs and piecewise segments record eagerly, and the
    memory pool is None."""
    monkeypatch.setattr(PiecewiseGraphs, "_record", lambda self, body, pool: EagerReplay(body))
    eager_full = functools.partial(cudagraph_utils.capture_full_graphs, record=record_full_eagerly)
    for module in graph_modules:
        monkeypatch.setattr(module, "capture_full_graphs", eager_full)
    # capture_verify_graphs (speculative verifies) calls it from cudagraph_utils itself
    monkeypatch.setattr(cudagraph_utils, "capture_full_graphs", eager_full)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
