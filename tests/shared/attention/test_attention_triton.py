"""TRITON backend (under the Triton interpreter) against the TORCH oracle backend.

Every batch is ragged and laid out like a runner's step (see tests/oracles/paged_attention.py): block
ids shuffled, padded rows/tokens at the tail. The output buffer starts as NaN so a
padded token that got written, or a real token that did not, shows.
"""

from __future__ import annotations

import pytest
import torch

from shared.attention.torch_backend import TorchBackend
from shared.attention.triton_backend import TritonBackend
from tests.oracles.paged_attention import make_batch, run_backend

# fp32 everywhere under the interpreter: tl.dot computes fp32 there.
ATOL = RTOL = 1e-4


def compare(query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
            num_splits=None, dtype=torch.float32, atol=ATOL, rtol=RTOL, pad_reqs=2,
            pad_tokens=3, **overrides):
    batch = make_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                       dtype=dtype, pad_reqs=pad_reqs, pad_tokens=pad_tokens)
    for name, value in overrides.items():
        setattr(batch.common, name, value)
    expected = run_backend(TorchBackend(), batch, num_heads, head_dim, num_kv_heads, poison=0.0)
    got = run_backend(TritonBackend(num_splits=num_splits), batch, num_heads, head_dim,
                      num_kv_heads)
    n = batch.num_actual_tokens
    torch.testing.assert_close(got[:n].double(), expected[:n].double(), atol=atol, rtol=rtol)
    assert got[n:].isnan().all(), "a padded token's output row was written"
    return batch, got


def test_seed_batch_mixed_with_empty_rows():
    # The seed's rows (an empty row, a chunk after a cached prefix, a decode, a short
    # chunk) plus a zero-token row that has a cached context and must write nothing.
    compare([2, 0, 1, 3, 0], [7, 0, 13, 4, 9])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_gqa_ratios_mixed_batch(num_heads, num_kv_heads):
    # decodes first, then chunked prefills with prefixes, then a fresh prefill
    compare([1, 1, 6, 17, 9], [1, 29, 20, 40, 9], num_heads=num_heads,
            num_kv_heads=num_kv_heads, block_size=16)


@pytest.mark.parametrize("num_splits", [None, 4, 3])
def test_long_decode_split_kv(num_splits):
    # 600-token contexts span 75 blocks of 8 and ten 64-key tiles: 4 splits are all
    # used, 3 splits leave none idle; the short decodes use fewer splits than the grid.
    compare([1, 1, 1, 1], [600, 37, 150, 1], num_splits=num_splits, pad_tokens=2)


@pytest.mark.parametrize("tile_n,min_tiles", [(16, 1), (32, 1), (64, 2)])
def test_decode_tile_and_split_knobs_fp16(tile_n, min_tiles, monkeypatch, kernel_opts):
    # The 16-bit decode kernel with the benchmarks' knobs: keys per tile (one 16-key KV
    # block, two, four) and tiles per split, over splits that are full, partial and empty.

    kernel_opts(attention_tile_n=tile_n)
    kernel_opts(attention_min_tiles_per_split=min_tiles)
    compare([1, 1, 1], [300, 17, 1], block_size=16, num_splits=8, dtype=torch.float16,
            atol=2e-3, rtol=2e-3, pad_tokens=2)


@pytest.mark.parametrize("split_tokens", [64, 128])
def test_fixed_size_splits(split_tokens, kernel_opts):
    # Splits of one and two 64-key tiles over a grid covering the block table's width
    # (the longest row a table can hold): the 600-key row uses ten or five of them, the
    # short rows one, the padded row none; a mixed step's decodes too.
    kernel_opts(attention_split_tokens=split_tokens)
    compare([1, 1, 1, 1], [600, 37, 150, 1], pad_tokens=2, pad_reqs=1)
    compare([1, 1, 6, 17], [1, 300, 20, 40], block_size=16)


def test_split_kv_independent_of_split_count():
    batch = make_batch([1, 1, 1], [420, 70, 5], 4, 2, 32, 8)
    one = run_backend(TritonBackend(num_splits=1), batch, 4, 32, 2)
    four = run_backend(TritonBackend(num_splits=4), batch, 4, 32, 2)
    torch.testing.assert_close(one[:3], four[:3], atol=1e-5, rtol=1e-5)


def test_prefill_spanning_several_query_tiles_after_prefix():
    # group 1 -> 128 query rows per tile: 150 queries take two tiles, the second ending
    # mid-tile; the 100-token prefix sits in front (chunked prefill).
    compare([150, 1], [250, 64], num_heads=2, num_kv_heads=2, head_dim=16, block_size=16,
            pad_reqs=1, pad_tokens=1)


def test_group_of_three_and_odd_head_dim():
    # SmolLM2-like 9 query heads / 3 KV heads: 42 query tokens per tile, not a power of
    # 2; head_dim 24 is masked inside a 32-wide tile.
    compare([3, 50, 1], [10, 60, 33], num_heads=9, num_kv_heads=3, head_dim=24)


