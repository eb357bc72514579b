"""V1's implicit CUDA graphs: a dispatcher picks (mode, batch descriptor) per step, the
mode travels in the forward context, and a wrapper around the model replays.

- FULL graphs cover uniform-decode batches (every request decodes one token), captured
  per capture size with the whole forward, attention included.
- PIECEWISE graphs (shared/runtime/piecewise_graphs.py, shared with V2) cover every
  other batch of up to the largest piecewise size in tokens: the pieces between
  attention calls are captured per padded token count and attention runs eagerly in
  between, so one graph per size serves any mix of prefills and decodes.
- NONE (eager at the real size) above the largest size, on CPU, or with graphs off.

Padding: a FULL batch of n decodes runs the graph of the smallest capture size B >= n;
the rows n..B-1 are neutralised by input prep every step — query_start_loc repeats its
last value, seq_lens are 0, block-table rows are 0, slot mapping is PAD — so a stale row
from an earlier, larger batch can neither be read nor written. A PIECEWISE batch of t
tokens runs the graphs of the smallest size S >= t with its request count unpadded: the
tokens t..S-1 get input id 0, position 0 and a PAD slot, belong to no request in the
attention metadata, and are never sampled.

A backend that cannot run inside a graph (`supports_full_cudagraph` False: the TORCH
oracle, which reads lengths on the host) turns FULL graphs off; PIECEWISE graphs still
work with it (attention runs eagerly).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
from shared.runtime.forward_context import get_forward_context
from shared.runtime.piecewise_graphs import PiecewiseGraphs


@dataclass(frozen=True)
class StepPlan:
    mode: str  # "FULL" | "PIECEWISE" | "NONE"
    num_tokens_padded: int
    num_reqs_padded: int  # == num_reqs for PIECEWISE / NONE: only tokens are padded
    descriptor: BatchDescriptor | None


class CudaGraphWrapper:
    """Wraps the model's forward. Reads the mode from the forward context: FULL with a
    captured descriptor replays; PIECEWISE with a captured size runs the piecewise
    graphs; anything else runs the model."""

    def __init__(self, model: torch.nn.Module, piecewise: PiecewiseGraphs | None = None):
        self.model = model
        self.piecewise = piecewise
        self.graphs: FullGraphs = {}

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        desc = None if ctx is None else ctx.batch_descriptor
        if desc is not None and ctx.cudagraph_mode == "FULL" and desc in self.graphs:
            graph, output = self.graphs[desc]
            graph.replay()
            return output
        if (
            desc is not None and ctx.cudagraph_mode == "PIECEWISE"
            and self.piecewise is not None and desc.num_tokens in self.piecewise
        ):
            return self.piecewise.run(input_ids, positions)
        return self.model(input_ids, positions)


class V1CudaGraphs:
    def __init__(
        self, config: EngineConfig, device: torch.device, executor, buffers, persistent_batch
    ):
        self.mode = config.compilation_config.cudagraph_mode  # NONE on CPU / enforce_eager
        sizes = graph_sizes(config, device.type == "cuda", executor.backend, "V1")
        self.capture_sizes, self.piecewise_sizes = sizes.full_sizes, sizes.piecewise_sizes
        self.full_enabled, self.piecewise_enabled = sizes.full_enabled, sizes.piecewise_enabled
        # FULL graphs of uniform speculative verifies (1 + k tokens per request)
        self.spec_sizes, self.spec_query_len = list(sizes.spec_full_sizes), sizes.spec_query_len
        self.enabled = self.full_enabled or self.piecewise_enabled
        self.device = device
        self.executor = executor
        self.buffers = buffers
        self.persistent_batch = persistent_batch
        self.wrapper: CudaGraphWrapper | None = None
        self.pool = None  # the one memory pool of every graph, FULL and PIECEWISE
        self.captured = False  # dispatch picks graphs only once they exist
        self.max_model_len = config.scheduler_config.max_model_len

    # ---- dispatch -----------------------------------------------------------------------
    def dispatch(self, num_scheduled: np.ndarray) -> StepPlan:
        """FULL for a uniform decode within the FULL sizes; else PIECEWISE within the
        piecewise sizes (token count padded by bisection, request count not padded);
        else NONE at the real sizes (dispatch_graph, the rule V2 shares)."""
        num_reqs = int(num_scheduled.shape[0])
        num_tokens = int(num_scheduled.sum())
        desc = None
        if self.captured and num_tokens:
            desc = dispatch_graph(
                num_reqs, num_tokens, int(num_scheduled.max()),
                self.capture_sizes if self.full_enabled else [],
                self.piecewise_sizes if self.piecewise_enabled else [],
                self.spec_sizes, self.spec_query_len,
            )
        if desc is None:
            return StepPlan("NONE", num_tokens, num_reqs, None)
        # PIECEWISE graphs are keyed by token count alone (num_reqs None): the attention
        # between them is eager and sees the real request count.
        num_reqs_padded = num_reqs if desc.num_reqs is None else desc.num_reqs
        return StepPlan(desc.mode, desc.num_tokens, num_reqs_padded, desc)

    def run(self, plan: StepPlan, inputs, attn_metadata) -> torch.Tensor:
        return self.executor.forward(
            inputs.input_ids, inputs.positions, attn_metadata, plan.num_tokens_padded,
            cudagraph_mode=plan.mode, batch_descriptor=plan.descriptor,
        )

    # ---- capture ------------------------------------------------------------------------
    def capture(self) -> None:
        if not self.enabled:
            return
        model = self.executor.model
        piecewise = None
        if self.piecewise_enabled:
            piecewise = PiecewiseGraphs(
                model, self.piecewise_sizes, self.buffers.input_ids.gpu,
                self.buffers.positions.gpu, self.persistent_batch.block_table.slot_mapping.gpu,
                self.executor.dtype,
            )
        self.wrapper = CudaGraphWrapper(model, piecewise)
        # One memory pool for every graph. FULL first: its graphs keep their outputs
        # alive in the pool, so no later capture places scratch memory over them; the
        # piecewise graphs own no live outputs (they copy into static buffers).
        self.pool = torch.cuda.graph_pool_handle()
        if self.full_enabled:
            self.wrapper.graphs = capture_full_graphs(
                self.capture_sizes, self._fill_dummy_inputs, self._captured_forward,
                self.pool, "V1",
            )
            self.wrapper.graphs.update(capture_verify_graphs(
                self.spec_sizes, self.spec_query_len, self._fill_dummy_inputs,
                self._captured_forward, self.pool, "V1"))
        if piecewise is not None:
            piecewise.capture(self.pool, "V1")
        # From now on the executor's model call goes through the wrapper.
        self.executor.model_call = self.wrapper
        self.captured = True

    def _captured_forward(self, size: int, common: CommonAttentionMetadata,
                          query_len: int = 1) -> torch.Tensor:
        """A uniform decode of `size` rows over the persistent buffers. Only this part is
        captured (metadata build + forward): the buffer set-up stays OUTSIDE the graph,
        or every replay would reset the step's real inputs to the dummy batch."""
        attn_metadata = self.executor.build_attn_metadata(common)
        b, n = self.buffers, size * query_len
        return self.executor.forward(
            b.input_ids.gpu[:n], b.positions.gpu[:n], attn_metadata, n,
            cudagraph_mode="FULL", batch_descriptor=None,  # None: run, do not replay
        )

    def _fill_dummy_inputs(self, size: int, query_len: int = 1) -> CommonAttentionMetadata:
        """Called before (not inside) each capture; see fill_dummy_decode."""
        b, table = self.buffers, self.persistent_batch.block_table
        return fill_dummy_decode(
            size, b.input_ids.gpu, b.positions.gpu, b.query_start_loc.gpu, b.seq_lens.gpu,
            table.block_table.gpu, table.slot_mapping.gpu, self.max_model_len,
            self.executor.block_size, query_len,
        )
