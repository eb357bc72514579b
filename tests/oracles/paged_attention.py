"""The paged KV-cache harnesses, on the TORCH backend (the pure-PyTorch oracle) wherever
a backend is not the thing under test.

`make_batch` lays out a step the way both runners do, for the attention tests (CPU and
GPU): rows in order, query_start_loc with its padded tail repeating the last value,
seq_lens 0 and block-table rows 0 past the real rows, slot_mapping PAD (-1) past the real
tokens, and block ids shuffled so no request's blocks are contiguous. The KV cache is
filled with random values for every context position (cached prefix and the new tokens
alike). `run_backend` runs one backend over such a batch.

`PagedHarness` steps a whole model through a paged KV cache (the model tests: against
transformers, the GGUF model, weights, fused ops, GEMVs, the piecewise split).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.attention.metadata import PAD_SLOT_ID, CommonAttentionMetadata
from shared.attention.torch_backend import TorchBackend
from shared.runtime.forward_context import set_forward_context


@dataclass
class Batch:
    common: CommonAttentionMetadata
    query: torch.Tensor  # [T_padded, H, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    num_actual_tokens: int


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    pad_reqs: int = 0,
    pad_tokens: int = 0,
    seed: int = 0,
    extra_table_cols: int = 1,
) -> Batch:
    assert len(query_lens) == len(seq_lens)
    assert all(0 <= q <= s for q, s in zip(query_lens, seq_lens))
    rng = np.random.default_rng(seed)
    num_reqs = len(query_lens)
    blocks_per_req = [(s + block_size - 1) // block_size for s in seq_lens]
    width = max(blocks_per_req + [1]) + extra_table_cols
    num_blocks = sum(blocks_per_req) + 3  # spare blocks stay random: never read
    ids = rng.permutation(num_blocks).astype(np.int32)
    table = np.zeros((num_reqs + pad_reqs, width), np.int32)
    pos = 0
    for r, n in enumerate(blocks_per_req):
        table[r, :n] = ids[pos: pos + n]
        pos += n
    qsl = np.zeros(num_reqs + pad_reqs + 1, np.int32)
    qsl[1: num_reqs + 1] = np.cumsum(query_lens)
    qsl[num_reqs + 1:] = qsl[num_reqs]  # padded tail repeats the last real value
    sl = np.zeros(num_reqs + pad_reqs, np.int32)
    sl[:num_reqs] = seq_lens
    num_actual = int(qsl[num_reqs])
    rows = np.repeat(np.arange(num_reqs), query_lens)
    positions = np.concatenate(
        [np.arange(s - q, s) for q, s in zip(query_lens, seq_lens)] + [np.zeros(0, np.int64)]
    )
    slots = np.full(num_actual + pad_tokens, PAD_SLOT_ID, np.int64)
    slots[:num_actual] = table[rows, positions // block_size] * block_size + positions % block_size

    dev = torch.device(device)
    # Random values drawn on the target device (GPU tests use caches of gigabytes).
    gen = torch.Generator(device=dev).manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen, device=dev).to(dtype)
    value_cache = torch.randn(shape, generator=gen, device=dev).to(dtype)
    query = torch.randn(
        (num_actual + pad_tokens, num_heads, head_dim), generator=gen, device=dev
    ).to(dtype)
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl).to(dev),
        seq_lens=torch.from_numpy(sl).to(dev),
        block_table=torch.from_numpy(table).to(dev),
        slot_mapping=torch.from_numpy(slots).to(dev),
        num_reqs=num_reqs,
        num_actual_tokens=num_actual,
        max_query_len=max(query_lens + [0]),
        max_seq_len=max(seq_lens + [0]),
        num_decodes=sum(1 for q in query_lens if q == 1),
        num_prefills=sum(1 for q in query_lens if q != 1),
        num_decode_tokens=sum(1 for q in query_lens if q == 1),
        block_size=block_size,
        query_start_loc_cpu=torch.from_numpy(qsl),
        seq_lens_cpu=torch.from_numpy(sl),
    )
    return Batch(common, query, key_cache, value_cache, num_actual)


def run_backend(backend, batch: Batch, num_heads, head_dim, num_kv_heads, poison=float("nan")):
    """Run one backend; the output buffer starts poisoned so unwritten rows show."""
    scale = head_dim**-0.5
    impl = backend.make_impl(num_heads, head_dim, num_kv_heads, scale)
    metadata = backend.make_builder(batch.query.device).build(batch.common)
    output = torch.full_like(batch.query, poison)
    impl.forward(batch.query, batch.key_cache, batch.value_cache, metadata, output)
    return output


class PagedHarness:
    """Binds a TORCH backend and a KV cache to every attention layer of `model`, and runs
    steps of (token chunk, start position, block ids) rows, decodes first."""

    def __init__(self, model, num_blocks: int = 16, block_size: int = 4):
        self.model = model
        self.block_size = block_size
        self.layers = model.attention_layers()
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        self.device = device
        for layer in self.layers.values():
            layer.bind_backend(TorchBackend())
            shape = (2, num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.bind_kv_cache(torch.zeros(shape, dtype=dtype, device=device))

    def metadata(self, rows: list[tuple[list[int], int, list[int]]]) -> CommonAttentionMetadata:
        bs = self.block_size
        q_lens = [len(tokens) for tokens, _, _ in rows]
        seq_lens = [start + n for (_, start, _), n in zip(rows, q_lens)]
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        width = max(len(blocks) for _, _, blocks in rows)
        table = [blocks + [0] * (width - len(blocks)) for _, _, blocks in rows]
        slots = [
            blocks[p // bs] * bs + p % bs
            for (_, start, blocks), n in zip(rows, q_lens)
            for p in range(start, start + n)
        ]
        num_decodes = sum(1 for n in q_lens if n == 1)
        assert q_lens[:num_decodes] == [1] * num_decodes, "decode rows must come first"
        dev = self.device
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        seq_t = torch.tensor(seq_lens, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl_t.to(dev),
            seq_lens=seq_t.to(dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_reqs=len(rows),
            num_actual_tokens=qsl[-1],
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            num_prefills=len(rows) - num_decodes,
            num_decode_tokens=num_decodes,
            block_size=bs,
            query_start_loc_cpu=qsl_t,
            seq_lens_cpu=seq_t,
        )

    @torch.no_grad()
    def step(self, rows: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """-> logits [T, vocab] for every scheduled token, in row order."""
        return self.model.compute_logits(self.hidden(rows))

    @torch.no_grad()
    def hidden(
        self, rows: list[tuple[list[int], int, list[int]]], piecewise: bool = False
    ) -> torch.Tensor:
        """-> final hidden states [T, hidden] for every scheduled token, in row order
        (through forward_piecewise_eager when `piecewise`)."""
        common = self.metadata(rows)
        md = TorchBackend().make_builder(self.device).build(common)
        ids = torch.tensor([t for tokens, _, _ in rows for t in tokens], device=self.device)
        positions = torch.tensor(
            [p for tokens, start, _ in rows for p in range(start, start + len(tokens))],
            dtype=torch.int64,
            device=self.device,
        )
        forward = self.model.forward_piecewise_eager if piecewise else self.model
        with set_forward_context(md, list(self.layers), ids.shape[0]):
            return forward(ids, positions)
