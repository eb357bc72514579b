"""V1's implicit CUDA graphs on CPU: the wrapper routes a step to its FULL graph, its
piecewise graphs or the eager model by the forward context, and a whole V1 engine with
piecewise graphs (recorded by eager stand-ins, tests/shared/runtime/eager_graphs.py)
gives the tokens of an eager engine, every step PIECEWISE.
"""

from __future__ import annotations

import pytest
import torch

from runner_v1 import cudagraph as v1_cudagraph
from runner_v1.cudagraph import CudaGraphWrapper
from shared.runtime.cudagraph_utils import BatchDescriptor, padded_size
from shared.runtime.forward_context import set_forward_context
from tests.shared.runtime.eager_graphs import use_eager_graphs
from tests.shared.runtime.test_piecewise_graphs import captured_setup, through_persistent_slots


@pytest.fixture(scope="module")
def setup():
    return captured_setup("tiny-qwen3")


def test_wrapper_routes_piecewise_steps_and_falls_back_to_eager(setup) -> None:
    harness, graphs, input_ids, positions, slot_mapping = setup
    rows = [([5, 6, 7], 0, [0]), ([8, 9], 0, [1])]
    ids, pos, md = harness.inputs(rows, pad=3)
    md = through_persistent_slots(slot_mapping, md, 8)
    input_ids[:8], positions[:8] = ids.to(torch.int32), pos
    calls = []
    wrapper = CudaGraphWrapper(lambda i, p: calls.append(i.shape[0]) or "eager", graphs)
    harness.bind(harness.fresh_caches())
    desc = BatchDescriptor("PIECEWISE", 8, None)
    with torch.no_grad():
        graphs.replayed.clear()
        with set_forward_context(md, list(harness.layers), 8, "PIECEWISE", desc):
            out = wrapper(input_ids[:8], positions[:8])
        assert out.data_ptr() == graphs.hidden_states.data_ptr() and graphs.replayed
        assert calls == []
        # NONE, or a PIECEWISE size that was never captured, runs the model
        with set_forward_context(md, list(harness.layers), 8, "NONE"):
            assert wrapper(input_ids[:8], positions[:8]) == "eager"
        uncaptured = BatchDescriptor("PIECEWISE", 5, None)
        with set_forward_context(md, list(harness.layers), 5, "PIECEWISE", uncaptured):
            assert wrapper(input_ids[:5], positions[:5]) == "eager"
    assert calls == [8, 5]


# ---- end to end through the V1 runner, with the eager stand-in ---------------------------

E2E_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
# step index -> prompt lengths arriving before that step (chunked under a 64-token budget)
E2E_ARRIVALS = {0: [5, 90], 2: [3, 40], 4: [1, 70], 7: [17, 8, 2]}


def _e2e_engine(piecewise: bool):
    from policy import EngineArgs
    from shared.serving.engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model="tiny-qwen3", dtype="float64", device="cpu", seed=0, model_runner="v1",
        max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64,
        num_gpu_blocks_override=64, enable_prefix_caching=False,
    ))
    if piecewise:
        # What V1CudaGraphs would hold on a GPU with cudagraph_mode='PIECEWISE'.
        graphs = engine.runner.graphs
        graphs.mode, graphs.piecewise_sizes = "PIECEWISE", E2E_SIZES
        graphs.piecewise_enabled = graphs.enabled = True
        graphs.capture()
    return engine


def _e2e_run(engine) -> tuple[dict[str, list[int]], list[tuple[int, str]]]:
    from shared.contract.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens, steps, step = {}, [], 0
    while step <= max(E2E_ARRIVALS) or engine.has_unfinished_requests():
        for i, n in enumerate(E2E_ARRIVALS.get(step, [])):
            engine.add_request(f"s{step}-{i}", [(step * 31 + i * 7 + j) % 500 + 1
                                                for j in range(n)], params)
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        stats = engine.runner.step_stats
        steps.append((stats.num_tokens, stats.cudagraph_mode))
        step += 1
    return tokens, steps


def test_v1_engine_with_piecewise_steps_gives_the_eager_tokens(monkeypatch) -> None:
    """The whole V1 step (dispatch, prepare_inputs padding the tail, wrapper, piecewise
    run, sampling at logits_indices) on the TORCH backend, float64: same tokens as eager."""
    use_eager_graphs(monkeypatch, v1_cudagraph)
    eager_tokens, eager_steps = _e2e_run(_e2e_engine(piecewise=False))
    tokens, steps = _e2e_run(_e2e_engine(piecewise=True))
    assert {m for _, m in eager_steps} == {"NONE"}
    assert {m for n, m in steps if n} == {"PIECEWISE"}
    padded = {padded_size(n, E2E_SIZES) for n, _ in steps if n}
    assert len(padded) >= 4 and any(padded_size(n, E2E_SIZES) > n for n, _ in steps if n)
    assert tokens == eager_tokens
