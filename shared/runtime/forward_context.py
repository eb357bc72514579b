"""The forward context: per-step data that attention layers read without it being
threaded through `forward(input_ids, positions)`.

A contextvar rather than a module global, so nested or concurrent forwards (a capture
inside a warm-up, a test inside a test) each see their own context.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ForwardContext:
    # layer name -> the backend's metadata for this step. Every layer maps to the same
    # object: the builder runs once per step and the result is fanned out.
    attn_metadata: dict[str, Any] | None
    # tokens the forward runs over, padding included (the captured size under graphs)
    num_tokens: int
    # "NONE" | "PIECEWISE" | "FULL": how V1's implicit dispatcher wants this step run
    # (V1's wrapper acts on it; V2 dispatches explicitly and sets it for the record)
    cudagraph_mode: str = "NONE"
    batch_descriptor: Any = None


_FORWARD_CONTEXT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "runnerlab_forward_context", default=None
)


def get_forward_context() -> ForwardContext | None:
    return _FORWARD_CONTEXT.get()


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: Any,
    layer_names: list[str] | None,
    num_tokens: int,
    cudagraph_mode: str = "NONE",
    batch_descriptor: Any = None,
) -> Iterator[ForwardContext]:
    """Install a context for one forward. `attn_metadata` is a single backend metadata
    object fanned out to `layer_names`, or already a dict keyed by layer name, or None
    (a run that must not touch the KV cache)."""
    if attn_metadata is not None and not isinstance(attn_metadata, dict):
        assert layer_names is not None, "layer_names are needed to fan out metadata"
        attn_metadata = dict.fromkeys(layer_names, attn_metadata)
    ctx = ForwardContext(attn_metadata, num_tokens, cudagraph_mode, batch_descriptor)
    token = _FORWARD_CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _FORWARD_CONTEXT.reset(token)
