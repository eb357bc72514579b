"""Small-batch fused GEMVs (shared.model.kernels.gemv) against independent PyTorch oracles.

CPU: the kernel under the Triton interpreter in float32 (no bf16 math there) on odd
shapes that exercise every mask, with launch configs forced small so a program covers a
partial tile; RoPE checked against transformers' own `apply_rotary_pos_emb`. Whole tiny
models (llama: RoPE fused; qwen2: qkv bias; qwen3: q/k norm kept separate; mixtral: MoE
MLP unfused) run a prefill and batch-1 decodes through the GEMV path vs the PyTorch path.
GPU: llama-3-8b / qwen3-0.6b shapes in bf16 and float32, and the PDL chain in a graph
(tests/gpu/shared/model/kernels/test_gemv_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from shared.model import load_model
from shared.model.kernels import fused_ops, gemv
from shared.model.layers import RotaryEmbedding
from shared.runtime.kernel_options import kernel_options
from tests.oracles.paged_attention import PagedHarness
from tests.shared.model.kernels.test_fused_ops import _randomise_norms
from tests.shared.model.test_model_hf import CONFIGS


def _randn(*shape, seed: int, dtype=torch.float32, device="cpu", scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def _rms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.double()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * g.double()).to(x.dtype)


def _rope_ref(qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim):
    """transformers' rotate-half RoPE on the q and k heads; v untouched."""
    m = qkv.shape[0]
    half = head_dim // 2
    cos = cos_sin[positions, :half].repeat(1, 2)[:, None, :]  # [M, 1, D]
    sin = cos_sin[positions, half:].repeat(1, 2)[:, None, :]
    q = qkv[:, : num_heads * head_dim].view(m, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim]
    k = k.reshape(m, num_kv_heads, head_dim)
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:]
    return torch.cat([q.reshape(m, -1), k.reshape(m, -1), v], dim=-1)


# (BLOCK_N, BLOCK_K, warps, stages, kernel[, 1]): partial row/col tiles, all three
# kernels (0 FMA, 1 dot, 2 double-buffered FMA: one token row, more rows fall back to 0)
CONFIGS_SMALL = [(8, 128, 4, 2, 0), (4, 64, 2, 3, 0), (16, 512, 4, 2, 0), (16, 64, 4, 2, 1),
                 (32, 128, 4, 2, 1), (8, 64, 4, 1, 2), (4, 128, 2, 1, 2), (16, 64, 4, 2, 1, 1)]


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("config", CONFIGS_SMALL)
@pytest.mark.parametrize("with_bias", [False, True])
def test_plain_and_residual(m, config, with_bias):
    rows, k = 37, 300
    x, w = _randn(m, k, seed=1), _randn(rows, k, seed=2, scale=0.1)
    bias = _randn(rows, seed=3) if with_bias else None
    ref = F.linear(x, w, bias)
    torch.testing.assert_close(gemv.gemv(x, w, bias, config=config), ref, rtol=1e-5, atol=1e-5)
    r = _randn(m, rows, seed=4)
    got = gemv.gemv(x, w, bias, epilogue="residual", residual=r, config=config)
    torch.testing.assert_close(got, ref + r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("config", CONFIGS_SMALL)
def test_norm_prologue_and_silu(m, config):
    inter, k, eps = 45, 200, 1e-5
    x = _randn(m, k, seed=5, scale=3.0)
    g = 1.0 + 0.2 * _randn(k, seed=6)
    w, bias = _randn(2 * inter, k, seed=7, scale=0.1), _randn(2 * inter, seed=8)
    normed = _rms(x, g, eps)
    got = gemv.gemv(x, w, norm_weight=g, eps=eps, config=config)
    torch.testing.assert_close(got, F.linear(normed, w), rtol=1e-5, atol=1e-5)
    gate, up = F.linear(normed, w, bias).chunk(2, dim=-1)
    got = gemv.gemv(x, w, bias, norm_weight=g, eps=eps, epilogue="silu", config=config)
    assert got.shape == (m, inter)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim,config", [(16, (8, 64, 4, 2)), (16, (4, 128, 4, 2)),
                                             (24, (16, 64, 4, 2)), (32, (16, 32, 4, 2, 1)),
                                             (16, (16, 32, 4, 2, 1))])
