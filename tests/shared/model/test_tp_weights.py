"""Sharded weights reassemble to the one-process weights, bit for bit.

Each rank's model is built for TPGroup(rank=r, world_size=N) without process groups
(building and loading need none), from dummy weights and from a safetensors checkpoint
that transformers wrote. The ranks' parameters are put back together here by the layout
rules themselves (not by the loader's shard specs), and every parameter must equal the
one-process model's: column-parallel parts concatenated part by part (q|k|v, gate|up,
per expert), row-parallel ones along their input dim, vocab rows concatenated with the
padding rows zero, replicated ones equal on every rank; with fewer KV heads than ranks,
the ranks sharing a KV head hold the same rows.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shared.distributed.group import TPGroup, building_for
from shared.model import load_model
from shared.model.layers import get_head_dim
from tests.shared.model.test_model_hf import CONFIGS, randomise_parameters
from tests.shared.model.tp_ranks import preset_config


def _rank_models(build, world_size: int) -> list[torch.nn.Module]:
    models = []
    for rank in range(world_size):
        with building_for(TPGroup(rank=rank, world_size=world_size)):
            models.append(build())
    return models


def _same_on_every_rank(parts: list[torch.Tensor]) -> torch.Tensor:
    assert all(torch.equal(p, parts[0]) for p in parts)
    return parts[0]


def _qkv(parts: list[torch.Tensor], cfg, n: int) -> torch.Tensor:
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, get_head_dim(cfg)
    local_kv = max(1, kv_heads // n)
    q, k, v = zip(*(p.split([heads // n * d, local_kv * d, local_kv * d]) for p in parts))
    if kv_heads < n:  # replicated: ranks h*n/kv .. (h+1)*n/kv - 1 all hold KV head h
        group = n // kv_heads
        k = [_same_on_every_rank(list(k[h * group:(h + 1) * group])) for h in range(kv_heads)]
        v = [_same_on_every_rank(list(v[h * group:(h + 1) * group])) for h in range(kv_heads)]
    return torch.cat([*q, *k, *v])


def _halves(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    gates, ups = zip(*(p.chunk(2, dim=dim) for p in parts))
    return torch.cat([*gates, *ups], dim=dim)


def _vocab(parts: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    rows = -(-vocab_size // len(parts))
    assert all(p.shape[0] == rows for p in parts)
    full = torch.cat(parts)
    assert torch.count_nonzero(full[vocab_size:]) == 0  # the padding rows
    return full[:vocab_size]


def reassemble(name: str, parts: list[torch.Tensor], cfg) -> torch.Tensor:
    n = len(parts)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return _vocab(parts, cfg.vocab_size)
    if ".qkv_proj." in name:
        return _qkv(parts, cfg, n)
    if name.endswith("experts.gate_up_proj"):  # [E, 2I/N, H]
        return _halves(parts, 1)
    if ".gate_up_proj." in name:
        return _halves(parts, 0)
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        return torch.cat(parts, dim=-1)
    return _same_on_every_rank(parts)  # norms, routers, biases after a sum


def assert_shards_reassemble(whole: torch.nn.Module, ranks: list[torch.nn.Module], cfg) -> None:
    reference = dict(whole.named_parameters())
    local = [dict(m.named_parameters()) for m in ranks]
    assert all(list(p) == list(reference) for p in local)
    for name, full in reference.items():
        parts = [p[name].detach() for p in local]
        if len(ranks) > 1 and full.numel() > 1:
            sharded = ".qkv_proj." in name or ".gate_up_proj." in name or name.endswith(
                ("o_proj.weight", "down_proj.weight", "experts.gate_up_proj",
                 "experts.down_proj", "embed_tokens.weight", "lm_head.weight"))
            assert sharded == (parts[0].numel() < full.numel()), name
        got = reassemble(name, parts, cfg)
        assert torch.equal(got, full.detach()), name


PRESETS = ["tiny-llama", "tiny-qwen3", "tiny-mixtral", "tiny-qwen2-moe"]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("preset", PRESETS)
def test_dummy_shards_are_the_one_rank_model(preset, world_size):
    """World 4 with 2 KV heads: the KV heads are replicated."""
    cfg = preset_config(preset)

    def build():
        return load_model(cfg, load_format="dummy", dtype=torch.float64, device="cpu", seed=3)

    assert_shards_reassemble(build(), _rank_models(build, world_size), cfg)


def test_dummy_shards_with_a_padded_vocab():
    cfg = preset_config("tiny-qwen3", (("vocab_size", 509),))  # tied: one padded matrix

    def build():
        return load_model(cfg, load_format="dummy", dtype=torch.float32, device="cpu", seed=0)

    ranks = _rank_models(build, 4)
    assert [m.model.embed_tokens.weight.shape[0] for m in ranks] == [128] * 4
    assert ranks[3].lm_head.weight is ranks[3].model.embed_tokens.weight
    assert_shards_reassemble(build(), ranks, cfg)


# (transformers config, world size): biases on q/k/v (qwen2) and everywhere (llama with
# attention and MLP bias), the tied head (qwen3), both MoE layouts, KV replication at 4.
CHECKPOINTS = [
    ("llama", 2, {"attention_bias": True, "mlp_bias": True, "vocab_size": 250}),
    ("qwen2", 2, {}),
    ("qwen3-tied", 4, {"vocab_size": 254}),
    ("mixtral", 2, {}),
    ("qwen2-moe", 4, {}),
]


@pytest.mark.parametrize(("name", "world_size", "overrides"), CHECKPOINTS,
                         ids=[f"{c[0]}-tp{c[1]}" for c in CHECKPOINTS])
def test_checkpoint_shards_are_the_one_rank_model(name, world_size, overrides, tmp_path):
    hf_config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    torch.manual_seed(0)
    hf = randomise_parameters(AutoModelForCausalLM.from_config(hf_config))
    hf.save_pretrained(tmp_path)  # safetensors
    cfg = AutoConfig.from_pretrained(tmp_path)

    def build():
        return load_model(cfg, model_dir=str(tmp_path), dtype=torch.float64, device="cpu")

    whole = build()
    hf_embed = hf.model.embed_tokens.weight.detach().double()
    assert torch.equal(whole.model.embed_tokens.weight, hf_embed)
    assert_shards_reassemble(whole, _rank_models(build, world_size), cfg)


@torch.no_grad()
def flat_dummy_reference(model: torch.nn.Module, seed: int, chunk: int) -> dict[str, torch.Tensor]:
    """The one-process dummy init as it was before tensor parallelism: each parameter
    drawn flat, chunk by chunk, from one generator, in named_parameters order."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if "norm" in name:
            out[name] = torch.ones_like(p)
            continue
        std = 0.02 if p.dim() == 1 else p.shape[-1] ** -0.5 * (0.25 if "o_proj" in name else 1)
        flat = [torch.randn(min(chunk, p.numel() - s), generator=gen).mul_(std)
                for s in range(0, p.numel(), chunk)]
        out[name] = torch.cat(flat).view(p.shape).to(p.dtype)
    return out


@pytest.mark.parametrize("chunk", [1000, 1 << 24])
def test_dummy_stream_is_the_flat_one_whatever_the_chunks(chunk, monkeypatch):
    """A chunk of 1000 cuts rows (width 64, 128) in the middle: the one-rank model still
    draws exactly the flat stream, and the shards still reassemble to it."""
    from shared.model import loader

    monkeypatch.setattr(loader, "_DUMMY_CHUNK", chunk)
    cfg = preset_config("tiny-qwen2-moe", (("vocab_size", 509),))

    def build():
        return load_model(cfg, load_format="dummy", dtype=torch.float64, device="cpu", seed=5)

    whole = build()
    reference = flat_dummy_reference(whole, 5, chunk)
    for name, p in whole.named_parameters():
        assert torch.equal(p, reference[name]), name
    assert_shards_reassemble(whole, _rank_models(build, 2), cfg)
