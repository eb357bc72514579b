"""The small interface every attention backend implements.

A backend is a builder (turns CommonAttentionMetadata into its own metadata, once per
step) plus an impl (runs attention for one layer over the paged cache). The KV write
is shared by all backends (shared.attention.kv_write) and happens in the layer, except
where an impl offers `fuses_kv_write(metadata) -> bool` and it says yes for the step:
then the layer calls `forward_with_kv_write(query, key, value, key_cache, value_cache,
metadata, output)` instead, which must leave the cache as write_kv would (TRITON does
this for uniform-decode batches).

What a backend can do is declared on its class (`supports_full_cudagraph`); the runners
read those flags, never the backend's name.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch

from shared.attention.metadata import CommonAttentionMetadata


class AttentionMetadataBuilder(Protocol):
    def build(self, common: CommonAttentionMetadata) -> Any: ...


class AttentionImpl(Protocol):
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: Any,
        output: torch.Tensor,  # [T, num_heads, head_dim], written for real tokens
    ) -> None: ...


class AttentionBackend:
    """Base class: subclasses set `name`, declare their capabilities and implement the
    two factories."""

    name: ClassVar[str]
    # The metadata build and the forward can be captured inside a FULL CUDA graph: they
    # read no lengths on the host (a sync, and values a replay would not refresh). PIECEWISE
    # graphs run attention eagerly between the pieces, so every backend can serve them.
    supports_full_cudagraph: ClassVar[bool]

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def make_builder(self, device: torch.device) -> AttentionMetadataBuilder:
        raise NotImplementedError

    def make_impl(
        self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float
    ) -> AttentionImpl:
        raise NotImplementedError
