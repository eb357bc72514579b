"""Seeded speculative decoding through the whole V1 engine samples the target's
distribution (the oracle: spec_statistics.py). V2 runs the same test on the GPU machine
(tests/gpu/shared/serving/test_spec_decode_statistics_gpu.py, with async scheduling):
interpreted on the CPU its kernels make thousands of requests far too slow; V2 without
async scheduling gives V1's tokens (test_spec_decode_engine.py)."""

from __future__ import annotations

import pytest

from shared.harness.diff import DiffSetup
from shared.harness.hf_reference import materialize_checkpoint
from tests.oracles.spec_chain import chi_square_pvalue
from tests.shared.serving import spec_statistics as st

N = 5000


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return materialize_checkpoint("tiny-llama", 0, str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def setup(llama_dir) -> DiffSetup:
    return DiffSetup("tiny-llama", llama_dir, "float32", "cpu", 0, ["v1"])


@pytest.fixture(scope="module")
def target(llama_dir) -> dict:
    return st.target_probs(llama_dir)


# v1-async: the next step planned before the drafts and their acceptance land (placeholder
# drafts, rows moved back on the device), the weak draft so that most are rejected
@pytest.mark.parametrize("runner,draft", [("v1", "weak"), ("v1", "self"), ("v1-async", "weak")])
def test_v1_seeded_spec_decode_samples_the_target(setup, llama_dir, target, runner, draft):
    counts, stats = st.sampled_counts(setup, runner, st.draft_config(draft, llama_dir), N, target)
    assert stats.num_draft_tokens > 0
    # the path each draft tests: weak, mostly rejected (the residual decides); self, q = p
    # (up to float32 rounding between the two forwards): all but a few accepted
    assert stats.acceptance_rate < 0.5 if draft == "weak" else stats.acceptance_rate > 0.99
    assert chi_square_pvalue(counts, target, N) > st.ALPHA


def test_a_distorted_draft_distribution_fails_it(setup, llama_dir, target, monkeypatch):
    from runner_v1.spec_decode import draft_proposer

    st.distort_draft_probs(monkeypatch, draft_proposer)
    counts, _ = st.sampled_counts(setup, "v1", st.draft_config("self", llama_dir), N, target)
    assert chi_square_pvalue(counts, target, N) < st.TEETH
