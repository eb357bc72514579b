"""TORCH backend: plain PyTorch over the paged cache, one request at a time.

It is the oracle the other backends are tested against: obviously correct, slow, and
it syncs (it reads lengths on the host). Works on CPU and GPU in any float dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.attention.backend import AttentionBackend
from shared.attention.metadata import CommonAttentionMetadata


@dataclass
class TorchAttentionMetadata:
    common: CommonAttentionMetadata
    query_start_loc: list[int]  # host copy, real rows only (+1)
    seq_lens: list[int]


class TorchMetadataBuilder:
    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        qsl = common.query_start_loc_cpu
        sl = common.seq_lens_cpu
        if qsl is None:
            qsl = common.query_start_loc.cpu()
        if sl is None:
            sl = common.seq_lens.cpu()
        n = common.num_reqs
        return TorchAttentionMetadata(common, qsl[: n + 1].tolist(), sl[:n].tolist())


class TorchAttentionImpl:
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float):
        assert num_heads % num_kv_heads == 0, "GQA needs num_heads % num_kv_heads == 0"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, query, key_cache, value_cache, metadata, output) -> None:
        common = metadata.common
        block_size = key_cache.shape[1]
        group = self.num_heads // self.num_kv_heads
        for i, seq_len in enumerate(metadata.seq_lens):
            q_start, q_end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
            q_len = q_end - q_start
            if q_len == 0 or seq_len == 0:
                continue
            num_blocks = (seq_len + block_size - 1) // block_size
            blocks = common.block_table[i, :num_blocks].long()
            # gather this request's context: [seq_len, Hkv, D]
            k = key_cache[blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            v = value_cache[blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            q = query[q_start:q_end]  # [q_len, H, D]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
            scores = torch.einsum("qhd,khd->hqk", q.to(compute), k.to(compute)) * self.scale
            # query j sits at absolute position (seq_len - q_len + j): it sees keys <= that.
            # This offset is what makes chunked prefill and prefix-cache hits correct.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] > q_pos[:, None]
            scores.masked_fill_(mask[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out = torch.einsum("hqk,khd->qhd", probs, v.to(compute))
            output[q_start:q_end] = out.to(output.dtype)


class TorchBackend(AttentionBackend):
    name = "TORCH"
    supports_full_cudagraph = False  # reads lengths on the host

    def make_builder(self, device: torch.device) -> TorchMetadataBuilder:
        return TorchMetadataBuilder()

    def make_impl(self, num_heads, head_dim, num_kv_heads, scale) -> TorchAttentionImpl:
        return TorchAttentionImpl(num_heads, head_dim, num_kv_heads, scale)
