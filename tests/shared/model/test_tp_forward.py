"""Tensor-parallel forward = the one-process forward: 2 (and 4) ranks on gloo, each with
its shard of the dummy-weight model, run a ragged paged batch (chunked prefill, then
decodes) and the LM head; every rank's logits must equal the one-process logits (float64:
to 1e-9) with exactly vocab_size columns, and no rank process may outlive the test.

Cases: tiny-llama, tiny-qwen3 (q/k norm, tied head), tiny-mixtral and tiny-qwen2-moe
(routed + shared expert, one all_reduce), tiny-qwen3 with a vocab that N does not divide
(padded vocab shards), tiny-llama with q/k/v, o_proj and MLP biases (a row-parallel bias
is added once, after the sum), and the same in float32 through the batch-1 GEMV path
(distributed: o_proj / down summed before the residual add), the CUDA dispatch run under
the Triton interpreter. With 4 ranks tiny-llama's 2 KV heads are replicated (one per 2
ranks) and a 510-token vocab is padded to 512.
"""

from __future__ import annotations

import torch

from shared.distributed.group import SINGLE, building_for
from tests.shared.model.tp_ranks import STEPS, Case, pids_alive, run_case, run_ranks

_BIASES = (("attention_bias", True), ("mlp_bias", True))  # row-parallel biases, added once
CASES = [
    Case("llama", "tiny-llama"),
    Case("qwen3", "tiny-qwen3"),
    Case("mixtral", "tiny-mixtral"),
    Case("qwen2-moe", "tiny-qwen2-moe"),
    Case("qwen3-vocab509", "tiny-qwen3", (("vocab_size", 509),)),
    Case("llama-bias", "tiny-llama", _BIASES),
    Case("llama-gemv", "tiny-llama", _BIASES, dtype="float32", gemv=True),
]
# 4 ranks: tiny-llama's 2 KV heads replicated (one per 2 ranks), the vocab padded to 512
CASES_4 = [Case("llama-vocab510", "tiny-llama", (("vocab_size", 510),))]


# Two batch-1 steps x two layers: qkv (+RoPE), gate_up (+SiLU) GEMVs; o_proj and down
# without the residual epilogue (summed first, then added), and the LM head: per epilogue
# (rope, silu, residual, none).
GEMV_CALLS_DISTRIBUTED = [4, 4, 0, 4 + 4 + 2]


def _reference(case: Case) -> torch.Tensor:
    """The one-process logits; for a GEMV case the plain PyTorch path (the GEMV path's
    own oracle, as in tests/shared/model/kernels/test_gemv.py)."""
    with building_for(SINGLE):
        return run_case(Case(case.name, case.preset, case.overrides, case.dtype, gemv=False))["logits"]


def _check(cases: list[Case], world_size: int, tmp_path) -> None:
    results, pids = run_ranks(world_size, cases, tmp_path)
    assert pids_alive(pids) == []
    for case in cases:
        ref = _reference(case)
        vocab = dict(case.overrides).get("vocab_size", 512)
        num_tokens = sum(len(tokens) for rows in STEPS for tokens, _, _ in rows)
        assert ref.shape == (num_tokens, vocab) and ref.std() > 0.1
        atol = 5e-5 if case.dtype == "float32" else 1e-9
        for rank, res in enumerate(results):
            got = res[f"{case.name}/logits"]
            assert got.shape == ref.shape, (case.name, rank)
            torch.testing.assert_close(got, ref, rtol=0, atol=atol, msg=f"{case.name} rank {rank}")
            # every rank gathers the same full logits
            assert torch.equal(got, results[0][f"{case.name}/logits"])
            if case.gemv:
                assert res[f"{case.name}/gemv_calls"].tolist() == GEMV_CALLS_DISTRIBUTED


def test_two_ranks_match_one(tmp_path):
    _check(CASES, 2, tmp_path)


def test_four_ranks_with_replicated_kv_heads(tmp_path):
    _check(CASES_4, 4, tmp_path)