@pytest.mark.parametrize("block_size", [32, 64])
def test_larger_kv_blocks(block_size):
    compare([1, 5, 2], [130, 70, 2], block_size=block_size)


def test_uniform_decode_with_padded_rows():
    # max_query_len == 1: only the single-query mapping runs; 3 padded rows (seq_len 0,
    # query_start_loc repeated, zero block-table rows) and 3 padded tokens.
    batch, _ = compare([1, 1, 1], [5, 90, 17], num_splits=2, pad_reqs=3)
    assert batch.common.max_query_len == 1


def test_length_one_rows_handled_when_num_decodes_is_zero():
    # A producer that does not count its length-1 rows as decodes: the multi-query
    # mapping must then own them (no row may be left unwritten).
    compare([1, 4, 1], [12, 4, 30], num_decodes=0, num_prefills=3)


def test_float64_is_tight():
    compare([1, 3, 0, 7], [45, 10, 0, 7], num_splits=2, dtype=torch.float64,
            atol=1e-12, rtol=1e-12)


def test_bfloat16_load_store():
    # bf16 is only loaded/stored by the kernel (math in fp32); torch computes in fp32 too.
    compare([1, 4], [70, 9], num_splits=2, dtype=torch.bfloat16, atol=2e-2, rtol=2e-2)


def test_real_rows_independent_of_padding():
    args = ([1, 5, 1, 2], [66, 5, 9, 30])
    plain = make_batch(*args, 4, 2, 32, 8, pad_reqs=0, pad_tokens=0)
    padded = make_batch(*args, 4, 2, 32, 8, pad_reqs=4, pad_tokens=5)
    backend = TritonBackend(num_splits=2)
    a = run_backend(backend, plain, 4, 32, 2)
    b = run_backend(backend, padded, 4, 32, 2)
    n = plain.num_actual_tokens
    assert not a.isnan().any()
    assert torch.equal(a, b[:n]), "padding changed a real row's result"
    assert b[n:].isnan().all()


def test_no_nan_when_every_row_is_padding():
    batch = make_batch([], [], 4, 2, 32, 8, pad_reqs=4, pad_tokens=4)
    out = run_backend(TritonBackend(num_splits=2), batch, 4, 32, 2, poison=7.0)
    assert (out == 7.0).all(), "an all-padding step must write nothing"


def test_query_as_view_into_fused_qkv():
    # The layer hands attention q as a view of the fused qkv projection: the token
    # stride is (H + 2 Hkv) * D, not H * D.
    batch = make_batch([1, 6, 2], [40, 6, 19], 4, 2, 32, 8, pad_reqs=1, pad_tokens=1)
    num_tokens = batch.query.shape[0]
    qkv = torch.randn(num_tokens, (4 + 2 * 2) * 32)
    qkv[:, : 4 * 32] = batch.query.reshape(num_tokens, -1)
    batch.query = qkv[:, : 4 * 32].view(num_tokens, 4, 32)
    assert batch.query.stride(0) == 8 * 32
    expected = run_backend(TorchBackend(), batch, 4, 32, 2, poison=0.0)
    got = run_backend(TritonBackend(num_splits=2), batch, 4, 32, 2)
    n = batch.num_actual_tokens
    torch.testing.assert_close(got[:n], expected[:n], atol=ATOL, rtol=RTOL)


def test_split_count_depends_on_padded_rows_only():
    from shared.attention.triton_backend import num_splits_for

    # H200: 132 SMs, Llama-3-8B's 8 KV heads
    assert num_splits_for(256, 8, 132, 64) == 1  # 2048 programs already fill it
    assert num_splits_for(8, 8, 132, 64) == 16
    assert num_splits_for(1, 8, 132, 64) == 64  # batch 1 x 32k: 512 programs
    assert num_splits_for(1, 8, 132, 16) == 16  # capped


def test_layers_of_one_step_share_a_launch_plan():
    """One step's metadata serves every layer: the first builds the launch plan (split
    partials included), the next layers only launch, each over its own query and cache.
    Each layer must still equal the oracle over its own tensors, also after a layer of
    another head shape (a plan of its own), and a layer whose tensors are laid out
    otherwise than the plan's is refused rather than launched with the plan's strides."""
    kv_heads, dim = 2, 32
    step = make_batch([1, 1, 5, 3], [40, 9, 30, 3], 4, kv_heads, dim, 8, pad_reqs=1,
                      pad_tokens=2)
    backend = TritonBackend(num_splits=4)  # split partials and the reduction, shared
    metadata = backend.make_builder(step.query.device).build(step.common)
    oracle_md = TorchBackend().make_builder(step.query.device).build(step.common)
    gen = torch.Generator().manual_seed(3)
    n = step.num_actual_tokens

    def layer(heads: int):
        query = torch.randn(step.query.shape[0], heads, dim, generator=gen)
        caches = [torch.randn(step.key_cache.shape, generator=gen) for _ in range(2)]
        impl = backend.make_impl(heads, dim, kv_heads, dim**-0.5)
        out = torch.full_like(query, float("nan"))
        impl.forward(query, *caches, metadata, out)
        want = torch.zeros_like(query)
        TorchBackend().make_impl(heads, dim, kv_heads, dim**-0.5).forward(
            query, *caches, oracle_md, want)
        torch.testing.assert_close(out[:n], want[:n], atol=ATOL, rtol=RTOL)
        assert out[n:].isnan().all()
        return impl, query, caches

    for _ in range(3):
        impl, query, caches = layer(4)
    assert len(metadata.plans) == 1
    layer(8)
    assert len(metadata.plans) == 2
    layer(4)  # back to the first plan
    strided = query.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    with pytest.raises(AssertionError, match="layout"):
        impl.forward(strided, *caches, metadata, torch.empty_like(strided))


