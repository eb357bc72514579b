"""The attention layer the model calls: KV write, then the selected backend's impl (or
both in one call, where the impl fuses them for this batch)."""

from __future__ import annotations

import torch
from torch import nn

from shared.attention.kv_write import write_kv
from shared.runtime.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention for one decoder layer.

    q, k, v come in flat ([T, H*D]); metadata comes from the forward context keyed by
    `layer_name`; the cache tensor is bound by `bind_kv_cache` when the engine allocates it.
    """

    def __init__(
        self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, layer_name: str
    ):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_name = layer_name
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, Hkv, D]
        self.impl = None  # set by bind_backend

    def bind_backend(self, backend) -> None:
        self.impl = backend.make_impl(self.num_heads, self.head_dim, self.num_kv_heads, self.scale)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens = q.shape[0]
        query = q.view(num_tokens, self.num_heads, self.head_dim)
        output = torch.empty_like(query)
        metadata = self._metadata()
        if metadata is None or self.kv_cache is None:
            # A run without metadata (memory profiling, warm-up) touches no cache.
            output.zero_()
            return output.view(num_tokens, -1)
        key = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        common = getattr(metadata, "common", metadata)
        key_cache, value_cache = self.kv_cache[0], self.kv_cache[1]
        fuses = getattr(self.impl, "fuses_kv_write", None)
        if fuses is not None and fuses(metadata):  # one kernel: see backend.py
            self.impl.forward_with_kv_write(query, key, value, key_cache, value_cache,
                                            metadata, output)
        else:
            write_kv(key, value, key_cache, value_cache, common.slot_mapping)
            self.impl.forward(query, key_cache, value_cache, metadata, output)
        return output.view(num_tokens, -1)

    # ---- the two halves of forward, for the piecewise graphs -----------------------------
    # The KV write only reads per-token inputs and the slot mapping, so a piecewise graph
    # records it at the end of the segment that computes k and v (slot_mapping is then the
    # runner's persistent buffer); attention reads the batch layout and runs eagerly.
    def write_new_kv(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store k, v [T, Hkv*D] at slot_mapping [>= T] (PAD slots skipped)."""
        if self.kv_cache is None:
            raise RuntimeError(f"{self.layer_name}: the KV cache is not bound yet")
        num_tokens = k.shape[0]
        write_kv(k.view(num_tokens, self.num_kv_heads, self.head_dim),
                 v.view(num_tokens, self.num_kv_heads, self.head_dim),
                 self.kv_cache[0], self.kv_cache[1], slot_mapping)

    def attend(self, q: torch.Tensor, output: torch.Tensor) -> None:
        """Attention of q [T, H*D] over the cache, whose new K/V write_new_kv already
        stored, into output [T, H*D]. Never the fused write-and-attend kernel (the write
        is done); rows of tokens outside the metadata's requests are left unwritten."""
        metadata = self._metadata()
        num_tokens = q.shape[0]
        out = output.view(num_tokens, self.num_heads, self.head_dim)
        if metadata is None or self.kv_cache is None:
            out.zero_()
            return
        self.impl.forward(q.view(num_tokens, self.num_heads, self.head_dim),
                          self.kv_cache[0], self.kv_cache[1], metadata, out)

    def _metadata(self):
        ctx = get_forward_context()
        if ctx is None or ctx.attn_metadata is None:
            return None
        return ctx.attn_metadata[self.layer_name]
