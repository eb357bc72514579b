"""Pooling: what a pooling request returns, built from the final hidden states of its
prompt, chunk by chunk (both runners call this with the chunks their step computed).

A prompt may reach the runner in several chunks (chunked prefill), so the pooler keeps,
per request, only what its pooling type needs until the last chunk: nothing for LAST
(the last chunk holds the last token), the first token's state for CLS, a running sum
for MEAN (in float64 for float64 models, float32 otherwise), every chunk for ALL (the
token tasks). A request that leaves before its last chunk (abort, preemption) is
dropped; a preempted request starts again from its first token (pooling requests take
no prefix-cache hits, shared/serving/block_manager.py), so nothing stale is reused.

Post-processing, on the pooled state: the sequence or token classification head of the
model (`pooler_head`) for the classify tasks, then softmax when use_activation (sigmoid
for a one-label head); L2
normalisation for the embed tasks when normalize.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Partial:
    first: torch.Tensor | None = None  # CLS
    total: torch.Tensor | None = None  # MEAN
    count: int = 0
    chunks: list[torch.Tensor] | None = None  # ALL


class PromptPooler:
    """One per runner. `settings` is the engine's resolved PoolerSettings
    (policy/pooling.py): pooling_type, normalize, use_activation, head."""

    def __init__(self, settings: Any, model: torch.nn.Module) -> None:
        self.settings = settings
        self.model = model
        self._partial: dict[str, _Partial] = {}
        self._params: dict[str, Any] = {}  # req_id -> its PoolingParams (overrides)

    def add_request(self, req_id: str, params: Any) -> None:
        """A request enters (new or resumed); its PoolingParams may override normalize
        and use_activation. Any partial state of an earlier submission is dropped."""
        self._partial.pop(req_id, None)
        self._params[req_id] = params

    def drop(self, req_id: str) -> None:
        self._partial.pop(req_id, None)
        self._params.pop(req_id, None)

    def clear(self) -> None:
        self._partial.clear()
        self._params.clear()

    def add_chunk(self, req_id: str, hidden: torch.Tensor, start: int,
                  prompt_len: int) -> torch.Tensor | None:
        """hidden [n, H]: the final hidden states of prompt positions [start, start + n).
        Returns the request's output once the chunk reaches the prompt's end, else None."""
        kind = self.settings.pooling_type
        end = start + hidden.shape[0]
        part = self._partial.setdefault(req_id, _Partial())
        # clones: `hidden` may be a graph's static output buffer, rewritten next step
        if kind == "CLS" and start == 0:
            part.first = hidden[0].clone()
        elif kind == "MEAN":
            acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
            chunk_sum = hidden.to(acc).sum(dim=0)
            part.total = chunk_sum if part.total is None else part.total + chunk_sum
            part.count += hidden.shape[0]
        elif kind == "ALL":
            part.chunks = (part.chunks or []) + [hidden.clone()]
        if end < prompt_len:
            return None
        del self._partial[req_id]
        params = self._params.pop(req_id, None)
        if kind == "LAST":
            pooled = hidden[-1].clone()
        elif kind == "CLS":
            pooled = part.first
        elif kind == "MEAN":
            pooled = (part.total / part.count).to(hidden.dtype)
        else:
            pooled = torch.cat(part.chunks, dim=0)
        return self._post(pooled, params)

    def _post(self, pooled: torch.Tensor, params: Any) -> torch.Tensor:
        s = self.settings

        def option(name: str) -> bool:
            value = None if params is None else getattr(params, name, None)
            return getattr(s, name) if value is None else value

        if s.head != "hidden":
            rows = pooled if pooled.dim() == 2 else pooled[None]
            out = self.model.pooler_head(rows)
            out = out if pooled.dim() == 2 else out[0]
            if option("use_activation"):
                # softmax over the labels; one label (a cross-encoder's score): sigmoid
                wide = out.to(torch.float64 if out.dtype == torch.float64 else torch.float32)
                act = torch.sigmoid(wide) if out.shape[-1] == 1 else torch.softmax(wide, dim=-1)
                out = act.to(out.dtype)
            return out
        if option("normalize"):
            norm = pooled.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            return pooled / norm
        return pooled
