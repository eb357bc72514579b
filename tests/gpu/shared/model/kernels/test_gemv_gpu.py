"""Small-batch fused GEMVs on the GPU (GPU machine only): llama-3-8b / qwen3-0.6b shapes
(1 and 4 token rows) in bf16 and float32 against PyTorch oracles, the tensor-core kernel
up to 16 token rows, and a layer's GEMV chain captured in a CUDA graph with programmatic
dependent launch. The CPU side, and the oracles used here, are in
tests/shared/model/kernels/test_gemv.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model.kernels import gemv
from shared.model.layers import RotaryEmbedding
from tests.shared.model.kernels.test_gemv import _randn, _rms, _rope_ref

pytestmark = pytest.mark.gpu

GPU_SHAPES = [  # (name, rows, K, epilogue, head_dim)
    ("llama qkv", 6144, 4096, "rope", 128), ("llama o_proj", 4096, 4096, "residual", 0),
    ("llama gate_up", 28672, 4096, "silu", 0), ("llama down", 4096, 14336, "residual", 0),
    ("qwen3 qkv", 4096, 1024, "none", 0), ("qwen3 lm_head", 151936, 1024, "none", 0),
]


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name,rows,k,epilogue,head_dim", GPU_SHAPES)
def test_gpu_shapes(name, rows, k, epilogue, head_dim, dtype, m):
    """The table's configs; m = 4 (a k = 3 verify): its own entry where the device has
    one, else the tensor-core default for several rows."""
    dev = "cuda"
    x = _randn(m, k, seed=1, dtype=dtype, device=dev)
    w = _randn(rows, k, seed=2, dtype=dtype, device=dev, scale=k**-0.5)
    g = (1.0 + 0.1 * _randn(k, seed=3)).to(dtype).to(dev)
    kw = {"norm_weight": g, "eps": 1e-5} if epilogue in ("rope", "silu") else {}
    normed = _rms(x, g, 1e-5).float() if kw else x.float()
    ref = F.linear(normed, w.float())
    if epilogue == "rope":
        rope = RotaryEmbedding(head_dim, head_dim, 2048, {"rope_type": "default",
                                                          "rope_theta": 5e5}).to(dev)
        pos = torch.arange(1000, 1000 + m, device=dev)
        kw.update(positions=pos, cos_sin_cache=rope.cos_sin_cache, head_dim=head_dim,
                  num_rope_heads=40)
        ref = _rope_ref(ref, pos, rope.cos_sin_cache, 32, 8, head_dim)
    elif epilogue == "silu":
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    elif epilogue == "residual":
        r = _randn(m, rows, seed=4, dtype=dtype, device=dev)
        kw["residual"] = r
        ref = ref + r.float()
    got = gemv.gemv(x, w, epilogue=epilogue, **kw).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("epilogue", ["residual", "silu"])
def test_gpu_dot_kernel_tokens(m, epilogue):
    """The tensor-core kernel on a llama-3-8b shape, bf16, up to 16 token rows."""
    dev, rows, k = "cuda", 4096, 4096
    x = _randn(m, k, seed=1, dtype=torch.bfloat16, device=dev)
    w = _randn(rows, k, seed=2, dtype=torch.bfloat16, device=dev, scale=k**-0.5)
    g = (1.0 + 0.1 * _randn(k, seed=3)).to(torch.bfloat16).to(dev)
    r = _randn(m, rows, seed=4, dtype=torch.bfloat16, device=dev)
    if epilogue == "silu":
        gate, up = F.linear(_rms(x, g, 1e-5).float(), w.float()).chunk(2, dim=-1)
        ref = F.silu(gate) * up
        got = gemv.gemv(x, w, norm_weight=g, eps=1e-5, epilogue="silu",
                        config=(32, 256, 4, 3, 1))
    else:
        ref = F.linear(x.float(), w.float()) + r.float()
        got = gemv.gemv(x, w, epilogue="residual", residual=r, config=(32, 256, 4, 3, 1))
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_gpu_pdl_chain_in_a_graph_matches_plain_launches(monkeypatch, kernel_opts):
    """A layer's four GEMVs (each reading the previous one's output) captured in a CUDA
    graph with programmatic dependent launch give bit-identical results to ordinary
    launches: gdc_wait orders every read of x and residual after the producer."""
    dev, hidden, inter = "cuda", 4096, 14336
    bf16 = torch.bfloat16
    w_qkv = _randn(6144, hidden, seed=1, dtype=bf16, device=dev, scale=hidden**-0.5)
    w_o = _randn(hidden, 4096, seed=2, dtype=bf16, device=dev, scale=hidden**-0.5)
    w_gu = _randn(2 * inter, hidden, seed=3, dtype=bf16, device=dev, scale=hidden**-0.5)
    w_d = _randn(hidden, inter, seed=4, dtype=bf16, device=dev, scale=inter**-0.5)
    g = (1.0 + 0.1 * _randn(hidden, seed=5)).to(bf16).to(dev)
    x = _randn(1, hidden, seed=6, dtype=bf16, device=dev)

    def layer():
        q = gemv.gemv(x, w_qkv, norm_weight=g, eps=1e-5)[:, :4096].contiguous()
        h = gemv.gemv(q, w_o, epilogue="residual", residual=x)
        act = gemv.gemv(h, w_gu, norm_weight=g, eps=1e-5, epilogue="silu")
        return gemv.gemv(act, w_d, epilogue="residual", residual=h)

    results = {}
    for pdl in (False, True):
        kernel_opts(pdl=pdl)
        layer()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer()
        graph.replay()
        torch.cuda.synchronize()
        results[pdl] = out.clone()
    assert torch.equal(results[True], results[False])
    assert results[True].float().std() > 0.1
