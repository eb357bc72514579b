"""The tensor-parallel layers one by one, without processes: the one-process arithmetic
(bit for bit), each rank's share of the work as a slice / partial sum of the whole (ranks
built for TPGroup(rank, N) with no process groups, where collectives are the identity),
vocab padding, the GQA head assignment, and the construction errors for sizes N does
not divide."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from shared.distributed.group import TPGroup, building_for
from shared.model.layers import load_hf_weights
from shared.model.loader import default_dtype
from shared.model.parallel_layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_heads_of_rank,
)
from shared.model.registry import get_model_class
from tests.shared.model.tp_ranks import preset_config


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _on_ranks(world_size: int, make, weights: dict[str, torch.Tensor]) -> list[torch.nn.Module]:
    """The module built on every rank and loaded (sharded) from the whole `weights`."""
    modules = []
    for rank in range(world_size):
        with building_for(TPGroup(rank=rank, world_size=world_size)), default_dtype(torch.float64):
            module = make()
        load_hf_weights(module, weights.items())
        modules.append(module)
    return modules


def test_single_runs_the_plain_arithmetic():
    x = _randn(5, 8, seed=0)
    w, b = _randn(6, 8, seed=1), _randn(6, seed=2)
    row, col = _on_ranks(1, lambda: RowParallelLinear(8, 6, bias=True), {"weight": w, "bias": b})[0], \
        _on_ranks(1, lambda: ColumnParallelLinear(8, 6, bias=True), {"weight": w, "bias": b})[0]
    assert torch.equal(row(x), F.linear(x, w, b)) and torch.equal(col(x), F.linear(x, w, b))
    table = _randn(11, 4, seed=3)
    ids = torch.tensor([0, 10, 3, 3, 7])
    emb = _on_ranks(1, lambda: VocabParallelEmbedding(11, 4), {"weight": table})[0]
    head = _on_ranks(1, lambda: ParallelLMHead(11, 4), {"weight": table})[0]
    assert torch.equal(emb(ids), F.embedding(ids, table))
    assert torch.equal(head(emb(ids)), F.linear(F.embedding(ids, table), table))


def test_column_parallel_ranks_compute_their_slices():
    x, w = _randn(3, 8, seed=0), _randn(12, 8, seed=1)  # gate rows 0..5 | up rows 6..11
    full = x @ w.T
    ranks = _on_ranks(2, lambda: MergedColumnParallelLinear(8, [6, 6]), {"weight": w})
    for r, m in enumerate(ranks):  # rank r: gate rows 3r..3r+2, then up rows 6+3r..
        want = torch.cat([full[:, 3 * r:3 * r + 3], full[:, 6 + 3 * r:9 + 3 * r]], dim=1)
        torch.testing.assert_close(m(x), want, rtol=0, atol=1e-12)
        assert m.local_rows(1) == slice(3, 6) and m.shard_rows(1) == slice(6, 12)


def test_row_parallel_partial_products_sum_to_the_whole():
    x, w = _randn(3, 8, seed=0), _randn(5, 8, seed=1)
    ranks = _on_ranks(4, lambda: RowParallelLinear(8, 5), {"weight": w})
    total = sum(m(x[:, 2 * r:2 * r + 2]) for r, m in enumerate(ranks))
    torch.testing.assert_close(total, x @ w.T, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("heads", "kv_heads", "world_size"), [(8, 2, 4), (8, 4, 2), (4, 1, 4), (8, 8, 4)])
def test_every_local_q_head_finds_its_kv_head(heads, kv_heads, world_size):
    """GQA: global q head j attends with KV head j // (heads / kv_heads). Each rank's
    local q head i must find that head at local KV index i // (local q / local kv)."""
    for rank in range(world_size):
        tp = TPGroup(rank=rank, world_size=world_size)
        local_kv, first = kv_heads_of_rank(tp, kv_heads)
        local_q = heads // world_size
        for i in range(local_q):
            j = rank * local_q + i
            assert first + i // (local_q // local_kv) == j // (heads // kv_heads)


