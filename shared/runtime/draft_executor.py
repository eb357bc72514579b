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
from shared.runtime.cudagraph_utils import padded_size
from shared.runtime.model_executor import ModelExecutor
from shared.runtime.piecewise_graphs import PiecewiseGraphs


def draft_capture_sizes(config: Any) -> list[int]:
    """Piecewise graph sizes for the draft: the engine's capture sizes whenever CUDA graphs
    are on at all (the draft's forwards are small and many: graphs pay off most there)."""
    cc = config.compilation_config
    return [] if cc.cudagraph_mode == "NONE" else list(cc.cudagraph_capture_sizes)


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
    """The draft model's forwards, both runners: eager, or through piecewise CUDA graphs
    over persistent input buffers (the draft runs up to k + 1 small forwards per step, so
    on a GPU its launch overhead, not its weights, is most of its cost).

    A forward's inputs are copied into the persistent buffers and padded to the graph's
    size: ids / positions 0 and PAD slots past the real tokens (they write no KV, belong
    to no request in the metadata, and their rows are never read).
    """

    def __init__(self, executor: ModelExecutor, max_num_tokens: int, capture_sizes: list[int],
                 device: torch.device) -> None:
        self.executor = executor
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), PAD_SLOT_ID, dtype=torch.int64,
                                       device=device)
        self.capture_sizes = sorted(s for s in capture_sizes if s <= max_num_tokens)
        self.piecewise: PiecewiseGraphs | None = None

    def capture(self, pool: Any) -> None:
        """Piecewise graphs of the draft model (CUDA only; a pool shared with the target's
        graphs is fine: replays never overlap)."""
        if not self.capture_sizes or self.device.type != "cuda":
            return
        self.piecewise = PiecewiseGraphs(
            self.executor.model, self.capture_sizes, self.input_ids, self.positions,
            self.executor.dtype,
        )
        self.piecewise.capture(pool, "draft")

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 common: CommonAttentionMetadata) -> torch.Tensor:
        """ids int32 / positions int64 / slots int64 [n]; `common` describes the n real
        tokens (its slot_mapping is replaced). -> hidden states, rows [:n] valid."""
        n = ids.shape[0]
        size = n
        if self.piecewise is not None:
            size = padded_size(n, self.capture_sizes) or n
        if size > self.max_num_tokens:
            raise ValueError(f"draft forward of {n} tokens exceeds its {self.max_num_tokens}")
        self.input_ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slots)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(PAD_SLOT_ID)
        common = dataclasses.replace(common, slot_mapping=self.slot_mapping[:size])
        attn_metadata = self.executor.build_attn_metadata(common)
        if self.piecewise is not None and size in self.piecewise:
            hidden = self.executor.forward(
                self.input_ids[:size], self.positions[:size], attn_metadata, size,
                cudagraph_mode="PIECEWISE", run=self.piecewise.run,
            )
            return hidden[:n]  # the padded rows are garbage
        return self.executor.forward(self.input_ids[:n], self.positions[:n], attn_metadata, n)