def test_rope_epilogue_matches_transformers(head_dim, config):
    """head_dim 24: a half head of 12 is tiled by 4-row blocks (the launcher shrinks 16);
    head_dim 16 with the dot kernel: an 8-row half head falls back to the FMA kernel."""
    num_heads, num_kv_heads, k, eps = 4, 2, 96, 1e-6
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    rope = RotaryEmbedding(head_dim, head_dim, 64, {"rope_type": "default", "rope_theta": 1e4})
    positions = torch.tensor([5, 0, 63], dtype=torch.int64)
    x, g = _randn(3, k, seed=9), 1.0 + 0.1 * _randn(k, seed=10)
    w, bias = _randn(rows, k, seed=11, scale=0.1), _randn(rows, seed=12)
    got = gemv.gemv(x, w, bias, norm_weight=g, eps=eps, epilogue="rope", positions=positions,
                    cos_sin_cache=rope.cos_sin_cache, head_dim=head_dim,
                    num_rope_heads=num_heads + num_kv_heads, config=config)
    qkv = F.linear(_rms(x, g, eps), w, bias)
    ref = _rope_ref(qkv, positions, rope.cos_sin_cache, num_heads, num_kv_heads, head_dim)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, qkv, atol=1e-3)  # the rotation did something


@pytest.mark.parametrize("config", [(8, 64, 4, 1, 2), (4, 128, 4, 1, 2), (16, 32, 2, 1, 2)])
def test_buffered_fma_one_token(config):
    """Kernel 2 (one token row) against independent oracles for every epilogue, on a K
    that leaves a partial last tile (so the steps past the end load nothing)."""
    k, eps, head_dim, num_heads, num_kv_heads = 300, 1e-5, 16, 4, 2
    x, g = _randn(1, k, seed=20, scale=2.0), 1.0 + 0.2 * _randn(k, seed=21)
    w, r = _randn(70, k, seed=22, scale=0.1), _randn(1, 70, seed=23)
    torch.testing.assert_close(gemv.gemv(x, w, epilogue="residual", residual=r, config=config),
                               F.linear(x, w) + r, rtol=1e-5, atol=1e-5)
    gate, up = F.linear(_rms(x, g, eps), w).chunk(2, dim=-1)
    got = gemv.gemv(x, w, norm_weight=g, eps=eps, epilogue="silu", config=config)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    w = _randn(rows, k, seed=24, scale=0.1)
    rope = RotaryEmbedding(head_dim, head_dim, 64, {"rope_type": "default", "rope_theta": 1e4})
    positions = torch.tensor([37], dtype=torch.int64)
    got = gemv.gemv(x, w, norm_weight=g, eps=eps, epilogue="rope", positions=positions,
                    cos_sin_cache=rope.cos_sin_cache, head_dim=head_dim,
                    num_rope_heads=num_heads + num_kv_heads, config=config)
    ref = _rope_ref(F.linear(_rms(x, g, eps), w), positions, rope.cos_sin_cache, num_heads,
                    num_kv_heads, head_dim)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_dispatch_rule(monkeypatch, kernel_opts):
    x = torch.zeros(1, 8)
    assert not gemv.use_gemv(x)  # CPU: never
    monkeypatch.setattr(fused_ops, "use_fused", lambda t: True)
    assert gemv.use_gemv(x)
    assert not gemv.use_gemv(torch.zeros(kernel_options().gemv_max_tokens + 1, 8))
    assert not gemv.use_gemv(torch.zeros(0, 8))
    assert not gemv.use_gemv(x.double())
    kernel_opts(gemv=False)
    assert not gemv.use_gemv(x)


def _prefill_then_decodes(model) -> torch.Tensor:
    """A 5-token prefill (regular path), then three batch-1 decodes (GEMV path)."""
    harness = PagedHarness(model, num_blocks=8, block_size=4)
    prompt = [3, 17, 99, 4, 250]
    out = [harness.step([(prompt, 0, [5, 2])])]
    for i, token in enumerate([7, 120, 31]):  # fixed tokens: no argmax near-ties
        out.append(harness.step([([token], 5 + i, [5, 2])]))
    return torch.cat(out)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3-tied", "mixtral"])
