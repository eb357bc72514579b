"""The two MoE execution paths against a per-token plain-Python reference."""

from __future__ import annotations

import pytest
import torch

from shared.model.moe import moe_dense, moe_sparse, select_experts


def reference_moe(hidden, w13, w2, router_logits, top_k, renormalize):
    """Token by token, expert by expert, straight from the definition."""
    out = torch.zeros_like(hidden)
    inter = w2.shape[2]
    for t in range(hidden.shape[0]):
        probs = torch.softmax(router_logits[t], dim=-1).tolist()
        chosen = sorted(range(len(probs)), key=lambda e: -probs[e])[:top_k]
        total = sum(probs[e] for e in chosen) if renormalize else 1.0
        for e in chosen:
            h = w13[e] @ hidden[t]
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += (probs[e] / total) * (w2[e] @ act)
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("run", [moe_dense, moe_sparse], ids=["dense", "sparse"])
def test_moe_paths_match_reference(run, renormalize):
    gen = torch.Generator().manual_seed(0)
    T, H, inter, E, k = 9, 16, 8, 5, 2
    hidden = torch.randn(T, H, generator=gen, dtype=torch.float64)
    w13 = torch.randn(E, 2 * inter, H, generator=gen, dtype=torch.float64) * 0.3
    w2 = torch.randn(E, H, inter, generator=gen, dtype=torch.float64) * 0.3
    logits = torch.randn(T, E, generator=gen, dtype=torch.float64) * 2
    weights, ids = select_experts(logits, k, renormalize, torch.float64)
    got = run(hidden, w13, w2, weights, ids)
    ref = reference_moe(hidden, w13, w2, logits, k, renormalize)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_dense_and_sparse_agree_in_float32():
    gen = torch.Generator().manual_seed(1)
    T, H, inter, E, k = 33, 32, 16, 8, 2
    hidden = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * inter, H, generator=gen) * 0.2
    w2 = torch.randn(E, H, inter, generator=gen) * 0.2
    weights, ids = select_experts(torch.randn(T, E, generator=gen), k, True, torch.float32)
    dense = moe_dense(hidden, w13, w2, weights, ids)
    sparse = moe_sparse(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(dense, sparse, rtol=1e-5, atol=1e-5)
