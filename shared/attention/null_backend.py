"""NULL: an attention backend that does nothing, for benchmarks only.

A step run with it launches no attention or KV-write kernel: its time, against the same
step with TRITON, is the attention's share (scripts/bench_decode.py's "noattn" rows). The
layer's output is left unwritten (uninitialised memory), so the tokens are meaningless;
the backend is never chosen by "auto" and the selector warns when it is named.
"""

from __future__ import annotations

from typing import Any

import torch

from shared.attention.backend import AttentionBackend
from shared.attention.metadata import CommonAttentionMetadata


class NullMetadataBuilder:
    def build(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        return common  # the layer reads slot_mapping through `getattr(m, "common", m)`


class NullImpl:
    def fuses_kv_write(self, metadata: Any) -> bool:
        return True  # the layer then calls forward_with_kv_write: no KV-write kernel either

    def forward_with_kv_write(self, query, key, value, key_cache, value_cache, metadata,
                              output: torch.Tensor) -> None:
        return None

    def forward(self, query, key_cache, value_cache, metadata, output: torch.Tensor) -> None:
        return None


class NullBackend(AttentionBackend):
    name = "NULL"
    supports_full_cudagraph = True  # nothing to capture but the layer's empty output

    def make_builder(self, device: torch.device) -> NullMetadataBuilder:
        return NullMetadataBuilder()

    def make_impl(self, num_heads: int, head_dim: int, num_kv_heads: int,
                  scale: float) -> NullImpl:
        return NullImpl()