def test_model_gemv_path_matches_torch_path(name, monkeypatch, kernel_opts):
    model = load_model(CONFIGS[name](), load_format="dummy", dtype=torch.float32, device="cpu")
    _randomise_norms(model)
    kernel_opts(fused_ops=False)
    ref = _prefill_then_decodes(model)
    kernel_opts(fused_ops=True)
    monkeypatch.setattr(fused_ops, "use_fused", lambda t: True)  # CPU: interpreter
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a, **kw: calls.append(kw.get("epilogue")) or real(*a, **kw))
    got = _prefill_then_decodes(model)
    epilogues = set(calls)
    assert "residual" in epilogues and None in epilogues  # o_proj/down, LM head
    if name in ("llama", "qwen2"):
        assert {"rope", "silu"} <= epilogues
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)
    assert ref.std() > 0.1


@pytest.mark.parametrize("config", [(8, 64, 4, 1, 3), (16, 64, 4, 2, 1, 0)])
def test_removed_variants_are_refused(config):
    """The triple-buffered FMA kernel (3) and the wait-before-the-first-tile variant
    (sixth field 0) were removed: a config naming them is an error, not a silent fallback."""
    x, w = _randn(1, 128, seed=1), _randn(16, 128, seed=2)
    with pytest.raises(ValueError, match="removed variants"):
        gemv.gemv(x, w, config=config)


def test_config_table_is_well_formed():
    """The committed launch table (written by scripts/bench_gemv.py): every entry names a
    real key and a runnable config shape; the llama-3-8b decode shapes are all tuned."""
    table = gemv._config_table("NVIDIA H200")
    for key, cfg in table.items():
        assert len(cfg) in (5, 6) and cfg[0] >= 1 and cfg[1] >= 16, (key, cfg)
        assert cfg[4] in (0, 1, 2) and (len(cfg) == 5 or cfg[5] == 1), (key, cfg)
        assert cfg[4] != 1 or cfg[0] >= 16, (key, cfg)  # tl.dot's smallest tile
    bf16 = torch.bfloat16
    for key in [gemv.config_key("rope", True, 6144, 4096, 1, bf16),
                gemv.config_key("residual", False, 4096, 4096, 1, bf16),
                gemv.config_key("silu", True, 28672, 4096, 1, bf16),
                gemv.config_key("residual", False, 4096, 14336, 1, bf16),
                gemv.config_key("none", False, 128256, 4096, 1, bf16)]:
        assert key in table, key


def test_table_config_falls_back_to_fewer_rows():
    """A row count above one that the table lacks takes the tuned config of the most rows
    below it, above one, for the same shape and dtype; never the one-row tile; nothing
    there: the default for its row count."""
    bf16, f32 = torch.bfloat16, torch.float32
    key = lambda m, dtype=bf16, rows=64: gemv.config_key("silu", True, rows, 32, m, dtype)  # noqa: E731
    table = {key(1): [8, 128, 4, 1, 2, 1], key(3): [16, 64, 4, 2, 1],
             key(2, f32): [4, 32, 2, 1, 0]}
    assert gemv.table_config(table, key(1)) == (8, 128, 4, 1, 2, 1)
    assert gemv.table_config(table, key(2)) == gemv._DEFAULT_ROWS_CONFIG
    assert gemv.table_config(table, key(3)) == (16, 64, 4, 2, 1)
    assert gemv.table_config(table, key(7)) == (16, 64, 4, 2, 1)
    assert gemv.table_config(table, key(5, f32)) == (4, 32, 2, 1, 0)
    assert gemv.table_config(table, key(1, f32)) == gemv._DEFAULT_CONFIG
    assert gemv.table_config(table, key(2, rows=128)) == gemv._DEFAULT_ROWS_CONFIG
    assert gemv.table_config(table, key(2, f32, rows=128)) == gemv._DEFAULT_ROWS_CONFIG_FP32
