"""CUDA-graph dispatch logic, on CPU: the padding ladder, the uniform-decode predicate,
each runner's choice between a FULL graph, PIECEWISE graphs and eager (against plain-Python
statements of the rule), and the order of the shared FULL capture loop with an eager
stand-in for the recording (capture itself is GPU-only,
tests/gpu/shared/runtime/test_runner_cudagraph_gpu.py, tests/gpu/runner_v1/test_piecewise_gpu.py,
tests/gpu/runner_v2/test_piecewise_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from policy.config import default_capture_sizes
from runner_v1.cudagraph import V1CudaGraphs
from runner_v2.cudagraph import CudaGraphManager
from shared.attention.flash_attn_backend import FlashAttnBackend
from shared.attention.null_backend import NullBackend
from shared.attention.selector import BACKEND_NAMES
from shared.attention.torch_backend import TorchBackend
from shared.attention.triton_backend import TritonBackend
from shared.runtime.cudagraph_utils import (
    BatchDescriptor,
    capture_full_graphs,
    dispatch_graph,
    is_uniform_decode,
    padded_size,
)

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


def _config(mode: str, sizes: list[int], max_num_seqs: int = 512,
            max_num_batched_tokens: int = 2048):
    return SimpleNamespace(
        compilation_config=SimpleNamespace(
            cudagraph_mode=mode, cudagraph_mode_requested="auto", cudagraph_capture_sizes=sizes
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_model_len=1024,
                                         max_num_batched_tokens=max_num_batched_tokens),
    )


BACKENDS = {"TORCH": TorchBackend, "TRITON": TritonBackend, "FLASH_ATTN": FlashAttnBackend,
            "NULL": NullBackend}


def _executor(backend: str = "TRITON"):
    # the class: the graph managers read only its declared capabilities (and name)
    return SimpleNamespace(backend=BACKENDS[backend], block_size=16)


def _v1(mode: str = "FULL_AND_PIECEWISE", backend: str = "TRITON", sizes: list[int] = LADDER,
        max_num_seqs: int = 512) -> V1CudaGraphs:
    graphs = V1CudaGraphs(_config(mode, sizes, max_num_seqs), SimpleNamespace(type="cuda"),
                          _executor(backend), None, None)
    # As if captured on a GPU: dispatch only needs the ladders and the captured flag.
    graphs.captured = True
    return graphs


def _plan(graphs: V1CudaGraphs, query_lens: list[int]):
    plan = graphs.dispatch(np.array(query_lens, dtype=np.int32))
    return plan.mode, plan.num_tokens_padded, plan.num_reqs_padded


def test_v1_full_for_uniform_decode_padded_up_the_ladder() -> None:
    plan = _v1().dispatch(np.ones(37, dtype=np.int32))
    assert (plan.mode, plan.num_tokens_padded, plan.num_reqs_padded) == ("FULL", 40, 40)
    assert plan.descriptor == BatchDescriptor("FULL", 40, 40)


def test_v1_mixed_batch_runs_piecewise_with_only_the_tokens_padded() -> None:
    plan = _v1().dispatch(np.array([1, 1, 5], dtype=np.int32))
    assert (plan.mode, plan.num_tokens_padded, plan.num_reqs_padded) == ("PIECEWISE", 8, 3)
    # keyed by token count alone: any request count shares the size's graphs
    assert plan.descriptor == BatchDescriptor("PIECEWISE", 8, None)
    assert _plan(_v1(), [33, 100, 2]) == ("PIECEWISE", 136, 3)  # 135 -> 136 (step 8)
    assert _plan(_v1(), [512]) == ("PIECEWISE", 512, 1)  # a size itself: no padding


def test_v1_oversized_batches_run_eager_at_real_size() -> None:
    assert _plan(_v1(), [1] * 600) == ("NONE", 600, 600)  # above every capture size
    assert _plan(_v1(), [300, 213]) == ("NONE", 513, 2)
    assert _v1().dispatch(np.array([300, 213], dtype=np.int32)).descriptor is None


@given(st.lists(st.integers(1, 64), min_size=1, max_size=40),
       st.sampled_from(["FULL", "PIECEWISE", "FULL_AND_PIECEWISE"]))
def test_v1_dispatch_per_mode(query_lens: list[int], mode: str) -> None:
    """The decision table, against an independent statement of it."""
    num_tokens, num_reqs = sum(query_lens), len(query_lens)
    uniform = max(query_lens) == 1
    fits = [s for s in LADDER if s >= num_tokens]
    if uniform and mode != "PIECEWISE" and fits:
        want = ("FULL", min(fits), min(fits))
    elif mode != "FULL" and fits:
        want = ("PIECEWISE", min(fits), num_reqs)
    else:
        want = ("NONE", num_tokens, num_reqs)
    assert _plan(_v1(mode), query_lens) == want


def test_v1_full_sizes_stop_at_max_num_seqs_piecewise_sizes_at_the_token_budget() -> None:
    graphs = _v1(sizes=[1, 2, 4, 8, 16, 32, 64], max_num_seqs=8)
    assert graphs.capture_sizes == [1, 2, 4, 8]
    assert graphs.piecewise_sizes == [1, 2, 4, 8, 16, 32, 64]
    assert _plan(graphs, [1] * 6) == ("FULL", 8, 8)
    # A uniform decode above the FULL sizes falls to the piecewise graphs.
    assert _plan(graphs, [1] * 12) == ("PIECEWISE", 16, 12)
    assert _plan(graphs, [20, 30]) == ("PIECEWISE", 64, 2)
    assert _plan(graphs, [40, 30]) == ("NONE", 70, 2)


def test_v1_nothing_before_capture_and_nothing_for_an_empty_step() -> None:
    graphs = _v1()
    graphs.captured = False
    assert _plan(graphs, [1, 1, 5]) == ("NONE", 7, 3)
    assert _plan(graphs, [1, 1]) == ("NONE", 2, 2)


def test_backends_declare_whether_they_run_inside_a_full_graph() -> None:
    assert {n: cls.supports_full_cudagraph for n, cls in BACKENDS.items()} == {
        "TORCH": False, "TRITON": True, "FLASH_ATTN": True, "NULL": True}
    assert set(BACKENDS) == set(BACKEND_NAMES)


def test_v1_graphs_off_on_cpu_and_full_off_for_the_torch_oracle() -> None:
    cpu = V1CudaGraphs(_config("FULL", LADDER), SimpleNamespace(type="cpu"), _executor(), None, None)
    assert not cpu.enabled
    assert cpu.dispatch(np.ones(4, dtype=np.int32)).mode == "NONE"
    torch_oracle = V1CudaGraphs(_config("FULL", LADDER), SimpleNamespace(type="cuda"),
                                _executor("TORCH"), None, None)
    assert not torch_oracle.enabled  # it reads lengths on the host: not capturable
    # Piecewise graphs leave attention eager, so the TORCH backend can use them.
    both = _v1("FULL_AND_PIECEWISE", backend="TORCH")
    assert (both.full_enabled, both.piecewise_enabled) == (False, True)
    assert _plan(both, [1] * 5) == ("PIECEWISE", 8, 5)
    assert _plan(both, [1, 3]) == ("PIECEWISE", 4, 2)


def test_v1_explicit_piecewise_modes_are_accepted() -> None:
    for mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        config = _config(mode, LADDER)
        config.compilation_config.cudagraph_mode_requested = mode
        graphs = V1CudaGraphs(config, SimpleNamespace(type="cuda"), _executor(), None, None)
        assert graphs.piecewise_enabled and graphs.full_enabled == (mode != "PIECEWISE")


def _v2(mode: str = "FULL_AND_PIECEWISE", backend: str = "TRITON", sizes: list[int] = LADDER,
        max_num_seqs: int = 512, max_num_batched_tokens: int = 2048) -> CudaGraphManager:
    manager = CudaGraphManager(
        _config(mode, sizes, max_num_seqs, max_num_batched_tokens), SimpleNamespace(type="cuda"),
        _executor(backend), None, None)
    # As if captured on a GPU: dispatch only asks which graphs exist.
    if manager.full_enabled:
        manager.graphs = {BatchDescriptor("FULL", s, s): None for s in manager.capture_sizes}
    if manager.piecewise_enabled:
        manager.piecewise = SimpleNamespace(captured=manager.piecewise_sizes)
    return manager


def test_v2_dispatch_picks_only_captured_graphs() -> None:
    manager = CudaGraphManager(_config("FULL_AND_PIECEWISE", LADDER), SimpleNamespace(type="cuda"),
                               _executor(), None, None)
    assert manager.full_enabled and manager.piecewise_enabled
    assert manager.dispatch(num_reqs=5, num_tokens=5, max_query_len=1) is None  # nothing captured
    assert manager.dispatch(num_reqs=2, num_tokens=9, max_query_len=5) is None
    captured = _v2()
    assert captured.dispatch(5, 5, 1) == BatchDescriptor("FULL", 8, 8)
    assert captured.dispatch(2, 9, 5) == BatchDescriptor("PIECEWISE", 16, None)  # tokens only
    assert captured.dispatch(3, 135, 100) == BatchDescriptor("PIECEWISE", 136, None)
    assert captured.dispatch(1, 512, 512) == BatchDescriptor("PIECEWISE", 512, None)  # no padding
    assert captured.dispatch(2, 513, 300) is None  # above every size: eager
    assert captured.dispatch(600, 600, 1) is None
    assert captured.dispatch(0, 0, 0) is None  # an empty step runs nothing


def test_v2_modes_decide_which_graphs_exist() -> None:
    def kinds(mode: str, backend: str = "TRITON", device: str = "cuda") -> tuple[bool, bool]:
        manager = CudaGraphManager(_config(mode, LADDER), SimpleNamespace(type=device),
                                   _executor(backend), None, None)
        assert manager.enabled == (manager.full_enabled or manager.piecewise_enabled)
        return manager.full_enabled, manager.piecewise_enabled

    assert kinds("FULL") == (True, False)
    assert kinds("PIECEWISE") == (False, True)  # no FULL graph is captured
    assert kinds("FULL_AND_PIECEWISE") == (True, True)
    assert kinds("FULL", "FLASH_ATTN") == (True, False)
    # The TORCH oracle reads lengths on the host: no FULL graphs, but attention between
    # piecewise graphs is eager, so it gets those.
    assert kinds("FULL", "TORCH") == (False, False)
    assert kinds("FULL_AND_PIECEWISE", "TORCH") == (False, True)
    assert kinds("FULL_AND_PIECEWISE", device="cpu") == (False, False)
    assert kinds("NONE") == (False, False)


V2_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]


@given(st.one_of(st.lists(st.just(1), min_size=1, max_size=24),
                 st.lists(st.integers(1, 40), min_size=1, max_size=12)),
       st.sampled_from(["FULL", "PIECEWISE", "FULL_AND_PIECEWISE"]),
       st.sampled_from(["TRITON", "TORCH"]))
def test_v2_dispatch_per_mode_and_backend(query_lens: list[int], mode: str, backend: str) -> None:
    """The decision table against an independent statement of it. FULL sizes stop at
    max_num_seqs (16), piecewise sizes at max_num_batched_tokens (48)."""
    num_reqs, num_tokens = len(query_lens), sum(query_lens)
    full = mode != "PIECEWISE" and backend != "TORCH"
    piecewise = mode != "FULL"
    full_fits = [s for s in V2_SIZES if num_reqs <= s <= 16]
    piecewise_fits = [s for s in V2_SIZES if num_tokens <= s <= 48]
    if full and max(query_lens) == 1 and full_fits:
        want = BatchDescriptor("FULL", min(full_fits), min(full_fits))
    elif piecewise and piecewise_fits:
        want = BatchDescriptor("PIECEWISE", min(piecewise_fits), None)
    else:
        want = None
    manager = _v2(mode, backend, V2_SIZES, max_num_seqs=16, max_num_batched_tokens=48)
    assert manager.dispatch(num_reqs, num_tokens, max(query_lens)) == want


def test_full_capture_warms_up_then_records_only_the_forward_largest_size_first() -> None:
    events: list[tuple] = []
    recording = [False]

    def fill(size: int):
        assert not recording[0], "the dummy inputs must be written outside the graph"
        events.append(("fill", size))
        return f"metadata {size}"

    def forward(size: int, metadata) -> torch.Tensor:
        events.append(("forward", size, metadata, "recorded" if recording[0] else "eager"))
        return torch.full((size,), size)

    class _Recorded:
        def __init__(self, body) -> None:
            self.body = body

        def replay(self) -> None:
            self.body()

    def record(body, pool):
        assert pool == "the pool"
        recording[0] = True
        try:
            return _Recorded(body), body()
        finally:
            recording[0] = False

    graphs = capture_full_graphs([2, 1, 4], fill, forward, "the pool", "test", record=record)
    assert events == [e for s in (4, 2, 1) for e in (
        ("fill", s), ("forward", s, f"metadata {s}", "eager"),
        ("fill", s), ("forward", s, f"metadata {s}", "recorded"))]
    assert list(graphs) == [BatchDescriptor("FULL", s, s) for s in (4, 2, 1)]
    for desc, (graph, output) in graphs.items():
        assert torch.equal(output, torch.full((desc.num_tokens,), desc.num_tokens))
        events.clear()
        graph.replay()  # replays the forward over the inputs of the capture
        assert events == [("forward", desc.num_tokens, f"metadata {desc.num_tokens}", "eager")]


# ---- speculative verifies: FULL graphs of 1 + k tokens per request ---------------------


@given(st.lists(st.integers(0, 4), min_size=1, max_size=12))
def test_uniform_verifies_take_the_spec_graphs_and_nothing_else_does(drafts):
    """A plain model of the rule: FULL (size * q, size, q) iff every row has the same q,
    q is the configured 1 + k and a spec size holds the rows; a uniform plain decode takes
    the plain FULL graphs; anything else piecewise (or eager past the sizes)."""
    k, full, piecewise, spec = 3, [1, 2, 4, 8], [8, 16, 32, 64], [1, 2, 4]
    q = [1 + d for d in drafts]
    n, t, m = len(q), sum(q), max(q)
    desc = dispatch_graph(n, t, m, full, piecewise, spec, 1 + k)
    if all(x == 1 for x in q) and n <= full[-1]:
        size = next(s for s in full if s >= n)
        assert desc == BatchDescriptor("FULL", size, size)
    elif all(x == 1 + k for x in q) and n <= spec[-1]:
        size = next(s for s in spec if s >= n)
        assert desc == BatchDescriptor("FULL", size * (1 + k), size, 1 + k)
    elif t <= piecewise[-1]:
        assert desc == BatchDescriptor("PIECEWISE", next(s for s in piecewise if s >= t), None)
    else:
        assert desc is None
