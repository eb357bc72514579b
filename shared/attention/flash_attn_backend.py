"""FLASH_ATTN backend: flash-attn 2's kernels reading the paged cache through block_table.

Used only when `import flash_attn` works (it needs CUDA and a compiled wheel). Two
documented flash-attn entry points:
- uniform-decode batches: `flash_attn_with_kvcache(q [R, 1, H, D], k_cache, v_cache,
  cache_seqlens=seq_lens, block_table=...)`. It reads nothing but the persistent
  seq_lens / block_table buffers, so a CUDA graph captured on it replays correctly;
- any other batch: `flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q,
  cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, block_table=...)`, whose
  bottom-right causal alignment is exactly "query j sits at position S - q + j".
  It takes per-step host ints (max lengths), so it runs eagerly (or between graph pieces).

Limits of upstream flash-attn 2: fp16/bf16 only, and a paged cache block size that is a
multiple of 256 (the kernel refuses anything else). Both are reported as clear errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.attention.backend import AttentionBackend
from shared.attention.metadata import CommonAttentionMetadata
from shared.attention.selector import AttentionBackendError

FLASH_ATTN_BLOCK_MULTIPLE = 256


def _import_flash_attn():
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError as e:
        raise AttentionBackendError(
            "attention_backend='FLASH_ATTN' needs the flash-attn package, which is not "
            f"installed or does not load here ({e}). Install it on a machine with a CUDA "
            "GPU and toolkit: `pip install flash-attn --no-build-isolation` (it builds "
            "against the installed torch). Alternatives that need nothing extra: "
            "attention_backend='TRITON' (the GPU default) or 'TORCH' (pure PyTorch, CPU "
            "and GPU)."
        ) from e
    return flash_attn_varlen_func, flash_attn_with_kvcache


@dataclass
class FlashAttnMetadata:
    common: CommonAttentionMetadata
    query_start_loc: torch.Tensor  # int32 [R + 1] = cu_seqlens_q
    cu_seqlens_k: torch.Tensor  # int32 [R + 1], built on the device (no sync)
    seq_lens: torch.Tensor  # int32 [R] = cache_seqlens of the decode path
    block_table: torch.Tensor  # int32 [R, max_blocks_per_req]
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    uniform_decode: bool  # max_query_len == 1: the graph-capturable kvcache path


class FlashAttnMetadataBuilder:
    def build(self, common: CommonAttentionMetadata) -> FlashAttnMetadata:
        if common.block_size % FLASH_ATTN_BLOCK_MULTIPLE != 0:
            raise AttentionBackendError(
                f"attention_backend='FLASH_ATTN' needs block_size to be a multiple of "
                f"{FLASH_ATTN_BLOCK_MULTIPLE} (flash-attn's paged KV refuses others); got "
                f"block_size={common.block_size}. Use block_size=256, or attention_backend="
                "'TRITON' / 'TORCH', which take any block size."
            )
        seq_lens = common.seq_lens
        cu_seqlens_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, dim=0, dtype=torch.int32, out=cu_seqlens_k[1:])
        return FlashAttnMetadata(
            common=common,
            query_start_loc=common.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            seq_lens=seq_lens,
            block_table=common.block_table,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            num_actual_tokens=common.num_actual_tokens,
            uniform_decode=common.max_query_len == 1,
        )


class FlashAttnImpl:
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float):
        assert num_heads % num_kv_heads == 0, "GQA needs num_heads % num_kv_heads == 0"
        self.varlen_func, self.kvcache_func = _import_flash_attn()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale

    def forward(self, query, key_cache, value_cache, metadata: FlashAttnMetadata, output) -> None:
        if query.dtype not in (torch.float16, torch.bfloat16):
            raise AttentionBackendError(
                f"attention_backend='FLASH_ATTN' supports float16/bfloat16 only, got "
                f"{query.dtype}; use attention_backend='TRITON' or 'TORCH' for it."
            )
        num_reqs = metadata.seq_lens.shape[0]
        if metadata.uniform_decode and query.shape[0] == num_reqs:
            # One query token per row (padded rows included): write every row. A padded
            # row has cache_seqlens 0, for which flash-attn writes zeros, never NaN; the
            # whole buffer is written because a replayed graph cannot know how many rows
            # are real.
            out = self.kvcache_func(
                query.unsqueeze(1), key_cache, value_cache,
                cache_seqlens=metadata.seq_lens, block_table=metadata.block_table,
                softmax_scale=self.scale, causal=True,
            )
            output.copy_(out.squeeze(1))
            return
        n = metadata.num_actual_tokens
        if n == 0:
            return
        out = self.varlen_func(
            query, key_cache, value_cache,
            cu_seqlens_q=metadata.query_start_loc, cu_seqlens_k=metadata.cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len, max_seqlen_k=metadata.max_seq_len,
            softmax_scale=self.scale, causal=True, block_table=metadata.block_table,
        )
        # Rows past the real tokens are not produced by the kernel: leave them alone.
        output[:n].copy_(out[:n])


class FlashAttnBackend(AttentionBackend):
    name = "FLASH_ATTN"
    supports_full_cudagraph = True

    def __init__(self) -> None:
        _import_flash_attn()  # fail at selection time, with the install advice

    def make_builder(self, device: torch.device) -> FlashAttnMetadataBuilder:
        return FlashAttnMetadataBuilder()

    def make_impl(self, num_heads, head_dim, num_kv_heads, scale) -> FlashAttnImpl:
        return FlashAttnImpl(num_heads, head_dim, num_kv_heads, scale)
