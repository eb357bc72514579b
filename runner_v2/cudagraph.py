"""V2's explicit CUDA graphs: a manager captures one FULL graph of the whole forward
per capture size for uniform-decode batches; `dispatch()` returns a descriptor (or
None: run eager) and `run_fullgraph(desc)` replays with no arguments, because input
prep has already written the step's inputs into the captured persistent buffers.

What makes a replay safe with fewer real rows than the graph's size: the pos/seq_lens
kernel zeroes seq_lens past num_reqs, query_start_loc's tail repeats the token count,
BlockTables.prepare zeroes padded rows and the slot mapping is PAD from the real token
count to the end — so the padded rows attend to nothing and write nothing.
"""

from __future__ import annotations

import torch

from policy.config import EngineConfig
from shared.attention.metadata import CommonAttentionMetadata
from shared.runtime.cudagraph_utils import (
    BatchDescriptor,
    FullGraphs,
    capture_full_graphs,
    fill_dummy_decode,
    is_uniform_decode,
    padded_size,
)


class CudaGraphManager:
    def __init__(
        self, config: EngineConfig, device: torch.device, executor, buffers, block_tables
    ):
        cc = config.compilation_config
        self.mode = cc.cudagraph_mode
        max_num_seqs = config.scheduler_config.max_num_seqs
        self.capture_sizes = sorted(s for s in cc.cudagraph_capture_sizes if s <= max_num_seqs)
        # A backend that cannot run inside a graph (the TORCH oracle reads lengths on the
        # host) means no graphs.
        self.enabled = (
            device.type == "cuda" and self.mode in ("FULL", "FULL_AND_PIECEWISE")
            and bool(self.capture_sizes) and executor.backend.supports_full_cudagraph
        )
        self.executor = executor
        self.buffers = buffers
        self.block_tables = block_tables
        self.max_model_len = config.scheduler_config.max_model_len
        self.graphs: FullGraphs = {}
        self.pool = None

    def dispatch(self, num_reqs: int, num_tokens: int, max_query_len: int) -> BatchDescriptor | None:
        if not self.graphs or not is_uniform_decode(max_query_len, num_tokens, num_reqs):
            return None
        size = padded_size(num_reqs, self.capture_sizes)
        return None if size is None else BatchDescriptor("FULL", size, size)

    def run_fullgraph(self, desc: BatchDescriptor) -> torch.Tensor:
        graph, hidden_states = self.graphs[desc]
        graph.replay()
        return hidden_states

    def capture(self) -> None:
        if not self.enabled:
            return
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs = capture_full_graphs(
            self.capture_sizes, self._fill_dummy_inputs, self._captured_forward, self.pool, "V2"
        )

    def _captured_forward(self, size: int, common: CommonAttentionMetadata) -> torch.Tensor:
        """What a FULL graph holds: the metadata build and the whole forward."""
        attn_metadata = self.executor.build_attn_metadata(common)
        b = self.buffers
        return self.executor.forward(b.input_ids[:size], b.positions[:size], attn_metadata, size)

    def _fill_dummy_inputs(self, size: int) -> CommonAttentionMetadata:
        """Called before (not inside) each capture; see fill_dummy_decode."""
        b = self.buffers
        return fill_dummy_decode(
            size, b.input_ids, b.positions, b.query_start_loc, b.seq_lens,
            self.block_tables.input_block_tables, self.block_tables.slot_mappings,
            self.max_model_len, self.executor.block_size,
        )
