"""Fused Triton elementwise kernels (shared.model.kernels.fused_ops) against the PyTorch path of
shared.model.layers, which is itself checked against Hugging Face in test_model_hf.

CPU: the kernels under the Triton interpreter in float32 (the interpreter has no bf16
math), small and non-power-of-two shapes, to ~1e-6; and whole tiny models run with the
fused dispatch forced on vs the PyTorch path. GPU: bf16 and float32 on Llama-3-8B / Qwen3
shapes, and a Qwen3-0.6B-shaped 2-layer model fused vs unfused, in
tests/gpu/shared/model/kernels/test_fused_ops_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from shared.model import load_model
from shared.model.kernels import fused_ops
from shared.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from shared.runtime.kernel_options import kernel_options
from tests.oracles.paged_attention import PagedHarness
from tests.shared.model.test_model_hf import CONFIGS

ROPE_PARAMS = {"rope_type": "default", "rope_theta": 10000.0}


def _randn(*shape, dtype=torch.float32, device="cpu", seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(device)


def _norm(size: int, eps: float, dtype, device, seed: int) -> RMSNorm:
    norm = RMSNorm(size, eps).to(dtype=dtype, device=device)
    norm.weight.copy_(1.0 + 0.2 * _randn(size, seed=seed).to(dtype).to(device))
    return norm


# ---------------------------------------------------------------------------------------
# references: the PyTorch path of the layers


@torch.no_grad()
def ref_qk_norm_rope(qkv, positions, rope, num_heads, num_kv_heads, q_norm, k_norm):
    head_dim = rope.head_dim
    t = qkv.shape[0]
    kv_size = num_kv_heads * head_dim
    q, k, v = qkv.split([num_heads * head_dim, kv_size, kv_size], dim=-1)
    if q_norm is not None:
        q = q_norm(q.reshape(t, num_heads, head_dim)).reshape(t, -1)
        k = k_norm(k.reshape(t, num_kv_heads, head_dim)).reshape(t, -1)
    q, k = rope(positions, q, k)
    return q, k, v.clone()


def _check_qk_norm_rope(num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, qk_norm,
                        dtype=torch.float32, device="cpu", atol=1e-6, rtol=0.0):
    with torch.device(device):
        rope = RotaryEmbedding(head_dim, rotary_dim, 512, ROPE_PARAMS).to(dtype)
    assert rope.cos_sin_cache.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    q_norm = _norm(head_dim, 1e-6, dtype, device, seed=1) if qk_norm else None
    k_norm = _norm(head_dim, 1e-6, dtype, device, seed=2) if qk_norm else None
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _randn(num_tokens, width, dtype=dtype, device=device, seed=3, scale=2.0)
    positions = torch.randint(0, 512, (num_tokens,), generator=torch.Generator().manual_seed(4))
    positions = positions.to(device)
    ref_q, ref_k, ref_v = ref_qk_norm_rope(
        qkv, positions, rope, num_heads, num_kv_heads, q_norm, k_norm
    )
    buf = qkv.clone()
    q, k, v = fused_ops.qk_norm_rope(
        buf, positions, rope.cos_sin_cache, num_heads, num_kv_heads, head_dim, rotary_dim,
        None if q_norm is None else q_norm.weight,
        None if k_norm is None else k_norm.weight,
        1e-6,
    )
    # In place: q, k, v are views into the buffer, viewable per head as Attention does.
    for part in (q, k, v):
        assert part.data_ptr() >= buf.data_ptr() and part.stride() == (width, 1)
    q.view(num_tokens, num_heads, head_dim)
    k.view(num_tokens, num_kv_heads, head_dim)
    torch.testing.assert_close(v, ref_v, rtol=0, atol=0)  # v untouched
    torch.testing.assert_close(q, ref_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(k, ref_k, rtol=rtol, atol=atol)
    return (q - ref_q).abs().max().item()


# ---------------------------------------------------------------------------------------
# CPU: kernels under the interpreter, float32


@pytest.mark.parametrize("hidden", [576, 256])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(hidden, with_residual, torch_path):
    norm = _norm(hidden, 1e-5, torch.float32, "cpu", seed=1)
    x = _randn(5, hidden, seed=2, scale=3.0)
    residual = _randn(5, hidden, seed=3) if with_residual else None
    with torch.no_grad():
        ref = norm(x, residual)
    got = fused_ops.rms_norm(x, norm.weight, 1e-5, residual)
    if with_residual:
        (got, got_res), (ref, ref_res) = got, ref
        torch.testing.assert_close(got_res, x + residual, rtol=0, atol=0)
        torch.testing.assert_close(got_res, ref_res, rtol=0, atol=0)
    assert got.shape == (5, hidden) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero tensors


def test_rms_norm_strided_rows_and_float64(torch_path):
    """A row-strided input (a column slice) and float64 (normalised in float64)."""
    norm = _norm(192, 1e-6, torch.float64, "cpu", seed=1)
    wide = _randn(4, 320, dtype=torch.float64, seed=5)
    x = wide[:, 64:256]
    residual = _randn(4, 192, dtype=torch.float64, seed=6)
    with torch.no_grad():
        ref, ref_res = norm(x, residual)
    got, got_res = fused_ops.rms_norm(x, norm.weight, 1e-6, residual)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-14)
    torch.testing.assert_close(got_res, ref_res, rtol=0, atol=0)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,rotary_dim",
    [(4, 2, 64, 64), (6, 2, 128, 128), (4, 4, 128, 32), (3, 1, 64, 48)],
    ids=["gqa-d64", "gqa3-d128", "mha-partial32", "partial48-npow2"],
)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm+rope"])
def test_qk_norm_rope_matches_torch(num_heads, num_kv_heads, head_dim, rotary_dim, qk_norm,
                                    torch_path):
    _check_qk_norm_rope(3, num_heads, num_kv_heads, head_dim, rotary_dim, qk_norm)


def test_qk_norm_rope_many_head_blocks(torch_path):
    """More q+k heads than one program holds (head blocks with a ragged tail)."""
    _check_qk_norm_rope(2, 40, 8, 128, 128, qk_norm=True)


def test_qk_norm_rope_float64_is_exact(torch_path):
    _check_qk_norm_rope(3, 4, 2, 64, 64, True, dtype=torch.float64, atol=1e-13)


@pytest.mark.parametrize("inter", [100, 1536, 1100])
def test_silu_and_mul_matches_torch(inter, torch_path):
    x = _randn(3, 2 * inter, seed=7, scale=4.0)
    ref = silu_and_mul(x)
    got = fused_ops.silu_and_mul(x)
    assert got.shape == (3, inter) and got.is_contiguous()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    # an independent formula, so a shared mistake in both paths would show
    gate, up = x[:, :inter].double(), x[:, inter:].double()
    torch.testing.assert_close(got.double(), gate * torch.sigmoid(gate) * up, rtol=1e-5, atol=1e-5)


def test_zero_tokens():
    w = torch.ones(64)
    assert fused_ops.rms_norm(torch.empty(0, 64), w, 1e-6).shape == (0, 64)
    out, res = fused_ops.rms_norm(torch.empty(0, 64), w, 1e-6, torch.empty(0, 64))
    assert out.shape == res.shape == (0, 64)
    assert fused_ops.silu_and_mul(torch.empty(0, 32)).shape == (0, 16)
    q, k, v = fused_ops.qk_norm_rope(
        torch.empty(0, 4 * 16), torch.empty(0, dtype=torch.int64), torch.zeros(8, 16),
        2, 1, 16, 16, None, None, 1e-6,
    )
    assert q.shape == (0, 32) and k.shape == v.shape == (0, 16)


# ---------------------------------------------------------------------------------------
# whole models: the fused dispatch (forced on for CPU tensors) vs the PyTorch path


def _randomise_norms(model) -> None:
    """Dummy weights set every norm to ones; make them differ per element and per norm."""
    for i, module in enumerate(m for m in model.modules() if isinstance(m, RMSNorm)):
        w = module.weight
        w.copy_((1.0 + 0.2 * _randn(w.shape[0], seed=100 + i)).to(w.dtype).to(w.device))


def _run_two_steps(model) -> torch.Tensor:
    harness = PagedHarness(model, num_blocks=8, block_size=4)
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 256, (7,), generator=gen).tolist()
    b = torch.randint(0, 256, (6,), generator=gen).tolist()
    step1 = harness.step([(a, 0, [5, 2]), (b[:4], 0, [7, 0, 3])])
    # A fixed decode token (not step 1's argmax): a bf16 near-tie must not change inputs.
    step2 = harness.step([([a[0]], 7, [5, 2]), (b[4:], 4, [7, 0, 3])])
    return torch.cat([step1, step2])


@pytest.mark.parametrize("name", ["llama", "qwen3-tied", "mixtral"])
def test_model_fused_dispatch_matches_torch_path(name, monkeypatch, kernel_opts):
    """Forcing the fused kernels on CPU (interpreter) checks the wiring: the fused
    residual pattern, q/k/v as strided views of qkv through Attention, the MoE expert
    activation. float32, two ragged steps through the paged cache."""
    model = load_model(CONFIGS[name](), load_format="dummy", dtype=torch.float32, device="cpu")
    _randomise_norms(model)
    calls = []
    real = fused_ops.use_fused

    def forced(x):
        calls.append(real(x))
        return kernel_options().fused_ops

    monkeypatch.setattr(fused_ops, "use_fused", forced)
    kernel_opts(fused_ops=False)
    ref = _run_two_steps(model)
    kernel_opts(fused_ops=True)
    got = _run_two_steps(model)
    assert calls and not any(calls)  # on CPU the real rule says "torch path"
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)
    assert ref.std() > 0.1

