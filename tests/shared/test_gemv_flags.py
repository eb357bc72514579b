"""The flag chain between batch-1 GEMVs (shared.model.gemv_flags): a chain of GEMVs
inside `gemv_flags.chain` against the same chain without it (same kernels, so the same
bits), the counts each producer leaves, and a count one row short making the consumer
give up (so the waits are live, not skipped).

CPU: the Triton interpreter runs kernels and programs one after another, so every count is
full before its consumer starts; FAST_PATH False makes consumers check every chunk anyway,
and a 128-element FLAG_CHUNK gives the small shapes several chunks. GPU (`gpu` mark): the
llama-3-8b layer chain under PDL in a CUDA graph, where consumers really overlap producers.
"""

from __future__ import annotations

import pytest
import torch

from shared.model import fused_ops, gemv, gemv_flags, load_model
from tests.shared.test_fused_ops import _randomise_norms
from tests.shared.test_gemv import _prefill_then_decodes
from tests.shared.test_model_hf import CONFIGS


@pytest.fixture
def flag_mode(monkeypatch):
    monkeypatch.setattr(gemv_flags, "MODE", "always")
    monkeypatch.setattr(gemv_flags, "FLAG_CHUNK", 128)
    monkeypatch.setattr(gemv_flags, "FAST_PATH", False)


def _weights(hidden, inter, qkv, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(device, dtype)

    return dict(wo=w(hidden, hidden), wgu=w(2 * inter, hidden), wd=w(hidden, inter),
                wq=w(qkv, hidden), n1=1 + 0.1 * w(hidden), n2=1 + 0.1 * w(hidden),
                x=w(1, hidden), res=w(1, hidden))


def _layer(p, cfg_o, cfg_gu, cfg_d, cfg_q):
    """o_proj + residual -> norm + gate_up + SiLU -> down + residual -> norm + qkv."""
    h = gemv.gemv(p["x"], p["wo"], epilogue="residual", residual=p["res"], config=cfg_o)
    g = gemv.gemv(h, p["wgu"], norm_weight=p["n2"], eps=1e-5, epilogue="silu", config=cfg_gu)
    h2 = gemv.gemv(g, p["wd"], epilogue="residual", residual=h, config=cfg_d)
    return gemv.gemv(h2, p["wq"], norm_weight=p["n1"], eps=1e-5, config=cfg_q)


CPU_CONFIGS = [(8, 64, 4, 1, 2), (8, 128, 4, 1, 2), (4, 128, 4, 1, 2), (4, 64, 4, 1, 3)]


@pytest.mark.parametrize("fast_path", [False, True])
def test_chain_matches_the_chain_without_counts(flag_mode, monkeypatch, fast_path):
    monkeypatch.setattr(gemv_flags, "FAST_PATH", fast_path)
    p = _weights(256, 384, 384, "cpu")
    want = _layer(p, *CPU_CONFIGS)
    arena = gemv_flags.FlagArena(6, 512, "cpu")
    with gemv_flags.chain(arena):
        got = _layer(p, *CPU_CONFIGS)
    assert arena.errors() == 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    slots = torch.stack([arena.slot_counts(i) for i in range(6)])
    # four signalling GEMVs (qkv without RoPE signals too), chunks of 128 rows
    for s, rows in enumerate([256, 384, 256, 384]):
        assert slots[s, 0] == rows
        assert slots[s, 1:1 + rows // 128].eq(128).all() and slots[s, 1 + rows // 128:].eq(0).all()
    assert slots[4:].eq(0).all()


def test_a_short_count_makes_the_consumer_give_up(flag_mode):
    p = _weights(256, 384, 384, "cpu")
    arena = gemv_flags.FlagArena(4, 512, "cpu")
    with gemv_flags.chain(arena):
        h = gemv.gemv(p["x"], p["wo"], epilogue="residual", residual=p["res"],
                      config=CPU_CONFIGS[0])
        arena.slot_counts(0)[2] -= 1  # chunk 1: one row short
        gemv.gemv(h, p["wgu"], norm_weight=p["n2"], eps=1e-5, epilogue="silu",
                  config=CPU_CONFIGS[1])
    # every one of gate_up's 384 / 8 programs needs chunk 1, and each gives up on it once
    assert arena.errors() == 384 // 8


def test_rope_does_not_signal_and_a_full_arena_stops_signalling(flag_mode):
    p = _weights(256, 384, 384, "cpu")
    cos_sin = torch.randn(8, 64)
    arena = gemv_flags.FlagArena(1, 512, "cpu")
    with gemv_flags.chain(arena):
        gemv.gemv(p["x"], p["wq"], norm_weight=p["n1"], eps=1e-5, epilogue="rope",
                  positions=torch.tensor([3]), cos_sin_cache=cos_sin, head_dim=64,
                  num_rope_heads=4, config=(4, 64, 4, 1, 2))
        assert arena.counts.eq(0).all()
        a = gemv.gemv(p["x"], p["wo"], config=CPU_CONFIGS[0])
        b = gemv.gemv(p["x"], p["wo"], config=CPU_CONFIGS[0])
    assert arena.slot_of_input(a) is not None and arena.slot_of_input(b) is None
    assert arena.slot_counts(0)[0] == 256


def test_tiny_llama_decodes_the_same_through_the_chain(flag_mode, monkeypatch):
    """The model wires the chain (LlamaModel.forward): batch-1 decodes with every layer
    GEMV on the buffered FMA kernel give the same logits with and without the counts."""
    monkeypatch.setattr(gemv_flags, "FLAG_CHUNK", 32)  # hidden 64, intermediate 128
    monkeypatch.setattr(gemv, "_DEFAULT_CONFIG", (8, 16, 4, 1, 2))
    monkeypatch.setattr(fused_ops, "use_fused", lambda t: True)  # CPU: interpreter
    model = load_model(CONFIGS["llama"](), load_format="dummy", dtype=torch.float32,
                       device="cpu")
    _randomise_norms(model)
    monkeypatch.setattr(gemv_flags, "MODE", "never")
    want = _prefill_then_decodes(model)
    assert model.model._flag_arena is None
    monkeypatch.setattr(gemv_flags, "MODE", "always")
    got = _prefill_then_decodes(model)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    arena = model.model._flag_arena
    assert arena.errors() == 0
    # the last decode's forward: o_proj, gate_up and down of both layers signalled
    totals = torch.stack([arena.slot_counts(i)[0] for i in range(arena.num_slots)])
    assert totals[:6].tolist() == [64, 128, 64] * 2 and totals[6:].eq(0).all()


@pytest.mark.gpu
def test_llama_layer_chain_under_pdl_in_a_graph():
    """32 llama-3-8b layer chains (bf16, the launch table's configs) replayed from one
    CUDA graph, 20 times: the same bits as without the counts, no spin gave up."""
    p = _weights(4096, 14336, 6144, "cuda", torch.bfloat16)
    layers = [p] * 32

    def forward():
        outs = []
        for q in layers:
            outs.append(_layer(q, None, None, None, None))
        return torch.stack(outs)

    want = forward()
    arena = gemv_flags.FlagArena(4 * 32, 14336, "cuda")

    def flagged():
        with gemv_flags.chain(arena):
            return forward()

    flagged()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = flagged()
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert arena.errors() == 0
        torch.testing.assert_close(got, want, rtol=0, atol=0)
