"""The V2 rejection sampler compiled on CUDA (GPU machine only): the same tokens as the
V1 sampler on CUDA (float32, float64, bf16 logits; a 32000-token vocabulary) and as
the NumPy reference (all three methods), no host sync in a call, and the statistical
tests at sizes the CPU interpreter cannot afford. The interpreter tests and the
helpers are in tests/runner_v2/spec_decode/ and tests/runner_v1/spec_decode/."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner_v1.spec_decode.rejection_sampler import rejection_sample as v1_rejection_sample
from runner_v2.spec_decode.rejection_sampler import rejection_sample
from tests.gpu.runner_v2.test_sampler_gpu import _to_cuda
from tests.oracles.rejection_reference import SpecRequest
from tests.oracles.spec_chain import (
    ALPHA,
    make_chain,
    sequence_pvalue,
    simulate,
    synthetic_pvalue,
)
from tests.runner_v1.spec_decode.test_rejection_sampler import (
    PARAMS,
    RATES,
    Batch,
    as_lists,
    assert_matches_reference,
    case,
    make_batch,
    make_params,
    reference_outputs,
)
from tests.runner_v1.spec_decode.test_rejection_statistics import synthetic_batch
from tests.runner_v2.spec_decode.test_rejection_sampler import v2_inputs, v2_run

pytestmark = pytest.mark.gpu


def large_vocab_batch(vocab: int, dtype: torch.dtype, with_q: bool, n: int = 24) -> Batch:
    """Random requests without the reference's O(V^2) filters in the builder: drafts
    are the argmax or a random token, q a Dirichlet row."""
    rng = np.random.default_rng(31)
    cycle = [*PARAMS, "greedy"]
    reqs = []
    for i in range(n):
        k = i % 5
        sp = make_params(rng, cycle[i % len(cycle)])
        logits = rng.normal(0, rng.choice([1.0, 8.0]), (k + 1, vocab))
        logits = logits.astype(np.float64 if dtype == torch.float64 else np.float32)
        drafts = [int(np.argmax(x)) if rng.random() < 0.6 else int(rng.integers(vocab))
                  for x in logits[:k]]
        q = rng.dirichlet(np.full(vocab, 0.3), k) if with_q else None
        pos = int(rng.integers(0, 10_000))
        reqs.append(SpecRequest(logits, sp, sp.seed, list(range(pos, pos + k + 1)), drafts, q))
    return make_batch(reqs)


def v1_cuda(batch: Batch, method: str, logits: torch.Tensor):
    probs = None if batch.draft_probs is None else batch.draft_probs.cuda()
    return v1_rejection_sample(logits, _to_cuda(batch.metadata()), batch.positions.cuda(),
                               batch.num_draft_tokens, batch.draft_token_ids.cuda(), probs,
                               method, RATES if method == "synthetic" else None)


def v2_cuda(batch: Batch, method: str, logits: torch.Tensor):
    inputs = v2_inputs(batch, "cuda")
    inputs["logits"] = logits
    rates = torch.tensor(RATES, dtype=torch.float64, device="cuda")
    return rejection_sample(**inputs, method=method,
                            synthetic_rates=rates if method == "synthetic" else None)


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_compiled_matches_v1_on_cuda(dtype: torch.dtype, with_q: bool) -> None:
    batch = large_vocab_batch(32_000, dtype, with_q)
    logits = batch.logits.to(dtype).cuda()
    for method in ("standard", "synthetic"):
        v1, v2 = v1_cuda(batch, method, logits), v2_cuda(batch, method, logits)
        assert torch.equal(v1.output_token_ids, v2.output_token_ids), method
        assert torch.equal(v1.num_sampled, v2.num_sampled), method


@pytest.mark.parametrize("q_style", ["probs", "onehot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["standard", "synthetic", "block"])
def test_compiled_matches_reference(method: str, dtype: torch.dtype, q_style: str) -> None:
    batch = case("gpu", dtype, q_style, n=24, max_k=4, vocab=3000)
    out = v2_run(batch, method, device="cuda")
    assert_matches_reference(out, batch, reference_outputs(batch, method))


@pytest.mark.parametrize("method", ["standard", "synthetic", "block"])
def test_call_does_not_sync_on_cuda(method: str) -> None:
    batch = large_vocab_batch(32_000, torch.float32, True, n=8)
    inputs = v2_inputs(batch, "cuda")
    rates = torch.tensor(RATES, dtype=torch.float64, device="cuda")
    kwargs = dict(inputs, method=method, synthetic_rates=rates if method == "synthetic" else None)
    rejection_sample(**kwargs)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rejection_sample(**kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def cuda_verify(method: str):
    return lambda reqs: as_lists(v2_run(make_batch(reqs), method, device="cuda"))


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("method", ["standard", "block"])
def test_v2_reproduces_the_chain(method: str, with_q: bool) -> None:
    chain = make_chain()
    seqs = simulate(chain, cuda_verify(method), 40_000, seed=3, with_q=with_q)
    assert sequence_pvalue(chain, seqs) > ALPHA


def test_v2_block_reproduces_a_longer_chain() -> None:
    """k = 3 drafts, 4 tokens from a 3-token vocabulary: tau stops in 0..3, and the
    next step reuses rows whose eta this one read."""
    chain = make_chain(vocab=3, seed=6)
    seqs = simulate(chain, cuda_verify("block"), 60_000, seed=4, length=4, k=3)
    assert sequence_pvalue(chain, seqs) > ALPHA


def test_v2_synthetic_acceptance_follows_the_rates() -> None:
    rates, k = (0.9, 0.6, 0.75, 0.3), 4
    batch = synthetic_batch(20_000, k)
    out = v2_run(batch, "synthetic", rates=rates, device="cuda")
    counts = np.bincount(out.num_accepted.cpu().numpy(), minlength=k + 1)
    assert synthetic_pvalue(counts, rates, k) > ALPHA
