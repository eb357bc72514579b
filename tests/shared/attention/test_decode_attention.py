"""The fused decode attention (KV write + attention in one kernel, under the Triton
interpreter) against the oracle: write_kv_torch, then the TORCH backend.

Both the output and the whole KV cache must match: the fused kernel writes the new K/V
itself, and a slot it misses (or one it writes that it should not) shows in the cache.
"""

from __future__ import annotations

import pytest
import torch

from shared.attention import triton_backend
from shared.attention.decode_attention import decode_attention
from shared.attention.kv_write import write_kv_torch
from shared.attention.layer import Attention
from shared.attention.torch_backend import TorchBackend
from shared.attention.triton_backend import TritonBackend
from shared.runtime.forward_context import set_forward_context
from tests.oracles.paged_attention import make_batch, run_backend


def _new_kv(batch, num_kv_heads, head_dim, seed=7):
    g = torch.Generator().manual_seed(seed)
    shape = (batch.query.shape[0], num_kv_heads, head_dim)
    return (torch.randn(shape, generator=g).to(batch.query.dtype),
            torch.randn(shape, generator=g).to(batch.query.dtype))


def _oracle(batch, key, value, num_heads, head_dim, num_kv_heads):
    kc, vc = batch.key_cache.clone(), batch.value_cache.clone()
    write_kv_torch(key, value, kc, vc, batch.common.slot_mapping)
    written = type(batch)(batch.common, batch.query, kc, vc, batch.num_actual_tokens)
    out = run_backend(TorchBackend(), written, num_heads, head_dim, num_kv_heads, poison=0.0)
    return out, kc, vc


def _fused(batch, key, value, num_heads, head_dim, num_splits):
    kc, vc = batch.key_cache.clone(), batch.value_cache.clone()
    out = torch.full_like(batch.query, float("nan"))
    c = batch.common
    decode_attention(batch.query, key, value, kc, vc, out, c.query_start_loc, c.seq_lens,
                     c.block_table, c.slot_mapping, head_dim**-0.5, num_splits)
    return out, kc, vc


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 3e-3)])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_fused_decode_matches_write_then_attend(dtype, tol, num_splits):
    # Contexts: long (several splits), one block + 1 (new position alone on a tile
    # boundary for 16-key tiles), a 1-token prompt (no cached key at all), exactly one
    # 64-key tile, 65; plus padded rows and padded tokens.
    num_heads, num_kv_heads, head_dim = 8, 2, 32
    seq_lens = [300, 17, 1, 64, 65]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, 16,
                       dtype=dtype, pad_reqs=2, pad_tokens=3)
    key, value = _new_kv(batch, num_kv_heads, head_dim)
    want, want_k, want_v = _oracle(batch, key, value, num_heads, head_dim, num_kv_heads)
    got, got_k, got_v = _fused(batch, key, value, num_heads, head_dim, num_splits)
    n = batch.num_actual_tokens
    torch.testing.assert_close(got[:n].double(), want[:n].double(), atol=tol, rtol=tol)
    assert got[n:].isnan().all(), "a padded token's output row was written"
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("tile_n,min_tiles", [(16, 1), (32, 2)])
def test_fused_decode_with_the_split_knobs_fp16(tile_n, min_tiles, monkeypatch, kernel_opts):
    # 16-bit inputs take SINGLE_QUERY_TILE_N; the reduce must see the same partition.
    kernel_opts(attention_tile_n=tile_n)
    kernel_opts(attention_min_tiles_per_split=min_tiles)
    batch = make_batch([1, 1, 1], [200, 33, 32], 8, 2, 32, 16, dtype=torch.float16,
                       pad_reqs=1, pad_tokens=1)
    key, value = _new_kv(batch, 2, 32)
    want, want_k, want_v = _oracle(batch, key, value, 8, 32, 2)
    got, got_k, got_v = _fused(batch, key, value, 8, 32, 8)
    torch.testing.assert_close(got[:3].double(), want[:3].double(), atol=3e-3, rtol=3e-3)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("query_lens,seq_lens,fused", [
    ([1, 1, 1], [40, 9, 1], True),  # uniform decode: one kernel
    ([1, 4, 1], [40, 9, 3], False),  # mixed: KV write, then attention
])
def test_layer_fuses_the_kv_write_only_for_uniform_decode(query_lens, seq_lens, fused,
                                                         monkeypatch, kernel_opts):
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    batch = make_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, 8,
                       pad_reqs=1, pad_tokens=2)
    key, value = _new_kv(batch, num_kv_heads, head_dim)
    want, want_k, want_v = _oracle(batch, key, value, num_heads, head_dim, num_kv_heads)

    calls = []
    kernel_opts(fused_decode_kv_write="always")
    monkeypatch.setattr("shared.attention.layer.write_kv",
                        lambda *a: (calls.append("write_kv"), write_kv_torch(*a)))
    layer = Attention(num_heads, head_dim, num_kv_heads, head_dim**-0.5, "layer.0")
    layer.bind_backend(TritonBackend())
    layer.bind_kv_cache(torch.stack([batch.key_cache.clone(), batch.value_cache.clone()]))
    metadata = TritonBackend().make_builder(batch.query.device).build(batch.common)
    t = batch.query.shape[0]
    with set_forward_context({"layer.0": metadata}, None, t):
        got = layer(batch.query.reshape(t, -1), key.reshape(t, -1), value.reshape(t, -1))
    n = batch.num_actual_tokens
    assert calls == ([] if fused else ["write_kv"])
    torch.testing.assert_close(got[:n].view(n, num_heads, head_dim), want[:n])
    assert torch.equal(layer.kv_cache[0], want_k) and torch.equal(layer.kv_cache[1], want_v)


