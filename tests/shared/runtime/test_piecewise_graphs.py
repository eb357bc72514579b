"""The shared PiecewiseGraphs' data flow on CPU: static buffers, persistent inputs, eager
attention between segments, padded sizes, stale rows from a larger earlier step. The
oracle is the model's plain forward on a twin KV cache.

Capture itself needs a GPU (tests/gpu/runner_v1/test_piecewise_gpu.py and
tests/gpu/runner_v2/test_piecewise_gpu.py). Here `_record` is replaced by an eager
stand-in whose replay() re-runs the captured body. The body is the same closure a CUDA
graph would record, reading and writing only the static views, so a value that travelled
outside them (a fresh tensor handed from one segment to the next, a wrong view, a missing
copy) shows up as a wrong result here too. How each runner reaches these graphs:
tests/runner_v1/test_cudagraph.py, tests/runner_v2/test_cudagraph.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from shared.attention import layer as attention_layer
from shared.attention.metadata import PAD_SLOT_ID
from shared.attention.torch_backend import TorchBackend
from shared.runtime.cudagraph_utils import padded_size
from shared.runtime.forward_context import set_forward_context
from shared.runtime.piecewise_graphs import PiecewiseGraphs
from tests.shared.model.test_model_piecewise import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    SplitHarness,
    _flat_slots,
    preset_model,
)

SIZES = [4, 8, 16, 32]
MAX_TOKENS = 40


class _EagerReplay:
    # True while a recorded body runs: a KV write then is one a CUDA graph would replay
    inside = False

    def __init__(self, body, log: list) -> None:
        self.body, self.log = body, log

    def replay(self) -> None:
        self.log.append(self)
        _EagerReplay.inside = True
        try:
            self.body()
        finally:
            _EagerReplay.inside = False


class EagerPiecewise(PiecewiseGraphs):
    """Records nothing: replay re-runs the body (what a graph would re-launch)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: list[tuple[int, _EagerReplay]] = []
        self.replayed: list[_EagerReplay] = []

    def _record(self, body, pool) -> _EagerReplay:
        graph = _EagerReplay(body, self.replayed)
        self.recorded.append((body.args[1].q.shape[0], graph))
        return graph


