"""V1's implicit CUDA graphs: a dispatcher picks (mode, batch descriptor) per step, the
mode travels in the forward context, and a wrapper around the model replays.

FULL graphs cover uniform-decode batches (every request decodes one token), captured
per capture size with the whole forward, attention included. Mixed batches run eager
(piecewise graphs between attention calls are not implemented: an explicit
cudagraph_mode=PIECEWISE is refused at start-up rather than silently ignored).

Padding: a batch of n decodes runs the graph of the smallest capture size B >= n. The
rows n..B-1 are neutralised by input prep every step — query_start_loc repeats its
last value, seq_lens are 0, block-table rows are 0, slot mapping is PAD — so a stale
row from an earlier, larger batch can neither be read nor written.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shared.attention.metadata import CommonAttentionMetadata
from shared.cudagraph_utils import (
    BatchDescriptor,
    fill_dummy_decode,
    is_uniform_decode,
    padded_size,
)
from shared.forward_context import get_forward_context

logger = logging.getLogger("runnerlab")


@dataclass(frozen=True)
class StepPlan:
    mode: str  # "FULL" | "NONE"
    num_tokens_padded: int
    num_reqs_padded: int
    descriptor: BatchDescriptor | None


class CudaGraphWrapper:
    """Wraps the model's forward. Reads the mode from the forward context: FULL with a
    captured descriptor replays; anything else runs the model."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.graphs: dict[BatchDescriptor, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        desc = None if ctx is None else ctx.batch_descriptor
        if ctx is not None and ctx.cudagraph_mode == "FULL" and desc in self.graphs:
            graph, output = self.graphs[desc]
            graph.replay()
            return output
        return self.model(input_ids, positions)

    def capture(self, desc: BatchDescriptor, prepare: Any, run: Any) -> None:
        """`prepare()` fills the persistent buffers (outside the graph); `run(metadata)`
        is the forward that gets captured."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        run(prepare())  # eager warm-up: Triton JIT and allocator state outside the capture
        torch.cuda.synchronize()
        metadata = prepare()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = run(metadata)
        self.graphs[desc] = (graph, output)


class V1CudaGraphs:
    def __init__(self, config: Any, device: torch.device, executor, buffers, input_batch):
        cc = config.compilation_config
        self.mode = cc.cudagraph_mode  # resolved by policy: NONE on CPU / enforce_eager
        self.capture_sizes = sorted(
            s for s in cc.cudagraph_capture_sizes if s <= config.scheduler_config.max_num_seqs
        )
        # The TORCH oracle reads lengths on the host: it cannot run inside a graph.
        self.enabled = (
            device.type == "cuda" and self.mode != "NONE" and bool(self.capture_sizes)
            and executor.backend.name != "TORCH"
        )
        self.device = device
        self.executor = executor
        self.buffers = buffers
        self.input_batch = input_batch
        self.wrapper: CudaGraphWrapper | None = None
        self.max_model_len = config.scheduler_config.max_model_len
        requested = cc.cudagraph_mode_requested
        if self.enabled and requested in ("PIECEWISE", "FULL_AND_PIECEWISE"):
            # Asked for by name, it would be (partly) ignored: refuse rather than no-op.
            raise ValueError(
                f"cudagraph_mode={requested!r}: runnerlab's V1 runner does not implement "
                "piecewise graphs yet (mixed batches would run eager); use cudagraph_mode="
                "'FULL' (uniform-decode graphs), 'auto' or 'NONE'"
            )
        if self.enabled and self.mode == "FULL_AND_PIECEWISE":
            logger.warning(
                "V1 cudagraph_mode=FULL_AND_PIECEWISE (auto): FULL graphs cover uniform "
                "decode; piecewise graphs are not implemented yet, so mixed batches run eager"
            )

    # ---- dispatch -----------------------------------------------------------------------
    def dispatch(self, num_scheduled: np.ndarray) -> StepPlan:
        num_reqs = int(num_scheduled.shape[0])
        num_tokens = int(num_scheduled.sum())
        if self.enabled and self.wrapper is not None:
            max_query_len = int(num_scheduled.max())
            if is_uniform_decode(max_query_len, num_tokens, num_reqs):
                size = padded_size(num_reqs, self.capture_sizes)
                if size is not None:
                    return StepPlan("FULL", size, size, BatchDescriptor("FULL", size, size))
        return StepPlan("NONE", num_tokens, num_reqs, None)

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
        self.wrapper = CudaGraphWrapper(model)
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        for size in sorted(self.capture_sizes, reverse=True):  # largest first: pool reuse
            desc = BatchDescriptor("FULL", size, size)
            self.wrapper.capture(
                desc, lambda s=size: self._fill_dummy_inputs(s),
                lambda common, s=size: self._captured_forward(s, common),
            )
        # From now on the executor's model call goes through the wrapper.
        self.executor.model_call = self.wrapper
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info(
            "V1 captured %d FULL graphs (sizes %d..%d) in %.2f s, %.1f MB of graph memory",
            len(self.capture_sizes), self.capture_sizes[0], self.capture_sizes[-1],
            time.perf_counter() - start, used / 1e6,
        )

    def _captured_forward(self, size: int, common: CommonAttentionMetadata) -> torch.Tensor:
        """A uniform decode of `size` rows over the persistent buffers. Only this part is
        captured (metadata build + forward): the buffer set-up stays OUTSIDE the graph,
        or every replay would reset the step's real inputs to the dummy batch."""
        attn_metadata = self.executor.build_attn_metadata(common)
        b = self.buffers
        return self.executor.forward(
            b.input_ids.gpu[:size], b.positions.gpu[:size], attn_metadata, size,
            cudagraph_mode="FULL", batch_descriptor=None,  # None: run, do not replay
        )

    def _fill_dummy_inputs(self, size: int) -> CommonAttentionMetadata:
        """Called before (not inside) each capture; see fill_dummy_decode."""
        b, table = self.buffers, self.input_batch.block_table
        return fill_dummy_decode(
            size, b.input_ids.gpu, b.positions.gpu, b.query_start_loc.gpu, b.seq_lens.gpu,
            table.block_table.gpu, table.slot_mapping.gpu, self.max_model_len,
            self.executor.block_size,
        )
