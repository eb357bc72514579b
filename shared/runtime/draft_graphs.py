"""Which CUDA graphs a draft model's forwards replay (both runners), and its FULL graphs.

A draft model runs up to k + 1 small forwards per step. Under piecewise graphs each one
still launches every layer's attention eagerly between the segment replays (a 16-layer
draft: 17 replays and 16 eager attention calls per forward), so on the GPU its host work
exceeds its GPU work. Its uniform forwards, those where every request runs the same
number of tokens q, replay one whole-forward FULL graph instead, keyed by (q, padded
request count) as the target's verify graphs are (shared/runtime/cudagraph_utils.py):
- q = 1: the single-token forwards that extend the drafts (k - 1 per step);
- the catch-up forward when it is uniform: V2 feeds every sampled decode row with k
  drafts k + 2 tokens, so its catch-up is uniform whenever the batch is; V1 feeds a row
  its accepted drafts + 2 tokens, uniform at batch 1 (q in 2..k + 2).
Every other forward keeps the piecewise graphs (eager on CPU and without graphs).

A FULL graph reads every input the attention reads from persistent buffers: the token
ids, positions and slots (DraftForward's) and, here, query_start_loc, seq_lens and the
block table. Before each replay `stage` writes the real rows and neutralises the padded
ones with the rules of CommonAttentionMetadata (query_start_loc repeats n * q, seq_lens
0, block-table rows 0, slots PAD), so a row left over from an earlier, larger forward can
neither be read nor written, and the padded tokens write no KV and are never read.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.attention.metadata import CommonAttentionMetadata
from shared.runtime.cudagraph_utils import (
    BatchDescriptor,
    FullGraphs,
    capture_full_graphs,
    fill_dummy_decode,
    is_uniform_decode,
    padded_size,
)

logger = logging.getLogger("runnerlab")

FULL_MODES = ("FULL", "FULL_AND_PIECEWISE")


@dataclass(frozen=True)
class DraftGraphConfig:
    """The graphs of one draft model: piecewise sizes (token counts) and, per uniform
    query length, the request counts of its FULL graphs. Empty: none of that kind."""

    piecewise_sizes: list[int] = field(default_factory=list)
    full_sizes: dict[int, list[int]] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.piecewise_sizes or self.full_sizes)


def draft_graph_config(config: Any, on_cuda: bool, backend: Any,
                       full_query_lens: Mapping[int, int], max_num_tokens: int) -> DraftGraphConfig:
    """The draft's graphs for an engine configuration. Piecewise graphs at the engine's
    capture sizes whenever CUDA graphs are on at all (the draft's forwards are small and
    many: graphs pay off most there). FULL graphs when cudagraph_mode has FULL graphs, the
    attention backend can run inside one and KernelOptions.draft_full_graphs is on: for
    each query length q of `full_query_lens` (q -> the most requests worth a graph), the
    capture sizes up to that many requests (and max_num_seqs) whose q-token batch fits
    `max_num_tokens`. Nothing off CUDA (the mode is NONE there anyway)."""
    cc = config.compilation_config
    if not on_cuda or cc.cudagraph_mode == "NONE":
        return DraftGraphConfig()
    sizes = sorted(cc.cudagraph_capture_sizes)
    piecewise = [s for s in sizes if s <= max_num_tokens]
    options = getattr(config, "kernel_options", None)
    wants_full = (cc.cudagraph_mode in FULL_MODES and backend.supports_full_cudagraph
                  and (options is None or options.draft_full_graphs))
    full: dict[int, list[int]] = {}
    if wants_full:
        max_reqs = config.scheduler_config.max_num_seqs
        for q, most in sorted(full_query_lens.items()):
            fit = [s for s in sizes if s <= min(most, max_reqs) and s * q <= max_num_tokens]
            if fit:
                full[q] = fit
    return DraftGraphConfig(piecewise, full)


def dispatch_draft(num_reqs: int, num_tokens: int, max_query_len: int,
                   full_sizes: Mapping[int, Sequence[int]],
                   piecewise_sizes: Sequence[int]) -> BatchDescriptor | None:
    """The graph a draft forward runs (sizes sorted ascending; empty where none are
    captured): FULL ("FULL", S * q, S, q) when every request runs q = max_query_len tokens
    and S, the smallest FULL size >= num_reqs for q, exists; else PIECEWISE with the token
    count padded to the smallest piecewise size (the attention between the segments sees
    the real requests: num_reqs None); else None, eager at the real size."""
    if num_tokens == 0:
        return None
    sizes = full_sizes.get(max_query_len)
    if sizes and is_uniform_decode(max_query_len, num_tokens, num_reqs, max_query_len):
        size = padded_size(num_reqs, list(sizes))
        if size is not None:
            return BatchDescriptor("FULL", size * max_query_len, size, max_query_len)
    size = padded_size(num_tokens, list(piecewise_sizes)) if piecewise_sizes else None
    return None if size is None else BatchDescriptor("PIECEWISE", size, None)


class DraftFullGraphs:
    """The FULL graphs of a draft model and the persistent metadata they read. The token
    buffers (ids, positions, slots) are DraftForward's, padded by it; the graphs are
    captured over views of all six buffers, which must never be reallocated."""

    def __init__(self, executor: Any, full_sizes: Mapping[int, Sequence[int]],
                 input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        config = executor.config
        self.executor = executor
        self.full_sizes = {q: sorted(s) for q, s in full_sizes.items() if s}
        self.max_model_len = config.scheduler_config.max_model_len
        self.block_size = config.cache_config.block_size
        device = input_ids.device
        self.input_ids, self.positions, self.slot_mapping = input_ids, positions, slot_mapping
        max_reqs = max((s[-1] for s in self.full_sizes.values()), default=0)
        max_blocks = -(-self.max_model_len // self.block_size)  # the runners' table width
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_reqs, max_blocks, dtype=torch.int32, device=device)
        # one query_start_loc per query length: between the steps of a batch each keeps
        # its (n, S) layout, so it is rewritten only when the batch changes
        self.query_start_loc = {q: torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
                                for q in self.full_sizes}
        self._qsl_layout: dict[int, tuple[int, int] | None] = dict.fromkeys(self.full_sizes)
        self._arange = torch.arange(max_reqs + 1, dtype=torch.int32, device=device)
        self.graphs: FullGraphs = {}

    # ---- capture ------------------------------------------------------------------------
    def capture(self, pool: Any) -> None:
        """One graph per (q, size), the largest batches first (their temporaries size the
        pool; the smaller ones reuse them)."""
        order = sorted(self.full_sizes, key=lambda q: -q * self.full_sizes[q][-1])
        for q in order:
            self.graphs.update(capture_full_graphs(
                self.full_sizes[q], lambda s, q=q: self._fill_dummy(s, q),
                lambda s, common, q=q: self._forward(s, q, common), pool,
                f"draft ({q} token(s) per request)", query_len=q))
        self._qsl_layout = dict.fromkeys(self.full_sizes)  # the dummies overwrote them

    def _fill_dummy(self, size: int, q: int) -> CommonAttentionMetadata:
        return fill_dummy_decode(
            size, self.input_ids, self.positions, self.query_start_loc[q], self.seq_lens,
            self.block_table, self.slot_mapping, self.max_model_len, self.block_size, q)

    def _forward(self, size: int, q: int, common: CommonAttentionMetadata) -> torch.Tensor:
        """What a graph holds: the metadata build and the whole forward (a draft executor
        has no graph wrapper: its model_call is the model itself)."""
        attn_metadata = self.executor.build_attn_metadata(common)
        n = size * q
        return self.executor.forward(self.input_ids[:n], self.positions[:n], attn_metadata, n,
                                     cudagraph_mode="FULL")

    # ---- replay -------------------------------------------------------------------------
    def stage(self, desc: BatchDescriptor, common: CommonAttentionMetadata) -> None:
        """Write the metadata of `common` (num_reqs real rows, desc.uniform_query_len
        tokens each) into the persistent buffers and pad them to desc.num_reqs rows. A
        source that already is the persistent buffer (a proposer wrote it in place) is
        not copied."""
        q, size, n = desc.uniform_query_len, desc.num_reqs, common.num_reqs
        assert common.block_table.shape[1] == self.block_table.shape[1], (
            "the draft's block table must have the target's width")
        _copy_rows(self.seq_lens, common.seq_lens, n)
        _copy_rows(self.block_table, common.block_table, n)
        if size > n:  # padded rows attend to nothing
            self.seq_lens[n:size].zero_()
            self.block_table[n:size].zero_()
        if self._qsl_layout[q] != (n, size):
            qsl = self.query_start_loc[q]
            torch.mul(self._arange[: size + 1], q, out=qsl[: size + 1])
            qsl[n + 1 : size + 1].fill_(n * q)  # empty padded rows
            self._qsl_layout[q] = (n, size)

    def replay(self, desc: BatchDescriptor) -> torch.Tensor:
        """-> hidden states [desc.num_tokens, hidden], the graph's output (rows past the
        real tokens are garbage; valid until the graph's next replay)."""
        graph, hidden = self.graphs[desc]
        graph.replay()
        return hidden


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, n: int) -> None:
    if src.data_ptr() != dst.data_ptr():
        dst[:n].copy_(src[:n])
