"""The TMA-ring GEMV (shared.model.gemv_tma) against PyTorch in float64 (GPU, sm_90+).

Every epilogue, with and without the norm prologue, at llama-3-8b's layer shapes, in
configs whose ring is shallower than K (the slots are reused, so a phase or a slot
handed back too early shows) and deeper than K (the ring never wraps)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a CUDA device of capability 9.0 or newer")


def _rand(*shape, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


def _reference(x, w, norm_weight, eps, epilogue, residual):
    xf = x.double()
    if norm_weight is not None:
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * norm_weight.double()
    y = xf @ w.double().t()
    if epilogue == "residual":
        return y.to(torch.bfloat16).double() + residual.double()
    if epilogue == "silu":
        n = w.shape[0] // 2
        gate, up = y[:, :n].to(torch.bfloat16).double(), y[:, n:].to(torch.bfloat16).double()
        return torch.nn.functional.silu(gate).to(torch.bfloat16).double() * up
    return y


@needs_sm90
@pytest.mark.parametrize("rows,k,epilogue,norm", [
    (6144, 4096, "none", True), (4096, 4096, "residual", False),
    (2 * 14336, 4096, "silu", True), (4096, 14336, "residual", False)])
@pytest.mark.parametrize("block_n,stages,warps", [(16, 4, 4), (8, 8, 4), (32, 3, 8), (4, 32, 4)])
def test_tma_gemv_matches_float64(rows, k, epilogue, norm, block_n, stages, warps):
    from shared.model import gemv_tma
    x = _rand(1, k, seed=1)
    w = _rand(rows, k, seed=2, scale=0.02)
    g = (1 + _rand(k, seed=3, scale=0.1)) if norm else None
    n_out = rows // 2 if epilogue == "silu" else rows
    res = _rand(1, n_out, seed=4) if epilogue == "residual" else None
    got = gemv_tma.tma_gemv(x, w, norm_weight=g, eps=1e-5, epilogue=epilogue, residual=res,
                            block_n=block_n, stages=stages, num_warps=warps).double()
    want = _reference(x, w, g, 1e-5, epilogue, res)
    # bf16 output: one rounding of the result (2^-8 relative), plus float32 sums
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2 ** -7 * scale
    # and the outputs are not all alike (a kernel that stored one row everywhere fails)
    assert got.std().item() > 0.1 * want.std().item()


@needs_sm90
def test_tma_gemv_rejects_shapes_its_tiles_do_not_cover():
    from shared.model import gemv_tma
    x = _rand(1, 4096, seed=1)
    with pytest.raises(ValueError, match="block_n=16 must divide"):
        gemv_tma.tma_gemv(x, _rand(100, 4096, seed=2), block_n=16)


@needs_sm90
@pytest.mark.parametrize("block_n,stages", [(4, 4), (8, 2), (16, 6)])
def test_tma_gemv_rope_matches_transformers(block_n, stages):
    """qkv + norm + neox RoPE at llama-3-8b's heads (32 q, 8 k, 8 v of 128), against a
    float64 matmul rotated by transformers' apply_rotary_pos_emb."""
    from shared.model import gemv_tma
    from shared.model.layers import RotaryEmbedding
    from tests.shared.test_gemv import _rope_ref
    head_dim, heads, kv_heads = 128, 32, 8
    rows = (heads + 2 * kv_heads) * head_dim
    x = _rand(1, 4096, seed=5)
    w = _rand(rows, 4096, seed=6, scale=0.02)
    g = 1 + _rand(4096, seed=7, scale=0.1)
    rope = RotaryEmbedding(head_dim, head_dim, 2048, {"rope_type": "default", "rope_theta": 5e5})
    cos_sin = rope.cos_sin_cache.to("cuda")
    positions = torch.tensor([1537], device="cuda")
    got = gemv_tma.tma_gemv(x, w, norm_weight=g, eps=1e-5, epilogue="rope",
                            positions=positions, cos_sin_cache=cos_sin, head_dim=head_dim,
                            num_rope_heads=heads + kv_heads, block_n=block_n,
                            stages=stages).double()
    y = _reference(x, w, g, 1e-5, "none", None).to(torch.bfloat16).double()
    want = _rope_ref(y, positions, cos_sin.double(), heads, kv_heads, head_dim)
    assert (got - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()
    # the rotation is live: position 1537 moves the q and k heads, not v
    assert (got[:, :heads * head_dim] - y[:, :heads * head_dim]).abs().max() > 0.1


@needs_sm90
@pytest.mark.parametrize("epilogue", ["residual", "silu"])
def test_gemv_runs_the_tma_kernel_for_its_config(epilogue, monkeypatch):
    """gemv.gemv with a config naming the TMA kernel launches it (a spy counts the
    launches), and agrees with the FMA kernel's result to bf16 rounding."""
    from shared.model import gemv, gemv_tma
    rows = 2 * 1024 if epilogue == "silu" else 1024
    x = _rand(1, 2048, seed=8)
    w = _rand(rows, 2048, seed=9, scale=0.02)
    res = _rand(1, 1024, seed=10) if epilogue == "residual" else None
    calls = []
    real = gemv_tma.tma_gemv
    monkeypatch.setattr(gemv_tma, "tma_gemv", lambda *a, **k: calls.append(k) or real(*a, **k))
    got = gemv.gemv(x, w, epilogue=epilogue, residual=res,
                    config=(8, 256, 4, 3, gemv.TMA_KERNEL))
    fma = gemv.gemv(x, w, epilogue=epilogue, residual=res, config=(8, 256, 4, 1, 2))
    assert len(calls) == 1 and calls[0]["stages"] == 3 and calls[0]["block_n"] == 8
    scale = fma.double().abs().max().item()
    assert (got.double() - fma.double()).abs().max().item() <= 2 ** -7 * scale


@needs_sm90
@pytest.mark.parametrize("rows,k,epilogue,norm,tiles", [
    (6144, 4096, "none", True, 6), (4096, 4096, "residual", False, 4),
    (2 * 14336, 4096, "silu", True, 14), (4096, 14336, "residual", False, 4),
    (6144, 4096, "rope", True, 3)])
def test_tma_gemv_programs_over_several_row_tiles(rows, k, epilogue, norm, tiles):
    """128 programs, each streaming `tiles` consecutive row tiles through one ring (the
    ring runs on across a tile's end, and the accumulators restart): the same result as
    one tile per program, and float64's."""
    from shared.model import gemv_tma
    from shared.model.layers import RotaryEmbedding
    x = _rand(1, k, seed=11)
    w = _rand(rows, k, seed=12, scale=0.02)
    g = (1 + _rand(k, seed=13, scale=0.1)) if norm else None
    n_out = rows // 2 if epilogue == "silu" else rows
    kw = dict(norm_weight=g, eps=1e-5, epilogue=epilogue, block_n=8, stages=8)
    if epilogue == "residual":
        kw["residual"] = _rand(1, n_out, seed=14)
    if epilogue == "rope":
        rope = RotaryEmbedding(128, 128, 64, {"rope_type": "default", "rope_theta": 1e4})
        kw.update(positions=torch.tensor([37], device="cuda"), head_dim=128,
                  cos_sin_cache=rope.cos_sin_cache.to("cuda"), num_rope_heads=40)
    got = gemv_tma.tma_gemv(x, w, tiles_per_program=tiles, **kw)
    one = gemv_tma.tma_gemv(x, w, **kw)
    assert torch.equal(got, one)  # same sums in the same order, per row tile
    if epilogue != "rope":
        want = _reference(x, w, g, 1e-5, epilogue, kw.get("residual"))
        assert (got.double() - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()
    with pytest.raises(ValueError, match="tiles_per_program=5 must divide"):
        gemv_tma.tma_gemv(x, w, tiles_per_program=5, **kw)