def _plan_of(batch, num_heads, num_kv_heads, head_dim, num_splits=None):
    """The launch plan the TRITON backend builds for `batch` (one layer's forward)."""
    backend = TritonBackend(num_splits=num_splits)
    metadata = backend.make_builder(batch.query.device).build(batch.common)
    impl = backend.make_impl(num_heads, head_dim, num_kv_heads, head_dim**-0.5)
    impl.forward(batch.query, batch.key_cache, batch.value_cache, metadata,
                 torch.empty_like(batch.query))
    (plan,) = metadata.plans.values()
    return plan


@pytest.mark.parametrize("query_len,num_splits,num_heads", [
    (2, 4, 4), (4, None, 4), (4, 3, 4), (5, 2, 4), (4, 4, 8)])
def test_uniform_verify_rows_split_the_kv(query_len, num_splits, num_heads):
    """A speculative verify: every real row has the same short query length (1 + k). The
    split mapping takes the rows whole (their tokens x GROUP heads in one tile, a partial
    per token and split, one reduction program per token): equal to the oracle for a
    context over every split, a short one that leaves splits empty, a row whose whole
    context is its query (its early tokens see no key of the later splits), padded rows
    and tokens; and the multi-query mapping does not run."""
    query_lens = [query_len] * 4
    seq_lens = [600, 37 + query_len, 150, query_len]
    compare(query_lens, seq_lens, num_heads=num_heads, num_splits=num_splits, pad_reqs=2,
            pad_tokens=3)
    batch = make_batch(query_lens, seq_lens, num_heads, 2, 32, 8, pad_reqs=2, pad_tokens=3)
    plan = _plan_of(batch, num_heads, 2, 32, num_splits)
    assert plan.multi is None and plan.single.kwargs["BLOCK_Q"] == query_len
    splits = plan.single.grid[2]
    assert (plan.reduce is None) == (splits == 1)
    if splits > 1:  # one reduction program per (padded row, token) and head
        assert plan.reduce.grid[:2] == (6 * query_len, num_heads)


@pytest.mark.parametrize("query_lens,num_heads", [
    ([4, 4, 3], 4),  # rows of unequal length: not a uniform verify
    ([4, 0, 4], 4),  # a real row without tokens (a cached context): not uniform either
    ([20, 20], 8),  # 20 tokens x GROUP 4 past the tile: the multi-query mapping
])
def test_other_batches_keep_the_multi_query_mapping(query_lens, num_heads):
    seq_lens = [q + 40 for q in query_lens]
    compare(query_lens, seq_lens, num_heads=num_heads, num_splits=4)
    batch = make_batch(query_lens, seq_lens, num_heads, 2, 32, 8, pad_reqs=1)
    assert _plan_of(batch, num_heads, 2, 32, 4).multi is not None


@pytest.mark.parametrize("dtype,split", [(torch.bfloat16, True), (torch.float32, False)])
def test_the_row_limit_of_the_split_mapping_follows_the_dtype(dtype, split):
    """10 tokens x GROUP 4 = 40 rows (a 64-row tile): the split mapping takes them in
    16-bit, not in fp32, whose wide tiles the multi-query mapping keeps to 32 rows."""
    batch = make_batch([10, 10], [50, 12], 8, 2, 32, 8, dtype=dtype, pad_reqs=1)
    assert (_plan_of(batch, 8, 2, 32).multi is None) == split
    compare([10, 10], [50, 12], num_heads=8, dtype=dtype, atol=2e-2, rtol=2e-2)


def test_batch_invariant_mode_keeps_verify_rows_on_the_multi_query_mapping(kernel_opts):
    """Batch-invariant mode needs a token's result to be the same in a verify, a prefill
    chunk or a decode: one mapping config and no splits, so no split mapping of verify
    rows."""
    kernel_opts(batch_invariant=True)
    batch = make_batch([3, 3], [40, 9], 4, 2, 32, 8, pad_reqs=1)
    assert _plan_of(batch, 4, 2, 32).multi is not None
