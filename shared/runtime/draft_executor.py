"""The draft model of `speculative_config.method == "draft_model"`: a second
ModelExecutor (its own weights and attention layers) whose KV cache has the target's
block layout, so a request's draft KV lives in the same block ids and slots as its target
KV and one block table (and one allocation by the scheduler) serves both.

Why the same blocks: the scheduler then needs no second allocator, and a prefix-cache hit
is a hit for the draft too: the draft writes every token's KV (its catch-up forward feeds
each appended token) no later than the target does, so a block the prefix cache has
registered holds valid draft KV as well.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from shared.attention.metadata import PAD_SLOT_ID, CommonAttentionMetadata
from shared.runtime.cudagraph_utils import BatchDescriptor
from shared.runtime.draft_graphs import DraftFullGraphs, DraftGraphConfig, dispatch_draft
from shared.runtime.model_executor import ModelExecutor
from shared.runtime.piecewise_graphs import PiecewiseGraphs


def make_draft_executor(config: Any, draft_model_config: Any, device: torch.device) -> ModelExecutor:
    """A ModelExecutor for the draft model: the engine's configuration with the draft's
    model config and weight source (dtype, attention backend, block size, limits and seed
    carry over: a random-weights draft is seeded like the target)."""
    spec = config.speculative_config
    source = getattr(spec, "draft_weight_source", None) or config.load_config.weight_source
    load_config = config.load_config.model_copy(update={"weight_source": source})
    draft_config = dataclasses.replace(
        config, model_config=draft_model_config, load_config=load_config)
    return ModelExecutor(draft_config, device)


class DraftForward:
    """The draft model's forwards, both runners: a FULL graph for a uniform forward (every
    request the same query length, shared/runtime/draft_graphs.py), piecewise CUDA graphs
    for the others, eager without graphs (on a GPU the draft's launch overhead, not its
    weights, is most of its cost: it runs up to k + 1 small forwards per step).

    A forward's inputs are copied into the persistent buffers (unless the caller wrote
    them there: a view of the buffer is not copied) and padded to the graph's size: ids /
    positions 0 and PAD slots past the real tokens (they write no KV, belong to no request
    in the metadata, and their rows are never read). `counts` tallies the forwards by the
    mode they ran in ("full", "piecewise", "eager").
    """

    def __init__(self, executor: ModelExecutor, max_num_tokens: int, graphs: DraftGraphConfig,
                 device: torch.device) -> None:
        self.executor = executor
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), PAD_SLOT_ID, dtype=torch.int64,
                                       device=device)
        self.graph_config = graphs
        self.capture_sizes = sorted(s for s in graphs.piecewise_sizes if s <= max_num_tokens)
        self.piecewise: PiecewiseGraphs | None = None
        # the FULL graphs' persistent metadata exists from the start: a proposer may write
        # the step's seq_lens / block-table rows there in place
        self.full = (DraftFullGraphs(executor, graphs.full_sizes, self.input_ids, self.positions,
                                     self.slot_mapping) if graphs.full_sizes else None)
        self.captured = False  # dispatch picks graphs only once they exist
        self.counts = {"full": 0, "piecewise": 0, "eager": 0}

    def capture(self, pool: Any) -> None:
        """The draft's graphs (a pool shared with the target's graphs is fine: replays
        never overlap). FULL first: its graphs keep their outputs alive in the pool, so no
        later capture places scratch memory over them."""
        if not self.graph_config.enabled:
            return
        if self.full is not None:
            self.full.capture(pool)
        if self.capture_sizes:
            self.piecewise = PiecewiseGraphs(
                self.executor.model, self.capture_sizes, self.input_ids, self.positions,
                self.slot_mapping, self.executor.dtype,
            )
            self.piecewise.capture(pool, "draft")
        self.captured = True

    def plan(self, num_reqs: int, num_tokens: int, max_query_len: int) -> BatchDescriptor | None:
        """The graph a forward of this shape runs (dispatch_draft over what is captured)."""
        if not self.captured:
            return None
        return dispatch_draft(
            num_reqs, num_tokens, max_query_len,
            self.full.full_sizes if self.full is not None and self.full.graphs else {},
            self.capture_sizes if self.piecewise is not None else [],
        )

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 common: CommonAttentionMetadata) -> torch.Tensor:
        """ids int32 / positions int64 / slots int64 [n]; `common` describes the n real
        tokens (its slot_mapping is replaced). -> hidden states [n, hidden]."""
        n = ids.shape[0]
        desc = self.plan(common.num_reqs, n, common.max_query_len)
        size = n if desc is None else desc.num_tokens
        if size > self.max_num_tokens:
            raise ValueError(f"draft forward of {n} tokens exceeds its {self.max_num_tokens}")
        _copy_into(self.input_ids, ids, n)
        _copy_into(self.positions, positions, n)
        _copy_into(self.slot_mapping, slots, n)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(PAD_SLOT_ID)
        if desc is not None and desc.mode == "FULL":
            self.counts["full"] += 1
            self.full.stage(desc, common)
            return self.full.replay(desc)[:n]  # the padded rows are garbage
        common = dataclasses.replace(common, slot_mapping=self.slot_mapping[:size])
        attn_metadata = self.executor.build_attn_metadata(common)
        if desc is not None:
            self.counts["piecewise"] += 1
            hidden = self.executor.forward(
                self.input_ids[:size], self.positions[:size], attn_metadata, size,
                cudagraph_mode="PIECEWISE", run=self.piecewise.run,
            )
            return hidden[:n]
        self.counts["eager"] += 1
        return self.executor.forward(self.input_ids[:n], self.positions[:n], attn_metadata, n)


def _copy_into(dst: torch.Tensor, src: torch.Tensor, n: int) -> None:
    """dst[:n] = src, unless src already is that view (the caller wrote it in place)."""
    if src.data_ptr() != dst.data_ptr():
        dst[:n].copy_(src)