@pytest.mark.parametrize("setting,num_sms,padded_rows,num_kv_heads,fused", [
    ("auto", 132, 8, 8, True),  # 64 (row, head) pairs < 132 SMs: latency-bound
    ("auto", 132, 17, 8, False),  # 136 pairs fill the GPU: two kernels
    ("auto", 132, 16, 8, True),
    ("never", 132, 3, 8, False),
    ("always", 132, 64, 8, True),
])
def test_when_the_kv_write_is_fused(setting, num_sms, padded_rows, num_kv_heads, fused,
                                    monkeypatch, kernel_opts):
    kernel_opts(fused_decode_kv_write=setting)
    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: num_sms)
    batch = make_batch([1] * 3, [5, 9, 2], 4 * num_kv_heads, num_kv_heads, 32, 8,
                       pad_reqs=padded_rows - 3)
    metadata = TritonBackend().make_builder(batch.query.device).build(batch.common)
    impl = TritonBackend().make_impl(4 * num_kv_heads, 32, num_kv_heads, 1.0)
    assert impl.fuses_kv_write(metadata) is fused
    mixed = make_batch([1, 3], [5, 9], 4 * num_kv_heads, num_kv_heads, 32, 8)
    mixed_metadata = TritonBackend().make_builder(batch.query.device).build(mixed.common)
    assert not impl.fuses_kv_write(mixed_metadata)  # a prefill row: never fused


@pytest.mark.parametrize("preload", [True, False])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fused_decode_with_and_without_the_preloaded_tile(preload, num_splits, monkeypatch, kernel_opts):
    # Both kernel variants, whatever preload_first_tile's rule would pick.

    kernel_opts(decode_attention_preload=preload)
    batch = make_batch([1, 1, 1], [150, 2, 33], 4, 2, 32, 16, pad_reqs=1, pad_tokens=1)
    key, value = _new_kv(batch, 2, 32)
    want, want_k, want_v = _oracle(batch, key, value, 4, 32, 2)
    got, got_k, got_v = _fused(batch, key, value, 4, 32, num_splits)
    torch.testing.assert_close(got[:3].double(), want[:3].double(), atol=1e-4, rtol=1e-4)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