def _rows_for(rng: np.random.Generator, query_lens: list[int]):
    """One row per query length, decodes (length 1) first, each after a random cached
    prefix (the random initial cache plays the prefix), with disjoint blocks."""
    rows, block = [], 0
    for n in sorted(query_lens, key=lambda n: n != 1):
        start = int(rng.integers(0, 6))
        tokens = rng.integers(1, 500, size=n).tolist()
        blocks = list(range(block, block + -(-(start + n) // BLOCK_SIZE)))
        block += len(blocks)
        rows.append((tokens, start, blocks))
    assert block <= NUM_BLOCKS
    return rows


# token counts 14 -> 16, 3 -> 4, 29 -> 32, 6 -> 8, 3 -> 4: down and up the ladder
WALK = [[1, 1, 5, 7], [1, 2], [1, 8, 8, 8, 4], [6], [1, 1, 1]]


def captured_setup(preset: str):
    """-> (harness, EagerPiecewise captured at SIZES, its persistent input_ids, positions,
    slot_mapping)."""
    model = preset_model(preset)
    harness = SplitHarness(model)
    input_ids = torch.zeros(MAX_TOKENS, dtype=torch.int32)
    positions = torch.zeros(MAX_TOKENS, dtype=torch.int64)
    slot_mapping = torch.zeros(MAX_TOKENS, dtype=torch.int64)
    graphs = EagerPiecewise(model, SIZES, input_ids, positions, slot_mapping, torch.float64)
    graphs.capture(None, "test")
    return harness, graphs, input_ids, positions, slot_mapping


def through_persistent_slots(slot_mapping: torch.Tensor, md, size: int):
    """What the runners' input prep does for the slots: the step's (PAD past the real
    tokens) written into the persistent buffer, which the step's metadata then describes."""
    slot_mapping[:size] = md.common.slot_mapping
    common = dataclasses.replace(md.common, slot_mapping=slot_mapping[:size])
    return TorchBackend().make_builder(common.block_table.device).build(common)


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-mixtral"])
def setup(request):
    return captured_setup(request.param)


def test_capture_records_every_segment_largest_size_first(setup) -> None:
    graphs = setup[1]
    num_segments = graphs.model.num_segments
    sizes = [size for size, _ in graphs.recorded]
    assert sizes == [s for s in reversed(SIZES) for _ in range(num_segments)]
    assert all(len(graphs.graphs[s]) == num_segments and s in graphs for s in SIZES)
    assert 5 not in graphs


def test_padded_steps_match_the_eager_forward_and_write_only_real_slots(setup) -> None:
    """Token counts walk down and up the ladder (WALK), every step padded: each smaller
    step runs over static rows a larger one left behind."""
    harness, graphs, input_ids, positions, slot_mapping = setup
    rng = np.random.default_rng(0)
    for query_lens in WALK:
        rows = _rows_for(rng, query_lens)
        num_tokens = sum(query_lens)
        size = padded_size(num_tokens, SIZES)
        assert size > num_tokens
        ref_caches, pw_caches = harness.fresh_caches(), harness.fresh_caches()
        harness.bind(ref_caches)
        ids, pos, md = harness.inputs(rows, pad=0)
        with torch.no_grad(), set_forward_context(md, list(harness.layers), num_tokens):
            ref = harness.model(ids, pos)
        # What V1's prepare_inputs does: real tokens, then 0 ids / 0 positions / PAD.
        ids, pos, md = harness.inputs(rows, pad=size - num_tokens)
        md = through_persistent_slots(slot_mapping, md, size)
        input_ids[:size] = torch.cat([ids[:num_tokens], torch.zeros(size - num_tokens)])
        positions[:size] = torch.cat([pos[:num_tokens], torch.zeros(size - num_tokens)])
        harness.bind(pw_caches)
        graphs.replayed.clear()
        with torch.no_grad(), set_forward_context(md, list(harness.layers), size, "PIECEWISE"):
            got = graphs.run(input_ids[:size], positions[:size])
        assert got.shape[0] == size
        assert [g for _, g in graphs.recorded if g in graphs.replayed] == graphs.graphs[size]
        torch.testing.assert_close(got[:num_tokens], ref, rtol=0, atol=1e-12)
        real = md.common.slot_mapping[:num_tokens]
        untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
        untouched[real] = False
        for init, new, want in zip(harness.initial, pw_caches, ref_caches):
            torch.testing.assert_close(new, want, rtol=0, atol=1e-12)
            assert torch.equal(_flat_slots(new)[:, untouched], _flat_slots(init)[:, untouched])


def test_run_refuses_inputs_that_are_not_the_persistent_buffers(setup) -> None:
    graphs = setup[1]
    with pytest.raises(AssertionError, match="persistent"):
        graphs.run(torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int64))


def test_run_refuses_a_slot_mapping_the_graphs_do_not_write_through(setup) -> None:
    """The recorded KV writes read the persistent slot mapping; metadata describing
    another tensor would put the step's K/V where its attention does not look."""
    harness, graphs, input_ids, positions, _ = setup
    rows = _rows_for(np.random.default_rng(1), [1, 2])
    ids, pos, md = harness.inputs(rows, pad=1)  # its own slot tensor
    with torch.no_grad(), set_forward_context(md, list(harness.layers), 4, "PIECEWISE"):
        with pytest.raises(AssertionError, match="slot_mapping"):
            graphs.run(input_ids[:4], positions[:4])


def test_every_kv_write_of_a_step_is_inside_a_recorded_segment(setup, monkeypatch) -> None:
    """The eager part of a piecewise step is attention alone: each layer's KV write runs
    inside the segment before it (on a GPU, inside its graph), once per layer."""
    harness, graphs, input_ids, positions, slot_mapping = setup
    calls: list[bool] = []
    real_write = attention_layer.write_kv

    def spy(*args) -> None:
        calls.append(_EagerReplay.inside)
        real_write(*args)

    monkeypatch.setattr(attention_layer, "write_kv", spy)
    rows = _rows_for(np.random.default_rng(2), [1, 1, 3])
    ids, pos, md = harness.inputs(rows, pad=3)
    md = through_persistent_slots(slot_mapping, md, 8)
    input_ids[:8], positions[:8] = ids, pos
    harness.bind(harness.fresh_caches())
    with torch.no_grad(), set_forward_context(md, list(harness.layers), 8, "PIECEWISE"):
        graphs.run(input_ids[:8], positions[:8])
    assert calls == [True] * graphs.num_layers


def test_capture_writes_no_kv() -> None:
    """Capture runs each segment eagerly before recording it, at start-up, over
    whatever the slot buffer held: it must write nothing into the caches."""
    model = preset_model("tiny-qwen3")
    harness = SplitHarness(model)
    caches = harness.fresh_caches()
    harness.bind(caches)
    ids, pos = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)
    slots = torch.arange(8, dtype=torch.int64)  # stale real-looking slots
    EagerPiecewise(model, [4, 8], ids, pos, slots, torch.float64).capture(None, "test")
    for before, after in zip(harness.initial, caches):
        assert torch.equal(before, after)
    assert torch.equal(slots, torch.full((8,), PAD_SLOT_ID))


def test_construction_checks() -> None:
    model = preset_model("tiny-llama")
    ids, pos = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)
    slots = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="largest piecewise"):
        PiecewiseGraphs(model, [4, 16], ids, pos, slots, torch.float64)
    with pytest.raises(ValueError, match="largest piecewise"):
        PiecewiseGraphs(model, [4, 8], ids, pos, slots[:4], torch.float64)
    with pytest.raises(ValueError, match="at least one"):
        PiecewiseGraphs(model, [], ids, pos, slots, torch.float64)
    with pytest.raises(TypeError, match="piecewise split"):
        PiecewiseGraphs(torch.nn.Linear(2, 2), [4], ids, pos, slots, torch.float64)
