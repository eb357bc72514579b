"""V2's piecewise CUDA graphs, captured for real (GPU machine only).

The mixed workload of tests/runner_v2/test_cudagraph.py — chunked prefills under a
64-token budget, decodes, requests arriving while others decode — on tiny-llama (dummy
weights, float32): its per-step token counts walk up and down the capture ladder, so
most mixed steps replay piecewise graphs padded to a capture size over static rows an
earlier, larger step left behind, the uniform decodes replay FULL graphs, and steps
above the largest piecewise size run eager. Graphed and eager engines must give the same
tokens, every step must run in the mode the dispatch rule picks, and a padded piecewise
step must write exactly its real tokens' KV slots.
"""

from __future__ import annotations

import functools

import pytest

from policy import EngineArgs
from shared.serving.engine import LLMEngine
from tests.runner_v2.test_cudagraph import (
    ARRIVALS,
    MAX_TOKENS,
    RUN,
    SIZES,
    check_modes,
    check_padded_piecewise_step,
)
from tests.shared.runtime.graph_workload import run_workload

pytestmark = pytest.mark.gpu

GPU_RUN = {**RUN, "model": "tiny-llama", "load_format": "dummy", "dtype": "float32",
           "device": "cuda"}


def _engine(mode: str | None, backend: str = "auto") -> LLMEngine:
    """mode None: eager (enforce_eager); else cudagraph_mode=mode with SIZES."""
    graphs = {"enforce_eager": True} if mode is None else {
        "cudagraph_mode": mode, "cudagraph_capture_sizes": SIZES}
    return LLMEngine.from_engine_args(
        EngineArgs(attention_backend=backend, **graphs, **GPU_RUN))


@functools.cache
def _eager_tokens(backend: str = "auto") -> dict[str, list[int]]:
    tokens, steps = run_workload(_engine(None, backend), ARRIVALS, MAX_TOKENS)
    assert {m for _, _, m in steps} == {"NONE"}
    return tokens


def _check(engine: LLMEngine, backend: str, full: bool, piecewise: bool) -> None:
    manager = engine.runner.cudagraph_manager
    assert bool(manager.graphs) == full and (manager.piecewise is not None) == piecewise
    tokens, steps = run_workload(engine, ARRIVALS, MAX_TOKENS)
    check_modes(steps, full, piecewise)
    eager = _eager_tokens(backend)
    assert tokens.keys() == eager.keys()
    mismatched = [r for r in eager if tokens[r] != eager[r]]
    assert not mismatched, f"{len(mismatched)} requests differ, e.g. {mismatched[:3]}"


@pytest.mark.parametrize("mode, full", [("FULL_AND_PIECEWISE", True), ("PIECEWISE", False)])
def test_piecewise_tokens_equal_eager_float32(mode: str, full: bool) -> None:
    _check(_engine(mode), "auto", full=full, piecewise=True)


def test_torch_backend_runs_piecewise_without_full_graphs() -> None:
    """The TORCH oracle cannot sit inside a FULL graph (it reads lengths on the host),
    but runs eagerly between piecewise graphs."""
    _check(_engine("FULL_AND_PIECEWISE", "TORCH"), "TORCH", full=False, piecewise=True)


def test_padded_piecewise_step_writes_exactly_the_real_slots() -> None:
    check_padded_piecewise_step(_engine("FULL_AND_PIECEWISE"))