def test_replicated_kv_heads_hold_the_same_rows():
    d, w = 2, _randn(8 * 2 + 2 * 2 * 2, 6, seed=0)  # 8 q heads, 2 KV heads, head_dim 2
    ranks = _on_ranks(4, lambda: QKVParallelLinear(6, d, 8, 2), {"weight": w})
    k_rows = w[16:20]
    for r, m in enumerate(ranks):
        assert (m.num_heads, m.num_kv_heads) == (2, 1)
        head = r // 2  # ranks 0, 1 -> KV head 0; ranks 2, 3 -> KV head 1
        assert torch.equal(m.weight[4:6], k_rows[head * d:(head + 1) * d])
        assert torch.equal(m.weight[:4], w[4 * r:4 * r + 4])


def test_vocab_padding_rows_are_zero_and_lookups_sum_to_the_whole():
    table = _randn(10, 3, seed=0)  # 10 rows over 4 ranks: 3 each, the last holds 1 + 2 padding
    ranks = _on_ranks(4, lambda: VocabParallelEmbedding(10, 3), {"weight": table})
    assert [m.weight.shape[0] for m in ranks] == [3] * 4
    assert torch.equal(ranks[3].weight[0], table[9]) and not ranks[3].weight[1:].any()
    ids = torch.tensor([9, 0, 5, 2, 3, 8, 9])
    assert torch.equal(sum(m(ids) for m in ranks), F.embedding(ids, table))
    heads = _on_ranks(4, lambda: ParallelLMHead(10, 3), {"weight": table})
    x = _randn(2, 3, seed=1)
    logits = torch.cat([m(x) for m in heads], dim=-1)  # what all_gather concatenates
    assert logits.shape == (2, 12) and not logits[:, 10:].any()
    torch.testing.assert_close(logits[:, :10], x @ table.T, rtol=0, atol=1e-12)


def _build(preset: str, world_size: int, **overrides):
    cfg = preset_config(preset, tuple(overrides.items()))
    with building_for(TPGroup(rank=0, world_size=world_size)), torch.device("meta"):
        return get_model_class(cfg.architectures[0])(cfg)


@pytest.mark.parametrize(("preset", "world_size", "overrides", "field"), [
    ("tiny-llama", 3, {}, "num_attention_heads (4)"),
    ("tiny-llama", 2, {"intermediate_size": 129}, "intermediate_size (129)"),
    ("tiny-mixtral", 4, {"intermediate_size": 130}, "intermediate_size (130)"),
    ("tiny-qwen2-moe", 2, {"moe_intermediate_size": 63}, "moe_intermediate_size (63)"),
    ("tiny-qwen2-moe", 2, {"shared_expert_intermediate_size": 65},
     "shared_expert_intermediate_size (65)"),
])
def test_sizes_that_do_not_split_are_named(preset, world_size, overrides, field):
    with pytest.raises(ValueError, match=re.escape(f"tensor_parallel_size={world_size} does not divide {field}")):
        _build(preset, world_size, **overrides)


@pytest.mark.parametrize(("heads", "kv_heads", "world_size"), [(6, 3, 2), (12, 3, 4)])
def test_kv_heads_neither_split_nor_replicated_are_named(heads, kv_heads, world_size):
    with pytest.raises(ValueError, match=re.escape(
            f"tensor_parallel_size={world_size} neither divides num_key_value_heads ({kv_heads})")):
        _build("tiny-llama", world_size, hidden_size=96, num_attention_heads=heads,
               num_key_value_heads=kv_heads)


def test_a_vocab_the_ranks_do_not_divide_builds():
    model = _build("tiny-llama", 4, vocab_size=509)
    assert model.model.embed_tokens.weight.shape == (128, 64) == model.lm_head.weight.shape
