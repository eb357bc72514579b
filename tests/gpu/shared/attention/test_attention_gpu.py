"""GPU checks of the attention backends and the KV write (run on the H200).

TRITON against the TORCH oracle on large ragged batches and uniform verify batches in bf16
and fp32, the Triton KV write with PAD slots against the PyTorch write, a CUDA-graph
capture of the decode path replayed with other seq_lens / block tables / real-row counts,
and FLASH_ATTN when flash-attn is importable.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.attention.kv_write import write_kv_torch
from shared.attention.kv_write_triton import write_kv_triton
from shared.attention.metadata import PAD_SLOT_ID
from shared.attention.torch_backend import TorchBackend
from shared.attention.triton_backend import TritonBackend
from tests.oracles.paged_attention import make_batch, run_backend

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float32: 2e-4}


def ragged_lens(seed: int, num_decodes: int, num_chunks: int, num_prefills: int, max_ctx: int):
    """Decodes first (long contexts), then chunked prefills after a prefix, then fresh
    prefills, in the order the runners use."""
    rng = np.random.default_rng(seed)
    q, s = [], []
    for _ in range(num_decodes):
        q.append(1)
        s.append(int(rng.integers(1, max_ctx)))
    for _ in range(num_chunks):
        n = int(rng.integers(2, 700))
        q.append(n)
        s.append(n + int(rng.integers(1, 3000)))
    for _ in range(num_prefills):
        n = int(rng.integers(200, 1500))
        q.append(n)
        s.append(n)
    return q, s


def check(batch, num_heads, head_dim, num_kv_heads, dtype, backend=None):
    backend = backend or TritonBackend()
    expected = run_backend(TorchBackend(), batch, num_heads, head_dim, num_kv_heads, poison=0.0)
    got = run_backend(backend, batch, num_heads, head_dim, num_kv_heads)
    n = batch.num_actual_tokens
    tol = TOL[dtype]
    torch.testing.assert_close(got[:n].float(), expected[:n].float(), atol=tol, rtol=tol)
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(32, 8, 128, 16), (16, 16, 64, 32), (12, 4, 64, 64), (9, 3, 64, 16)],
)
def test_triton_matches_torch_large_ragged(dtype, num_heads, num_kv_heads, head_dim, block_size):
    q, s = ragged_lens(0, num_decodes=40, num_chunks=6, num_prefills=2, max_ctx=6000)
    q, s = q + [0], s + [500]  # a zero-token row with a context: writes nothing
    batch = make_batch(q, s, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype,
                       device="cuda", pad_reqs=5, pad_tokens=7)
    got = check(batch, num_heads, head_dim, num_kv_heads, dtype)
    assert got[batch.num_actual_tokens:].isnan().all()


@pytest.mark.parametrize("num_reqs,ctx", [(1, 32768), (4, 20000), (256, 1024)])
def test_triton_decode_split_kv(num_reqs, ctx):
    # auto split count: batch 1 x 32k gets many splits, batch 256 none
    batch = make_batch([1] * num_reqs, [ctx - (7 * i) % 512 for i in range(num_reqs)], 32, 8, 128, 16,
                       dtype=torch.bfloat16, device="cuda", pad_reqs=1, pad_tokens=1)
    got = check(batch, 32, 128, 8, torch.bfloat16)
    assert got[num_reqs:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_reqs,query_len,ctx", [(1, 4, 1024), (4, 5, 20000), (64, 2, 1024)])
def test_triton_uniform_verify_split_kv(num_reqs, query_len, ctx, dtype):
    # a speculative verify: every row 1 + k tokens, the split mapping over the KV
    seq_lens = [ctx - (7 * i) % 512 for i in range(num_reqs)]
    batch = make_batch([query_len] * num_reqs, seq_lens, 32, 8, 128, 16, dtype=dtype,
                       device="cuda", pad_reqs=1, pad_tokens=1)
    got = check(batch, 32, 128, 8, dtype)
    assert got[batch.num_actual_tokens:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_write_pad_slots(dtype):
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 300, 8, 128, 16, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[: num_tokens]
    slots[::7] = PAD_SLOT_ID  # PAD scattered through the batch, not only at the tail
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, -99.0, dtype=dtype, device="cuda") for _ in range(4)]
    write_kv_torch(key, value, caches[0], caches[1], slots)
    write_kv_triton(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    written = (caches[2].view(-1, num_kv_heads, head_dim) != -99.0).any(dim=(1, 2))
    assert written.sum().item() == (slots >= 0).sum().item()


def test_triton_forward_does_not_sync():
    batch = make_batch([1, 1, 40], [900, 20, 100], 32, 8, 128, 16, dtype=torch.bfloat16,
                       device="cuda", pad_reqs=2, pad_tokens=2)
    backend = TritonBackend()
    impl = backend.make_impl(32, 128, 8, 128**-0.5)
    output = torch.empty_like(batch.query)
    impl.forward(batch.query, batch.key_cache, batch.value_cache,
                 backend.make_builder(batch.query.device).build(batch.common), output)
    torch.cuda.synchronize()  # compile outside the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        metadata = backend.make_builder(batch.query.device).build(batch.common)
        impl.forward(batch.query, batch.key_cache, batch.value_cache, metadata, output)
        write_kv_triton(batch.query[:, :8], batch.query[:, 8:16], batch.key_cache,
                        batch.value_cache, batch.common.slot_mapping)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_decode_replay_with_new_seq_lens():
    """Capture the uniform-decode path once at 8 padded rows, then replay it with other
    seq_lens, block tables, queries and fewer real rows: it must match TORCH each time
    and leave the padded rows' outputs alone. The capture batch has the longest contexts,
    so its cache and block table are large enough for every replay batch."""
    num_heads, num_kv_heads, head_dim, block_size, rows = 32, 8, 128, 16, 8
    capture = make_batch([1] * rows, [9000 - i for i in range(rows)], num_heads,
                         num_kv_heads, head_dim, block_size, dtype=torch.bfloat16,
                         device="cuda", extra_table_cols=8)
    common = capture.common  # its tensors are the graph's persistent input buffers
    backend = TritonBackend()
    impl = backend.make_impl(num_heads, head_dim, num_kv_heads, head_dim**-0.5)
    metadata = backend.make_builder(capture.query.device).build(common)
    output = torch.empty_like(capture.query)
    args = (capture.query, capture.key_cache, capture.value_cache, metadata, output)
    assert impl.splits_for(rows, capture.query.device) > 1  # the reduction is captured too
    impl.forward(*args)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(*args)

    for seed, real in ((1, 8), (2, 5), (3, 1)):
        new = make_batch([1] * real, [int(x) for x in np.random.default_rng(seed).integers(
            1, 9000, real)], num_heads, num_kv_heads, head_dim, block_size,
            dtype=torch.bfloat16, device="cuda", pad_reqs=rows - real, seed=seed)
        assert new.key_cache.shape[0] <= capture.key_cache.shape[0]
        width = new.common.block_table.shape[1]
        assert width <= common.block_table.shape[1]
        # refill the captured buffers in place, as a runner does before a replay
        capture.key_cache[: new.key_cache.shape[0]].copy_(new.key_cache)
        capture.value_cache[: new.value_cache.shape[0]].copy_(new.value_cache)
        capture.query[:real].copy_(new.query[:real])
        common.query_start_loc.copy_(new.common.query_start_loc)
        common.seq_lens.copy_(new.common.seq_lens)
        common.block_table.zero_()
        common.block_table[:, :width].copy_(new.common.block_table)
        output.fill_(float("nan"))
        graph.replay()
        expected = run_backend(TorchBackend(), new, num_heads, head_dim, num_kv_heads)
        torch.testing.assert_close(output[:real].float(), expected[:real].float(),
                                   atol=2e-2, rtol=2e-2)
        assert output[real:].isnan().all(), "a padded row was written on replay"


def test_flash_attn_matches_torch():
    pytest.importorskip("flash_attn")
    from shared.attention.flash_attn_backend import FlashAttnBackend

    backend = FlashAttnBackend()
    q, s = ragged_lens(1, num_decodes=16, num_chunks=4, num_prefills=2, max_ctx=5000)
    mixed = make_batch(q, s, 32, 8, 128, 256, dtype=torch.bfloat16, device="cuda",
                       pad_reqs=2, pad_tokens=3)
    check(mixed, 32, 128, 8, torch.bfloat16, backend=backend)
    decode = make_batch([1] * 6, [10, 300, 2000, 257, 256, 4000], 32, 8, 128, 256,
                        dtype=torch.bfloat16, device="cuda", pad_reqs=2, pad_tokens=2)
    got = check(decode, 32, 128, 8, torch.bfloat16, backend=backend)
    assert not got.isnan().any()  # padded rows of the kvcache path hold zeros, not NaN


@pytest.mark.parametrize("pdl", [True, False])
def test_split_merge_is_deterministic_over_graph_replays(pdl, monkeypatch, kernel_opts):
    """Batch 2 x 30k-token decode (64 splits each) captured once and replayed 50 times,
    with and without programmatic dependent launch: every replay gives the bitwise-same
    output (the merge order is fixed, so a partial read before its write was visible is
    the only thing that could differ) and it matches the TORCH oracle."""

    kernel_opts(pdl=pdl)
    num_heads, num_kv_heads, head_dim = 32, 8, 128
    batch = make_batch([1, 1], [30000, 29001], num_heads, num_kv_heads, head_dim, 16,
                       dtype=torch.bfloat16, device="cuda", pad_reqs=0, pad_tokens=0)
    backend = TritonBackend()
    impl = backend.make_impl(num_heads, head_dim, num_kv_heads, head_dim**-0.5)
    metadata = backend.make_builder(batch.query.device).build(batch.common)
    output = torch.empty_like(batch.query)
    args = (batch.query, batch.key_cache, batch.value_cache, metadata, output)
    assert impl.splits_for(2, batch.query.device) == 64
    impl.forward(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(*args)
    graph.replay()
    first = output.clone()
    for _ in range(50):
        output.fill_(float("nan"))
        graph.replay()
        assert torch.equal(output, first)
    expected = run_backend(TorchBackend(), batch, num_heads, head_dim, num_kv_heads)
    torch.testing.assert_close(first.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("pdl", [False, True])
def test_fused_decode_kv_write_matches_oracle_bf16(pdl, monkeypatch, kernel_opts):
    """The uniform-decode kernel (KV write inside) on ragged bf16 decodes up to 30k keys,
    64 splits, replayed from a CUDA graph with and without PDL: output within bf16
    tolerance of write_kv_torch + TORCH, and the cache bit-identical to that write."""
    from shared.attention.decode_attention import decode_attention

    kernel_opts(pdl=pdl)
    seq_lens = [30000, 1, 1025, 16, 17, 4000]
    batch = make_batch([1] * len(seq_lens), seq_lens, 32, 8, 128, 16, dtype=torch.bfloat16,
                       device="cuda", pad_reqs=2, pad_tokens=2)
    gen = torch.Generator(device="cuda").manual_seed(3)
    key = torch.randn(batch.query.shape[0], 8, 128, generator=gen, device="cuda").bfloat16()
    value = torch.randn(batch.query.shape[0], 8, 128, generator=gen, device="cuda").bfloat16()
    kc, vc = batch.key_cache.clone(), batch.value_cache.clone()
    write_kv_torch(key, value, kc, vc, batch.common.slot_mapping)
    written = type(batch)(batch.common, batch.query, kc, vc, batch.num_actual_tokens)
    want = run_backend(TorchBackend(), written, 32, 128, 8, poison=0.0)

    c = batch.common
    got_k, got_v = batch.key_cache.clone(), batch.value_cache.clone()
    out = torch.full_like(batch.query, float("nan"))
    args = (batch.query, key, value, got_k, got_v, out, c.query_start_loc, c.seq_lens,
            c.block_table, c.slot_mapping, 128**-0.5, 64)
    decode_attention(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*args)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    n = batch.num_actual_tokens
    torch.testing.assert_close(out[:n].float(), want[:n].float(), atol=2e-2, rtol=2e-2)
    assert out[n:].isnan().all()
    assert torch.equal(got_k, kc) and torch.equal(got_v, vc)
