"""CUDA-graph dispatch logic, on CPU: the padding ladder, the uniform-decode predicate,
and each runner's choice between a FULL graph and eager (capture itself is GPU-only,
tests/gpu/test_runner_cudagraph_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from policy.config import default_capture_sizes
from runner_v1.cudagraph import V1CudaGraphs
from runner_v2.cudagraph import CudaGraphManager
from shared.cudagraph_utils import BatchDescriptor, is_uniform_decode, padded_size

LADDER = default_capture_sizes(512)


def test_default_ladder_shape() -> None:
    assert LADDER[:4] == [1, 2, 4, 8]
    assert all(b - a == 8 for a, b in zip(LADDER[3:], LADDER[4:]) if b <= 256)
    assert all(b - a == 16 for a, b in zip(LADDER, LADDER[1:]) if a >= 256)
    assert LADDER[-1] == 512


@given(st.integers(1, 600))
def test_padded_size_is_the_smallest_size_that_fits(n: int) -> None:
    fitting = [s for s in LADDER if s >= n]
    assert padded_size(n, LADDER) == (min(fitting) if fitting else None)


def test_uniform_decode_predicate() -> None:
    assert is_uniform_decode(max_query_len=1, num_tokens=7, num_reqs=7)
    assert not is_uniform_decode(max_query_len=2, num_tokens=8, num_reqs=7)  # one 2-token row
    assert not is_uniform_decode(max_query_len=1, num_tokens=6, num_reqs=7)  # an empty row


def _config(mode: str, sizes: list[int], max_num_seqs: int = 512):
    return SimpleNamespace(
        compilation_config=SimpleNamespace(
            cudagraph_mode=mode, cudagraph_mode_requested="auto", cudagraph_capture_sizes=sizes
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_model_len=1024),
    )


def _executor(backend: str = "TRITON"):
    return SimpleNamespace(backend=SimpleNamespace(name=backend), block_size=16)


def _v1(mode: str = "FULL_AND_PIECEWISE", backend: str = "TRITON") -> V1CudaGraphs:
    graphs = V1CudaGraphs(_config(mode, LADDER), SimpleNamespace(type="cpu"), _executor(backend),
                          None, None)
    # As if captured on a GPU: dispatch only needs the ladder and a wrapper.
    graphs.enabled, graphs.wrapper = True, object()
    return graphs


def test_v1_full_for_uniform_decode_padded_up_the_ladder() -> None:
    plan = _v1().dispatch(np.ones(37, dtype=np.int32))
    assert (plan.mode, plan.num_tokens_padded, plan.num_reqs_padded) == ("FULL", 40, 40)
    assert plan.descriptor == BatchDescriptor("FULL", 40, 40)


def test_v1_mixed_batch_and_oversized_batch_run_eager_at_real_size() -> None:
    mixed = _v1().dispatch(np.array([1, 1, 5], dtype=np.int32))
    assert (mixed.mode, mixed.num_tokens_padded, mixed.num_reqs_padded) == ("NONE", 7, 3)
    big = _v1().dispatch(np.ones(600, dtype=np.int32))  # above the largest capture size
    assert (big.mode, big.num_tokens_padded) == ("NONE", 600)


def test_v1_graphs_off_on_cpu_and_for_the_torch_oracle() -> None:
    cpu = V1CudaGraphs(_config("FULL", LADDER), SimpleNamespace(type="cpu"), _executor(), None, None)
    assert not cpu.enabled
    assert cpu.dispatch(np.ones(4, dtype=np.int32)).mode == "NONE"
    torch_oracle = V1CudaGraphs(_config("FULL", LADDER), SimpleNamespace(type="cuda"),
                                _executor("TORCH"), None, None)
    assert not torch_oracle.enabled  # it reads lengths on the host: not capturable


def test_v2_dispatch_returns_a_descriptor_only_for_captured_uniform_decode() -> None:
    manager = CudaGraphManager(_config("FULL", LADDER), SimpleNamespace(type="cpu"), _executor(),
                               None, None)
    assert manager.dispatch(num_reqs=5, num_tokens=5, max_query_len=1) is None  # nothing captured
    manager.graphs = {BatchDescriptor("FULL", s, s): None for s in LADDER}
    assert manager.dispatch(num_reqs=5, num_tokens=5, max_query_len=1) == BatchDescriptor("FULL", 8, 8)
    assert manager.dispatch(num_reqs=5, num_tokens=9, max_query_len=5) is None  # mixed: eager
    assert manager.dispatch(num_reqs=513, num_tokens=513, max_query_len=1) is None  # too big
