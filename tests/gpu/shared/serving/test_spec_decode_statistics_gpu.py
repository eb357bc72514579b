"""Seeded speculative decoding through the whole engine samples the target's distribution,
both runners with async scheduling (the next step planned before the drafts and their
acceptance land) and without, on the GPU with the runners' graphs (GPU machine only: interpreted on the
CPU, V2's kernels make the 20,000 requests far too slow; the CPU runs V1,
tests/shared/serving/test_spec_decode_statistics.py). The oracle and the distortion that
gives the test its teeth: tests/shared/serving/spec_statistics.py."""

from __future__ import annotations

import pytest

from tests.oracles.spec_chain import chi_square_pvalue
from tests.shared.serving import spec_statistics as st

pytestmark = pytest.mark.gpu

N = 20_000


@pytest.fixture(scope="module")
def target(llama_dir) -> dict:
    return st.target_probs(llama_dir)


@pytest.mark.parametrize("runner,draft", [("v2-async", "weak"), ("v2-async", "self"),
                                          ("v1-async", "weak"), ("v2", "self"), ("v1", "self")])
def test_seeded_spec_decode_samples_the_target(setup, llama_dir, target, runner, draft):
    counts, stats = st.sampled_counts(setup, runner, st.draft_config(draft, llama_dir), N,
                                      target)
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_rate < 0.5 if draft == "weak" else stats.acceptance_rate > 0.99
    assert chi_square_pvalue(counts, target, N) > st.ALPHA


def test_a_distorted_draft_distribution_fails_it(setup, llama_dir, target, monkeypatch):
    from runner_v2.spec_decode import draft_proposer

    st.distort_draft_probs(monkeypatch, draft_proposer)
    counts, _ = st.sampled_counts(setup, "v2-async", st.draft_config("self", llama_dir), N,
                                  target)
    assert chi_square_pvalue(counts, target, N) < st.TEETH
