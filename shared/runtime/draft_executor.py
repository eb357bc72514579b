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

from shared.runtime.model_executor import ModelExecutor


def make_draft_executor(config: Any, draft_model_config: Any, device: torch.device) -> ModelExecutor:
    """A ModelExecutor for the draft model: the engine's configuration with the draft's
    model config (dtype, attention backend, block size, limits and seed carry over)."""
    draft_config = dataclasses.replace(config, model_config=draft_model_config)
    return ModelExecutor(draft_config, device)
