"""Paged attention: the per-step metadata, the KV write, and the backends."""

from shared.attention.metadata import PAD_SLOT_ID, CommonAttentionMetadata

__all__ = ["PAD_SLOT_ID", "CommonAttentionMetadata"]
