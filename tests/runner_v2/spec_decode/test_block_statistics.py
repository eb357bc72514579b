"""Block verification reproduces the target distribution: the statistical test
(tests/oracles/spec_chain.py explains it) on the NumPy
reference, which V2 matches token for token (test_rejection_sampler.py here); V2's own
runs are on the GPU (tests/gpu/runner_v2/spec_decode/), the interpreter being ~10 ms a
program. A deliberately wrong h must fail the same test."""

from __future__ import annotations

from tests.oracles import rejection_reference
from tests.oracles.spec_chain import (
    ALPHA,
    WRONG,
    make_chain,
    reference_verify,
    sequence_pvalue,
    simulate,
)


def test_reference_block_reproduces_the_chain() -> None:
    chain = make_chain()
    assert sequence_pvalue(chain, simulate(chain, reference_verify("block"), 5000)) > ALPHA


def test_wrong_block_h_fails(monkeypatch) -> None:
    """h_i = S_i / (S_i + 1), the weight w_i dropped from the denominator."""
    monkeypatch.setattr(rejection_reference, "block_h", lambda s, w: s / (s + 1.0))
    chain = make_chain()
    assert sequence_pvalue(chain, simulate(chain, reference_verify("block"), 6000)) < WRONG
