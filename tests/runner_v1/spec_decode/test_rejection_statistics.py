"""V1's rejection sampling reproduces the target distribution: the chain and chi-square
test of tests/oracles/spec_chain.py. Also: synthetic acceptance lengths follow the
configured conditional rates, whatever the drafts (synthetic_batch serves the GPU test
too)."""

from __future__ import annotations

import numpy as np
import pytest

import runner_v1.spec_decode.rejection_sampler as v1_module
from shared.contract.sampling_params import SamplingParams
from tests.oracles.rejection_reference import SpecRequest
from tests.oracles.spec_chain import (
    ALPHA,
    WRONG,
    chi_square_sf,
    make_chain,
    reference_verify,
    sequence_pvalue,
    simulate,
    synthetic_pvalue,
)
from tests.runner_v1.spec_decode.test_rejection_sampler import as_lists, make_batch, v1_run


def v1_verify(reqs: list[SpecRequest]) -> list[list[int]]:
    return as_lists(v1_run(make_batch(reqs), "standard"))


def test_chi_square_helper_against_known_quantiles() -> None:
    # chi2 quantiles (tables): df 30 at p = 0.05 is 43.773; df 63 at p = 0.001 is 103.442
    assert chi_square_sf(43.773, 30) == pytest.approx(0.05, rel=0.03)
    assert chi_square_sf(103.442, 63) == pytest.approx(0.001, rel=0.1)


def test_reference_standard_reproduces_the_chain() -> None:
    chain = make_chain()
    assert sequence_pvalue(chain, simulate(chain, reference_verify("standard"), 5000)) > ALPHA


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
def test_v1_standard_reproduces_the_chain(with_q: bool) -> None:
    """With the draft's probabilities, and with them withheld (q one-hot at the draft:
    verification then holds conditionally on the draft, as for ngram drafts)."""
    chain = make_chain()
    seqs = simulate(chain, v1_verify, 20000, seed=2, with_q=with_q)
    assert sequence_pvalue(chain, seqs) > ALPHA


def test_wrong_acceptance_rule_fails(monkeypatch) -> None:
    """Accept with p(d) instead of min(1, p(d) / q(d)), the residual unchanged: the same
    test must reject it, or it could not tell a correct sampler from a wrong one."""
    monkeypatch.setattr(v1_module, "standard_accepts", lambda u, p_d, q_d: u < p_d)
    chain = make_chain()
    assert sequence_pvalue(chain, simulate(chain, v1_verify, 20000, seed=2)) < WRONG


def synthetic_batch(n: int, k: int, vocab: int = 16):
    """Requests whose drafts the target excludes (p(d) = 0) or that greedy rows reject:
    synthetic acceptance must not care."""
    rng = np.random.default_rng(8)
    reqs = []
    for b in range(n):
        greedy = b % 3 == 0
        sp = SamplingParams(seed=int(rng.integers(0, 2**63)), max_tokens=16,
                            temperature=0.0 if greedy else 1.0, top_k=0 if greedy else 2)
        logits = rng.normal(0, 1, (k + 1, vocab)).astype(np.float32)
        drafts = [int(np.argmin(x)) for x in logits[:k]]
        pos = int(rng.integers(0, 10_000))
        reqs.append(SpecRequest(logits, sp, sp.seed, list(range(pos, pos + k + 1)), drafts, None))
    return make_batch(reqs)


def test_v1_synthetic_acceptance_follows_the_rates() -> None:
    rates, k = (0.9, 0.6, 0.75, 0.3), 4
    batch = synthetic_batch(12000, k)
    out = v1_run(batch, "synthetic", rates=rates)
    counts = np.bincount(out.num_accepted.numpy(), minlength=k + 1)
    assert synthetic_pvalue(counts, rates, k) > ALPHA
    # the same counts against other rates: the test has power
    assert synthetic_pvalue(counts, (0.85, 0.6, 0.75, 0.3), k) < WRONG
