"""V2's explicit CUDA graphs. A manager captures them at start-up; per step `dispatch()`
returns a descriptor (or None: run eager) and the runner calls the matching replay:

- FULL (`run_fullgraph(desc)`): one graph of the whole forward per capture size
  <= max_num_seqs, for uniform-decode batches. It replays with no arguments: input prep
  has already written the step's inputs into the captured persistent buffers, and the
  attention metadata is built inside the graph.
- PIECEWISE (`run_piecewise(desc, attn_metadata)`): the shared PiecewiseGraphs
  (shared/runtime/piecewise_graphs.py) per capture size <= max_num_batched_tokens, over
  V2's persistent input_ids / positions, for every other batch that fits. Attention runs
  eagerly between the segment graphs with metadata built for the real requests, so any
  backend works, also one that cannot run inside a FULL graph (the TORCH oracle).

FULL and PIECEWISE graphs share one memory pool; cudagraph_mode decides which exist
(FULL: FULL only, PIECEWISE: PIECEWISE only, FULL_AND_PIECEWISE: both).

What makes a FULL replay safe with fewer real rows than the graph's size: the pos/seq_lens
kernel zeroes seq_lens past num_reqs, query_start_loc's tail repeats the token count,
BlockTables.prepare zeroes padded rows and the slot mapping is PAD from the real token
count to the end — so the padded rows attend to nothing and write nothing. A PIECEWISE
step pads the token count only: the tokens past num_tokens get input id 0 and position 0
(the input-prep kernel) and PAD slots, and no request's query range covers them, so they
attend to nothing, write no KV and are never sampled.
"""

from __future__ import annotations

from typing import Any

import torch

from policy.config import EngineConfig
from shared.attention.metadata import CommonAttentionMetadata
from shared.runtime.cudagraph_utils import (
    BatchDescriptor,
    FullGraphs,
    capture_full_graphs,
    capture_verify_graphs,
    dispatch_graph,
    fill_dummy_decode,
    graph_sizes,
)
from shared.runtime.piecewise_graphs import PiecewiseGraphs


class CudaGraphManager:
    def __init__(
        self, config: EngineConfig, device: torch.device, executor, buffers, block_tables
    ) -> None:
        self.mode = config.compilation_config.cudagraph_mode  # NONE on CPU / enforce_eager
        sizes = graph_sizes(config, device.type == "cuda", executor.backend, "V2")
        self.capture_sizes, self.piecewise_sizes = sizes.full_sizes, sizes.piecewise_sizes
        self.full_enabled, self.piecewise_enabled = sizes.full_enabled, sizes.piecewise_enabled
        # FULL graphs of uniform speculative verifies (1 + k tokens per request)
        self.spec_sizes, self.spec_query_len = list(sizes.spec_full_sizes), sizes.spec_query_len
        self.enabled = self.full_enabled or self.piecewise_enabled
        self.executor = executor
        self.buffers = buffers
        self.block_tables = block_tables
        self.max_model_len = config.scheduler_config.max_model_len
        self.graphs: FullGraphs = {}
        self.piecewise: PiecewiseGraphs | None = None  # set once captured
        self.pool = None  # the one memory pool of every graph, FULL and PIECEWISE

    # ---- dispatch and replay --------------------------------------------------------------
    def dispatch(self, num_reqs: int, num_tokens: int, max_query_len: int) -> BatchDescriptor | None:
        """("FULL", size, size) for a uniform decode within the captured FULL sizes;
        else ("PIECEWISE", padded token count, None) when piecewise graphs are captured
        and the token count fits; else None, eager at the real sizes (dispatch_graph,
        the rule V1 shares)."""
        return dispatch_graph(
            num_reqs, num_tokens, max_query_len,
            self.capture_sizes if self.graphs else [],
            self.piecewise_sizes if self.piecewise is not None else [],
            self.spec_sizes if self.graphs else [], self.spec_query_len,
        )

    def run_fullgraph(self, desc: BatchDescriptor) -> torch.Tensor:
        graph, hidden_states = self.graphs[desc]
        graph.replay()
        return hidden_states

    def run_piecewise(self, desc: BatchDescriptor, attn_metadata: Any) -> torch.Tensor:
        """Replay the segment graphs of desc.num_tokens, attention eager between them
        under the step's forward context. Like a FULL replay it takes no inputs: input
        prep has written them into the persistent buffers the graphs read. -> hidden
        states [desc.num_tokens, hidden], a view of a static buffer (rows past the real
        tokens are garbage; valid until the next forward)."""
        assert desc.mode == "PIECEWISE" and self.piecewise is not None, desc
        size = desc.num_tokens
        return self.executor.forward(
            self.buffers.input_ids[:size], self.buffers.positions[:size], attn_metadata,
            size, cudagraph_mode="PIECEWISE", batch_descriptor=desc, run=self.piecewise.run,
        )

    # ---- capture ------------------------------------------------------------------------
    def capture(self) -> None:
        if not self.enabled:
            return
        # One memory pool for every graph. FULL first: its graphs keep their outputs
        # alive in the pool, so no later capture places scratch memory over them; the
        # piecewise graphs own no live outputs (they copy into static buffers).
        self.pool = torch.cuda.graph_pool_handle()
        if self.full_enabled:
            self.graphs = capture_full_graphs(
                self.capture_sizes, self._fill_dummy_inputs, self._captured_forward,
                self.pool, "V2",
            )
            self.graphs.update(capture_verify_graphs(
                self.spec_sizes, self.spec_query_len, self._fill_dummy_inputs,
                self._captured_forward, self.pool, "V2"))
        if self.piecewise_enabled:
            piecewise = PiecewiseGraphs(
                self.executor.model, self.piecewise_sizes, self.buffers.input_ids,
                self.buffers.positions, self.block_tables.slot_mappings, self.executor.dtype,
            )
            piecewise.capture(self.pool, "V2")
            self.piecewise = piecewise

    def _captured_forward(self, size: int, common: CommonAttentionMetadata,
                          query_len: int = 1) -> torch.Tensor:
        """What a FULL graph holds: the metadata build and the whole forward."""
        attn_metadata = self.executor.build_attn_metadata(common)
        b, n = self.buffers, size * query_len
        return self.executor.forward(b.input_ids[:n], b.positions[:n], attn_metadata, n)

    def _fill_dummy_inputs(self, size: int, query_len: int = 1) -> CommonAttentionMetadata:
        """Called before (not inside) each capture; see fill_dummy_decode."""
        b = self.buffers
        return fill_dummy_decode(
            size, b.input_ids, b.positions, b.query_start_loc, b.seq_lens,
            self.block_tables.input_block_tables, self.block_tables.slot_mappings,
            self.max_model_len, self.executor.block_size, query_len,
        )
