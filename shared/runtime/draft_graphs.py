"""FULL CUDA graphs of a draft model's single-token forwards (both runners).

A draft model's proposal ends in k - 1 forwards of one token per request: a uniform
decode, the one batch a FULL graph covers. Under piecewise graphs each of those still
launches every layer's attention eagerly, and for a 16-layer draft that host work is
several times the forward's GPU time (docs/results/README.md, speculative decoding). Here
they replay a whole-forward graph per padded request count, as the target's FULL decode
graphs do (shared/runtime/cudagraph_utils.py): the attention metadata is built inside the
graph from persistent buffers that each replay first refreshes, and the padded rows are
neutralised the usual way (seq_len 0, zero block-table rows, query_start_loc repeating,
PAD slots), so a stale row from a larger earlier batch can be neither read nor written.
"""

from __future__ import annotations

from typing import Any

import torch

from shared.attention.metadata import CommonAttentionMetadata
from shared.runtime.cudagraph_utils import (
    BatchDescriptor,
    FullGraphs,
    capture_full_graphs,
    fill_dummy_decode,
    padded_size,
)


class DraftDecodeGraphs:
    def __init__(self, executor: Any, sizes: list[int], input_ids: torch.Tensor,
                 positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        config = executor.config
        sc, block_size = config.scheduler_config, config.cache_config.block_size
        self.executor = executor
        self.max_model_len = sc.max_model_len
        self.block_size = block_size
        max_reqs = sc.max_num_seqs
        self.sizes = sorted(s for s in sizes if s <= max_reqs)
        device = input_ids.device
        self.input_ids, self.positions, self.slot_mapping = input_ids, positions, slot_mapping
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_reqs, dtype=torch.int32, device=device)
        max_blocks = -(-sc.max_model_len // block_size)
        self.block_table = torch.zeros(max_reqs, max_blocks, dtype=torch.int32, device=device)
        self.arange = torch.arange(max_reqs + 1, dtype=torch.int32, device=device)
        self.graphs: FullGraphs = {}

    def capture(self, pool: Any) -> None:
        if self.sizes and self.executor.backend.supports_full_cudagraph:
            self.graphs = capture_full_graphs(self.sizes, self._fill_dummy, self._forward,
                                              pool, "draft decode")

    def size_for(self, common: CommonAttentionMetadata, num_tokens: int) -> int | None:
        """The graph size a forward replays, or None: not a uniform decode, or too big."""
        if not self.graphs or common.max_query_len != 1 or common.num_reqs != num_tokens:
            return None
        return padded_size(num_tokens, self.sizes)

    def run(self, n: int, size: int, common: CommonAttentionMetadata) -> torch.Tensor:
        """Replay the graph of `size` for n real requests; the caller has written the
        ids, positions and slots [:size] (padded). -> hidden states [n, hidden]."""
        self.seq_lens[:n].copy_(common.seq_lens[:n])
        self.seq_lens[n:size].zero_()
        self.query_start_loc[: n + 1].copy_(self.arange[: n + 1])
        self.query_start_loc[n + 1 : size + 1].fill_(n)
        self.block_table[:n].copy_(common.block_table[:n])
        self.block_table[n:size].zero_()
        graph, hidden = self.graphs[BatchDescriptor("FULL", size, size)]
        graph.replay()
        return hidden[:n]

    def _fill_dummy(self, size: int) -> CommonAttentionMetadata:
        return fill_dummy_decode(
            size, self.input_ids, self.positions, self.query_start_loc, self.seq_lens,
            self.block_table, self.slot_mapping, self.max_model_len, self.block_size,
        )

    def _forward(self, size: int, common: CommonAttentionMetadata) -> torch.Tensor:
        attn_metadata = self.executor.build_attn_metadata(common)
        return self.executor.forward(self.input_ids[:size], self.positions[:size],
                                     attn_metadata, size, cudagraph_mode="FULL")
