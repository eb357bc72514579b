"""CUDA-graph helpers both runners use: which graphs a configuration captures, the
padding ladder, the batch predicates, the dispatch rule, the dummy decode a FULL graph
is captured over, and the FULL-graph capture loop (the piecewise graphs are in
shared/runtime/piecewise_graphs.py).

The capture sizes themselves are resolved once in policy's CompilationConfig; here is
only the arithmetic on them. How a step reaches its graph stays in each runner: V1 picks
it through the forward context (implicit), V2 replays it by descriptor (explicit).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shared.attention.metadata import PAD_SLOT_ID, CommonAttentionMetadata

if TYPE_CHECKING:
    from policy.config import EngineConfig

logger = logging.getLogger("runnerlab")


def padded_size(num: int, capture_sizes: list[int]) -> int | None:
    """The smallest capture size >= num (capture_sizes sorted ascending), or None when num
    is above the largest size (the step then runs eager at its real size)."""
    i = bisect.bisect_left(capture_sizes, num)
    return capture_sizes[i] if i < len(capture_sizes) else None


def is_uniform_decode(max_query_len: int, num_tokens: int, num_reqs: int,
                      query_len: int = 1) -> bool:
    """Every request runs exactly `query_len` tokens: 1 for a plain decode, 1 + k for a
    speculative verify where every row carries k drafts. The only batches FULL graphs
    cover."""
    return max_query_len == query_len and num_tokens == num_reqs * query_len


@dataclass(frozen=True)
class BatchDescriptor:
    """The key of a captured graph: the mode and the padded sizes it was captured at."""

    mode: str  # "FULL" | "PIECEWISE" | "NONE"
    num_tokens: int  # padded token count (num_reqs * uniform_query_len for FULL)
    num_reqs: int | None  # padded request count for FULL; None for PIECEWISE / NONE
    uniform_query_len: int = 1  # FULL: tokens per request (1 + k for a spec verify)


def dispatch_graph(
    num_reqs: int,
    num_tokens: int,
    max_query_len: int,
    full_sizes: list[int],
    piecewise_sizes: list[int],
    spec_full_sizes: list[int] = (),
    spec_query_len: int = 0,
) -> BatchDescriptor | None:
    """The graph a step runs, both runners' rule (sizes sorted ascending; [] where that
    kind of graph is not captured): FULL for a uniform decode within the FULL sizes,
    padded by request count, or for a uniform speculative verify (every row 1 + k tokens,
    spec_query_len) within spec_full_sizes (request counts); else PIECEWISE when the token count fits the piecewise
    sizes, padded by token count alone (num_reqs None: the attention between the
    segments is eager and sees the real request count); else None, eager at the real
    sizes (an empty step included)."""
    if num_tokens == 0:
        return None
    if full_sizes and is_uniform_decode(max_query_len, num_tokens, num_reqs):
        size = padded_size(num_reqs, full_sizes)
        if size is not None:
            return BatchDescriptor("FULL", size, size)
    if spec_full_sizes and is_uniform_decode(max_query_len, num_tokens, num_reqs, spec_query_len):
        size = padded_size(num_reqs, list(spec_full_sizes))
        if size is not None:
            return BatchDescriptor("FULL", size * spec_query_len, size, spec_query_len)
    size = padded_size(num_tokens, piecewise_sizes) if piecewise_sizes else None
    return None if size is None else BatchDescriptor("PIECEWISE", size, None)


@dataclass(frozen=True)
class GraphSizes:
    """Which graphs a runner captures, read once from the resolved configuration."""

    full_sizes: list[int]  # FULL: uniform decode, num_tokens == num_reqs <= max_num_seqs
    piecewise_sizes: list[int]  # PIECEWISE: any batch of <= max_num_batched_tokens tokens
    full_enabled: bool
    piecewise_enabled: bool
    # FULL graphs of uniform speculative verifies (request counts; [] without spec decode)
    spec_full_sizes: list[int] = ()
    spec_query_len: int = 0  # 1 + num_speculative_tokens, 0 without spec decode


def graph_sizes(config: EngineConfig, on_cuda: bool, backend: Any, label: str) -> GraphSizes:
    """FULL graphs for cudagraph_mode FULL / FULL_AND_PIECEWISE with a backend that can
    run inside one; PIECEWISE graphs for PIECEWISE / FULL_AND_PIECEWISE with any backend
    (attention runs eagerly between them); neither off CUDA. The mode was resolved by
    policy (NONE on CPU or with enforce_eager). `backend`: the executor's attention
    backend, of which only `supports_full_cudagraph` and `name` are read."""
    mode = config.compilation_config.cudagraph_mode
    sizes = config.compilation_config.cudagraph_capture_sizes
    sc = config.scheduler_config
    full_sizes = sorted(s for s in sizes if s <= sc.max_num_seqs)
    piecewise_sizes = sorted(s for s in sizes if s <= sc.max_num_batched_tokens)
    wants_full = on_cuda and mode in ("FULL", "FULL_AND_PIECEWISE") and bool(full_sizes)
    piecewise_enabled = (
        on_cuda and mode in ("PIECEWISE", "FULL_AND_PIECEWISE") and bool(piecewise_sizes)
    )
    # The TORCH oracle reads lengths on the host: a FULL graph would freeze them.
    if wants_full and not backend.supports_full_cudagraph:
        logger.info(
            "%s cudagraph_mode=%s with the %s attention backend: no FULL graphs (it cannot "
            "run inside one)%s", label, mode, backend.name,
            "; piecewise graphs cover every batch that fits" if piecewise_enabled else "",
        )
    full_enabled = wants_full and backend.supports_full_cudagraph
    spec = getattr(config, "speculative_config", None)
    spec_query_len = 0 if spec is None else 1 + spec.num_speculative_tokens
    spec_sizes = [s for s in full_sizes if s * spec_query_len <= sc.max_num_batched_tokens]
    return GraphSizes(full_sizes, piecewise_sizes, full_enabled, piecewise_enabled,
                      spec_sizes if full_enabled and spec_query_len else [], spec_query_len)


def fill_dummy_decode(
    size: int,
    input_ids: torch.Tensor,  # [>= size] persistent buffers, written in place
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,  # [>= size + 1]
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,  # [>= size, max_blocks]
    slot_mapping: torch.Tensor,
    max_model_len: int,
    block_size: int,
    query_len: int = 1,
) -> CommonAttentionMetadata:
    """Write a uniform decode of `size` rows (`query_len` tokens each: 1, or 1 + k for a
    speculative verify) into a runner's persistent buffers and return
    its metadata, for graph warm-up and capture. Zero block-table rows and PAD slots: the
    capture reads block 0 at most and writes nothing into the KV cache.

    Call it OUTSIDE the captured region: captured, these writes would replay every step
    and reset the step's real inputs to this dummy batch. max_seq_len is max_model_len so
    that nothing the backend derives from it at capture is too small at replay."""
    num_tokens = size * query_len
    input_ids[:num_tokens].zero_()
    positions[:num_tokens].zero_()
    query_start_loc[: size + 1].copy_(torch.arange(
        0, num_tokens + 1, query_len, dtype=query_start_loc.dtype, device=query_start_loc.device))
    seq_lens[:size].fill_(query_len)
    block_table[:size].zero_()
    slot_mapping[:num_tokens].fill_(PAD_SLOT_ID)
    num_decodes = size if query_len == 1 else 0
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc[: size + 1],
        seq_lens=seq_lens[:size],
        block_table=block_table[:size],
        slot_mapping=slot_mapping[:num_tokens],
        num_reqs=size,
        num_actual_tokens=num_tokens,
        max_query_len=query_len,
        max_seq_len=max_model_len,
        num_decodes=num_decodes,
        num_prefills=size - num_decodes,
        num_decode_tokens=num_decodes,
        block_size=block_size,
    )


class Replayable(Protocol):
    def replay(self) -> None: ...


# A captured FULL graph per descriptor, with the output tensor its replays overwrite.
FullGraphs = dict[BatchDescriptor, tuple[Replayable, torch.Tensor]]


@contextlib.contextmanager
def no_gc_during_capture() -> Iterator[None]:
    """Collect garbage first and keep the collector off while graphs are captured: a
    collection inside a capture may free another engine's pinned buffers (cudaFreeHost),
    which invalidates the capture ("operation failed due to a previous error during
    capture", seen on the H200 when a test builds engine after engine)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def record_cuda_graph(
    body: Callable[[], torch.Tensor], pool: Any
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `body` in a CUDA graph allocating from `pool`; -> (graph, body's output)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = body()
    return graph, output


def capture_full_graphs(
    sizes: Iterable[int],
    fill_inputs: Callable[[int], CommonAttentionMetadata],
    forward: Callable[[int, CommonAttentionMetadata], torch.Tensor],
    pool: Any,
    label: str,
    record: Callable[[Callable[[], torch.Tensor], Any], tuple[Replayable, torch.Tensor]] = (
        record_cuda_graph
    ),
    query_len: int = 1,
) -> FullGraphs:
    """One FULL graph per capture size (a request count), keyed
    BatchDescriptor("FULL", size * query_len, size, query_len).

    Per size, largest first (its temporaries size the pool; smaller sizes reuse them):
    `fill_inputs(size)` writes a dummy decode into the runner's persistent buffers and
    returns its metadata, `forward(size, metadata)` runs once eagerly (Triton JIT and
    allocator warm-up outside the capture), then the buffers are filled again and only
    `forward` is recorded. The filling stays OUTSIDE the graph: captured, every replay
    would reset the step's real inputs to the dummy batch. The graphs read the buffers'
    addresses, so those buffers must never be reallocated.

    `record` captures (tests on CPU pass an eager stand-in); `label` names the runner
    in the log line."""
    sizes = sorted(sizes)
    on_cuda = torch.cuda.is_available()
    start = time.perf_counter()
    free_before = torch.cuda.mem_get_info()[0] if on_cuda else 0
    graphs: FullGraphs = {}
    with no_gc_during_capture():
        for size in reversed(sizes):
            forward(size, fill_inputs(size))  # eager warm-up
            if on_cuda:
                torch.cuda.synchronize()
            metadata = fill_inputs(size)
            graphs[BatchDescriptor("FULL", size * query_len, size, query_len)] = record(
                lambda s=size, m=metadata: forward(s, m), pool
            )
    if on_cuda:
        torch.cuda.synchronize()
        logger.info(
            "%s captured %d FULL graphs (sizes %d..%d, %d token(s) per request) in %.2f s, "
            "%.1f MB of graph memory", label, len(graphs), sizes[0], sizes[-1], query_len,
            time.perf_counter() - start,
            (free_before - torch.cuda.mem_get_info()[0]) / 1e6,
        )
    return graphs


def capture_verify_graphs(
    sizes: list[int], query_len: int,
    fill_inputs: Callable[..., CommonAttentionMetadata],
    forward: Callable[..., torch.Tensor], pool: Any, label: str,
) -> FullGraphs:
    """FULL graphs of uniform speculative verifies (`sizes` requests x `query_len` =
    1 + k tokens), both runners: capture_full_graphs with the runner's own fill and
    forward, each called with query_len=. {} without speculative decoding."""
    if not sizes:
        return {}
    return capture_full_graphs(
        sizes, functools.partial(fill_inputs, query_len=query_len),
        functools.partial(forward, query_len=query_len), pool,
        f"{label} spec verify", query_len=query_len,
    )
