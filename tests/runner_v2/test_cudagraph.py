"""V2's explicit CUDA graphs end to end on CPU: a V2 engine whose CudaGraphManager was
built from the configuration a CUDA machine gets, captured with eager stand-ins for the
recording (tests/shared/runtime/eager_graphs.py), runs a mixed workload — chunked
prefills under a small token budget, requests arriving while others decode — and must
give the tokens of an eager V2 engine (float64), with every step in the mode an
independent statement of the dispatch rule picks, and a padded piecewise step must
write exactly its real tokens' KV slots.

The stand-ins re-run what a graph would record over the same persistent buffers, so a
wrong input address, a missing copy into a static buffer or an unpadded tail shows here;
capture itself is checked on the GPU (tests/gpu/runner_v2/test_piecewise_gpu.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from policy import EngineArgs
from policy import config as config_module
from runner_v2 import cudagraph as v2_cudagraph
from runner_v2.cudagraph import CudaGraphManager
from shared.contract.sampling_params import SamplingParams
from shared.runtime.cudagraph_utils import padded_size
from shared.serving.engine import LLMEngine
from tests.shared.runtime.eager_graphs import use_eager_graphs
from tests.shared.runtime.graph_workload import Steps, changed_slots, prompt, run_workload

SIZES = [1, 2, 4, 8, 16, 24, 32, 48]  # piecewise sizes; steps of 49..64 tokens run eager
MAX_NUM_SEQS = 16  # FULL sizes stop here
RUN = dict(model="tiny-qwen3", seed=0, model_runner="v2", max_model_len=256,
           max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=64, num_gpu_blocks_override=64,
           enable_prefix_caching=False)
# step index -> prompt lengths arriving before that step (chunked under the 64-token budget)
ARRIVALS = {0: [5, 90], 2: [3, 40], 4: [1, 70], 7: [17, 8, 2], 10: [30], 12: [2], 13: [17]}
MAX_TOKENS = 6


def expected_mode(num_reqs: int, num_tokens: int, full: bool, piecewise: bool,
                  sizes: list[int], max_num_seqs: int) -> str:
    """The dispatch rule, stated without the code under test: every scheduled request has
    at least one token, so num_tokens == num_reqs is a uniform decode."""
    if full and num_tokens == num_reqs and num_reqs <= max(s for s in sizes if s <= max_num_seqs):
        return "FULL"
    if piecewise and num_tokens <= max(sizes):
        return "PIECEWISE"
    return "NONE"


def check_modes(steps: Steps, full: bool, piecewise: bool) -> None:
    """Every step ran in the mode expected_mode gives, each mode the config enables was
    used (the workload has steps of every kind), and the piecewise steps covered several
    graph sizes, most of them padded, some beyond any FULL size."""
    for num_reqs, num_tokens, got in steps:
        want = expected_mode(num_reqs, num_tokens, full, piecewise, SIZES, MAX_NUM_SEQS)
        assert got == want, (num_reqs, num_tokens, got)
    want_modes = {"NONE"} | ({"FULL"} if full else set()) | ({"PIECEWISE"} if piecewise else set())
    assert {m for _, _, m in steps} == want_modes
    if piecewise:
        pw = [n for _, n, m in steps if m == "PIECEWISE"]
        assert len({padded_size(n, SIZES) for n in pw}) >= 4, pw
        assert sum(padded_size(n, SIZES) > n for n in pw) >= 3, pw
        assert any(n > MAX_NUM_SEQS for n in pw), pw


def _engine(dtype: str, backend: str, mode: str | None, monkeypatch) -> LLMEngine:
    """A CPU V2 engine; with `mode`, its graph manager is the one a CUDA machine builds
    for cudagraph_mode=mode, captured with the eager stand-ins."""
    engine = LLMEngine.from_engine_args(
        EngineArgs(dtype=dtype, device="cpu", attention_backend=backend, **RUN))
    if mode is None:
        return engine
    with monkeypatch.context() as m:
        m.setattr(config_module, "cuda_available", lambda: True)
        # FULL alone takes sizes up to max_num_seqs only (its graphs are uniform decodes)
        sizes = [s for s in SIZES if mode != "FULL" or s <= MAX_NUM_SEQS]
        cuda_config = EngineArgs(dtype=dtype, device="cuda", attention_backend=backend,
                                 cudagraph_mode=mode, cudagraph_capture_sizes=sizes,
                                 **RUN).create_engine_config()
    assert cuda_config.compilation_config.cudagraph_mode == mode
    use_eager_graphs(monkeypatch, v2_cudagraph)
    runner = engine.runner
    runner.cudagraph_manager = CudaGraphManager(
        cuda_config, torch.device("cuda"), runner.executor, runner.buffers, runner.block_tables)
    runner.capture_model()
    return engine


@functools.cache
def _eager_tokens(backend: str) -> dict[str, list[int]]:
    tokens, steps = run_workload(_engine("float64", backend, None, None), ARRIVALS, MAX_TOKENS)
    assert {m for _, _, m in steps} == {"NONE"}
    return tokens


# (mode, backend, FULL graphs expected, PIECEWISE graphs expected)
CASES = [
    ("FULL_AND_PIECEWISE", "TRITON", True, True),
    ("PIECEWISE", "TRITON", False, True),
    ("FULL_AND_PIECEWISE", "TORCH", False, True),  # the TORCH oracle cannot sit in a FULL graph
    ("FULL", "TRITON", True, False),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode, backend, full, piecewise", CASES)
def test_graphed_v2_gives_the_eager_tokens_in_the_expected_modes(
    mode: str, backend: str, full: bool, piecewise: bool, monkeypatch
) -> None:
    engine = _engine("float64", backend, mode, monkeypatch)
    manager = engine.runner.cudagraph_manager
    # The mode decides which graphs exist: PIECEWISE captures no FULL graph.
    assert bool(manager.graphs) == full and (manager.piecewise is not None) == piecewise
    tokens, steps = run_workload(engine, ARRIVALS, MAX_TOKENS)
    check_modes(steps, full, piecewise)
    assert tokens == _eager_tokens(backend)


def check_padded_piecewise_step(engine: LLMEngine) -> None:
    """A 47-token prefill (padded to 48), then a decode + a 20-token prefill: 21 tokens
    padded to 24 over static rows the 47-token step filled. The KV cache changes at the
    21 real tokens' slots and nowhere else, and the padded tail is id 0 / position 0 /
    PAD. `engine`: fresh, with SIZES as its piecewise capture sizes."""
    runner = engine.runner
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("big", prompt(0, 0, 47), params)
    engine.step()
    stats = runner.step_stats
    assert (stats.num_tokens, stats.cudagraph_mode) == (47, "PIECEWISE")
    engine.add_request("late", prompt(1, 0, 20), params)
    kv = runner.executor.kv_caches
    before = [t.clone() for t in kv]
    engine.step()
    stats = runner.step_stats
    assert (stats.num_reqs, stats.num_tokens, stats.cudagraph_mode) == (2, 21, "PIECEWISE")
    size = padded_size(21, SIZES)
    assert size == 24
    slots = runner.block_tables.slot_mappings
    real = slots[:21].tolist()
    assert len(set(real)) == 21 and min(real) >= 0
    assert slots[21:size].tolist() == [-1] * (size - 21)
    assert runner.buffers.input_ids[21:size].tolist() == [0] * (size - 21)
    assert runner.buffers.positions[21:size].tolist() == [0] * (size - 21)
    assert changed_slots(before, kv) == set(real)


def test_padded_piecewise_step_writes_exactly_its_real_slots(monkeypatch) -> None:
    check_padded_piecewise_step(_engine("float64", "TORCH", "FULL_AND_PIECEWISE", monkeypatch))
