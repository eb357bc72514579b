"""Fused Triton elementwise kernels on the GPU (GPU machine only): bf16 and float32 on
Llama-3-8B / Qwen3 shapes against the PyTorch path of shared.model.layers, and a
Qwen3-0.6B-shaped 2-layer model fused vs unfused. The CPU side, and the helpers used
here, are in tests/shared/model/kernels/test_fused_ops.py.
"""

from __future__ import annotations

import pytest
import torch

from shared.model import load_model
from shared.model.kernels import fused_ops
from shared.model.layers import silu_and_mul
from tests.shared.model.kernels.test_fused_ops import (
    _check_qk_norm_rope,
    _norm,
    _randn,
    _randomise_norms,
    _run_two_steps,
)

pytestmark = pytest.mark.gpu

GPU_DTYPES = [
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float32, id="fp32"),
]
# bf16: both paths round the same float32 values, so they differ by at most an ulp
# where float32 summation order or rsqrt/exp ulps tip a rounding.
GPU_TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("hidden", [4096, 1024, 576])
def test_gpu_rms_norm(hidden, dtype, torch_path):
    dev = "cuda"
    norm = _norm(hidden, 1e-5, dtype, dev, seed=1)
    for num_tokens in (1, 37, 512):
        x = _randn(num_tokens, hidden, dtype=dtype, device=dev, seed=2, scale=3.0)
        r = _randn(num_tokens, hidden, dtype=dtype, device=dev, seed=3)
        with torch.no_grad():
            ref, ref_res = norm(x, r)
            ref_plain = norm(x)
        got, got_res = fused_ops.rms_norm(x, norm.weight, 1e-5, r)
        torch.testing.assert_close(got_res, ref_res, rtol=0, atol=0)  # one rounded add
        torch.testing.assert_close(got, ref, **GPU_TOL[dtype])
        torch.testing.assert_close(fused_ops.rms_norm(x, norm.weight, 1e-5), ref_plain,
                                   **GPU_TOL[dtype])
        if dtype == torch.bfloat16:
            # bf16 output rounding hides the reduction order (fp32 sum of squares in a
            # different order than torch's mean), so nearly every element must be equal;
            # in fp32 that order shows as 1-ulp differences, bounded by assert_close above.
            mismatch = (got != ref).float().mean().item()
            assert mismatch < 0.01, f"{mismatch:.2%} of elements differ"


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,qk_norm", [(32, 8, False), (16, 8, True)], ids=["llama3", "qwen3"]
)
def test_gpu_qk_norm_rope(num_heads, num_kv_heads, qk_norm, dtype, torch_path):
    for num_tokens in (1, 300):
        _check_qk_norm_rope(num_tokens, num_heads, num_kv_heads, 128, 128, qk_norm,
                            dtype=dtype, device="cuda", **GPU_TOL[dtype])


@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("inter", [14336, 3072])
def test_gpu_silu_and_mul(inter, dtype, torch_path):
    for num_tokens in (1, 200):
        x = _randn(num_tokens, 2 * inter, dtype=dtype, device="cuda", seed=7, scale=4.0)
        ref = silu_and_mul(x)
        got = fused_ops.silu_and_mul(x)
        torch.testing.assert_close(got, ref, **GPU_TOL[dtype])


@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_qwen3_model_fused_vs_torch(dtype, monkeypatch, record_property, kernel_opts):
    """A 2-layer Qwen3-0.6B-shaped model (hidden 1024, 16/8 heads of 128, q/k norm) on
    CUDA: fused kernels vs the PyTorch path, two ragged steps through the paged cache."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=2048,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )
    model = load_model(cfg, load_format="dummy", dtype=dtype, device="cuda", seed=0)
    _randomise_norms(model)
    kernel_opts(fused_ops=False)
    ref = _run_two_steps(model).float()
    kernel_opts(fused_ops=True)
    got = _run_two_steps(model).float()
    diff = (got - ref).abs().max().item()
    record_property("max_abs_logit_diff", diff)
    print(f"qwen3 2-layer {dtype}: max |fused - torch| logit diff = {diff:.3g} "
          f"(logit std {ref.std().item():.3g})")
    assert ref.std() > 0.1
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-3)
    else:
        assert diff < 0.05 * ref.abs().max().item(), diff
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
