"""V2 Triton rejection sampler (interpreter on CPU) vs the NumPy reference, token for
token, for all three methods; vs the V1 sampler for standard and synthetic. State rows
are permuted and reused (an earlier request's values must not leak), each request's
last draft slot and q row carry garbage (NaN) that must never be read.

The interpreter runs a program in ~10 ms, so batches here are small; the statistical
tests of V2 run on the GPU (tests/gpu/runner_v2/spec_decode/)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner_v2.sample import SamplingStates
from runner_v2.spec_decode.rejection_sampler import rejection_sample
from shared.contract.sampler_output import RejectionOutput
from shared.contract.sampling_params import SamplingParams
from tests.oracles import rejection_reference
from tests.oracles.rejection_reference import (
    SpecRequest,
    acceptance_uniform,
    block_weights,
    draft_dist,
    reference_rejection_sample,
    residual_sample,
    target_probs,
)
from tests.runner_v1.spec_decode.test_rejection_sampler import (
    RATES,
    Batch,
    as_lists,
    assert_matches_reference,
    case,
    coverage,
    edge_batch,
    make_batch,
    random_request,
    reference_outputs,
    request_params,
    v1_run,
)

MAX_REQS = 24


def v2_inputs(batch: Batch, device: str = "cpu", seed: int = 0):
    """States with permuted, reused rows and the row-aligned draft tensors."""
    n = len(batch.requests)
    rng = np.random.default_rng(seed)
    max_reqs = max(MAX_REQS, n)
    states = SamplingStates(max_reqs, batch.vocab, device)
    state_rows = rng.permutation(max_reqs)[:n]
    stale = SamplingParams(seed=1, max_tokens=4, temperature=0.3, top_k=2, top_p=0.5)
    for s in state_rows:  # an earlier request in every row, overwritten below
        states.add_request(int(s), stale, [1], [1], None)
    states.apply_staged_writes()
    for s, r in zip(state_rows, batch.requests):
        states.add_request(int(s), request_params(r), [1], [1], None)
    states.apply_staged_writes()
    k = batch.num_draft_tokens.astype(np.int64)
    cu = np.concatenate([[0], np.cumsum(k + 1)])
    m = int(cu[-1])
    is_draft = np.ones(m, dtype=bool)
    is_draft[cu[1:] - 1] = False
    drafts = torch.from_numpy(rng.integers(0, batch.vocab, m))  # garbage on the last rows
    drafts[torch.from_numpy(is_draft)] = batch.draft_token_ids
    probs = None
    if batch.draft_probs is not None:
        probs = torch.full((m, batch.vocab), float("nan"), dtype=torch.float64)
        probs[torch.from_numpy(is_draft)] = batch.draft_probs
    idx = np.repeat(state_rows, k + 1).astype(np.int32)

    def dev(t):
        return None if t is None else t.to(device)

    return dict(
        logits=dev(batch.logits), expanded_idx_mapping=dev(torch.from_numpy(idx)),
        cu_num_logits=dev(torch.from_numpy(cu.astype(np.int32))),
        positions=dev(batch.positions), draft_token_ids=dev(drafts), draft_probs=dev(probs),
        states=states, max_k=int(k.max()), idx_mapping_np=state_rows.astype(np.int32))


def v2_run(batch: Batch, method: str, rates=RATES, device: str = "cpu") -> RejectionOutput:
    rates_t = torch.tensor(rates, dtype=torch.float64, device=device)
    return rejection_sample(**v2_inputs(batch, device), method=method,
                            synthetic_rates=rates_t if method == "synthetic" else None)


def assert_same(a: RejectionOutput, b: RejectionOutput) -> None:
    assert torch.equal(a.output_token_ids.cpu(), b.output_token_ids.cpu())
    assert torch.equal(a.num_sampled.cpu(), b.num_sampled.cpu())


@pytest.mark.parametrize("q_style", ["probs", "onehot"])
@pytest.mark.parametrize("method", ["standard", "synthetic", "block"])
def test_matches_reference_and_v1(method: str, q_style: str) -> None:
    batch = case(f"v2{method}", torch.float32, q_style, n=12, max_k=3)
    want = reference_outputs(batch, method)
    needed = {"no_drafts", "random_rejected", "random_all_accepted"}
    assert coverage(batch, want) >= needed | ({"greedy_rejected"} if method != "synthetic" else set())
    out = v2_run(batch, method)
    assert_matches_reference(out, batch, want)
    if method != "block":
        assert_same(out, v1_run(batch, method))


@pytest.mark.parametrize("method", ["standard", "block"])
def test_matches_reference_float64(method: str) -> None:
    batch = case("v2_fp64", torch.float64, "probs", n=8, max_k=3)
    assert_matches_reference(v2_run(batch, method), batch, reference_outputs(batch, method))


@pytest.mark.parametrize("method", ["standard", "block"])
def test_constructed_edges(method: str) -> None:
    """The outcomes the construction fixes (tests/runner_v1/...: edge_batch) hold for
    block verification too: q == p or p(d) = 1 keeps w = 1 and h = 1 (tau = k); a first
    draft with p(d) = 0 makes every later w and h 0 (tau = 0)."""
    batch, expect = edge_batch(torch.float32)
    want = reference_outputs(batch, method)
    assert [len(w) - 1 for w in want] == expect
    out = v2_run(batch, method)
    assert out.num_accepted.tolist() == expect
    assert_matches_reference(out, batch, want)


def near_target_batch(n: int, vocab: int = 8, seed: int = 21) -> Batch:
    """Drafts sampled from a q close to p (p scaled by random factors in [0.3, 1.7]):
    acceptance is frequent and p(d) / q(d) falls on both sides of 1, so block
    verification's weights w drop below 1 and its tau stops anywhere in 0..k."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        r = random_request(rng, vocab, torch.float32, 4, "equal", "temperature", 2 + i % 3)
        q = r.draft_probs * rng.uniform(0.3, 1.7, r.draft_probs.shape)
        r.draft_probs = q / q.sum(axis=1, keepdims=True)
        r.draft_token_ids = [int(rng.choice(vocab, p=row)) for row in r.draft_probs]
        reqs.append(r)
    return make_batch(reqs)


def test_block_partial_acceptance() -> None:
    batch = near_target_batch(16)
    want = reference_outputs(batch, "block")
    seen = set()
    for r, out in zip(batch.requests, want):
        tau = len(out) - 1
        w = block_weights(r)
        seen.add("none" if tau == 0 else "all" if tau == r.num_drafts else
                 "partial_w<1" if w[tau] < 1 else "partial")
    assert seen >= {"none", "all", "partial_w<1"}
    assert want != reference_outputs(batch, "standard")  # block decides differently
    assert_matches_reference(v2_run(batch, "block"), batch, want)


def find_block_requests(count: int, differs, vocab: int = 6, seed: int = 0) -> list[SpecRequest]:
    """Random block requests (q far from p, drafts sampled from q) with a seed searched
    until the reference's outcome meets `differs(request, tokens)`: inputs on which a
    detail of block verification decides the token."""
    rng = np.random.default_rng(seed)
    found = []
    while len(found) < count:
        r = random_request(rng, vocab, torch.float32, 3, "probs", "temperature", 3)
        r.draft_token_ids = [int(rng.choice(vocab, p=row)) for row in r.draft_probs]
        for s in range(64):
            r.seed = s
            if differs(r, reference_rejection_sample(r, "block")):
                found.append(r)
                break
    return found


def test_block_residual_is_weighted() -> None:
    """Stops at 0 < tau < k with w_tau < 1, where the residual max(w p - q, 0) picks
    another token than max(p - q, 0) would."""
    def differs(r, out):
        tau = len(out) - 1
        if not (0 < tau < r.num_drafts and block_weights(r)[tau] < 1):
            return False
        p = target_probs(r.logits[tau], r.params)
        return residual_sample(r, tau, np.maximum(p - draft_dist(r, tau, len(p)), 0)) != out[-1]

    batch = make_batch(find_block_requests(4, differs))
    assert_matches_reference(v2_run(batch, "block"), batch, reference_outputs(batch, "block"))


def test_block_eta_is_keyed_by_the_first_row(monkeypatch) -> None:
    """Requests whose outcome changes when eta_i is keyed by row i's own position."""
    def row_keyed(r):
        with monkeypatch.context() as m:
            m.setattr(rejection_reference, "block_eta",
                      lambda req, i: acceptance_uniform(req.seed, req.positions[i - 1]))
            return reference_rejection_sample(r, "block")

    batch = make_batch(find_block_requests(4, lambda r, out: row_keyed(r) != out, seed=1))
    assert_matches_reference(v2_run(batch, "block"), batch, reference_outputs(batch, "block"))


def test_vocab_of_several_blocks() -> None:
    """V = 2100: three vocabulary blocks (the kernels' loops over the row and the
    reduction over blocks), the last one partial."""
    batch = case("blocks", torch.float32, "probs", n=6, max_k=2, vocab=2100)
    for method in ("standard", "block"):
        assert_matches_reference(v2_run(batch, method), batch, reference_outputs(batch, method))


def test_no_drafts_is_normal_sampling() -> None:
    from runner_v2.sample import Sampler

    batch = case("k0", torch.float32, "onehot", n=6, max_k=0)
    inputs = v2_inputs(batch)
    out = rejection_sample(**inputs, method="standard", synthetic_rates=None)
    normal = Sampler(inputs["states"])(batch.logits, inputs["expanded_idx_mapping"],
                                       batch.positions, None).sampled_token_ids
    assert out.output_token_ids.shape == (6, 1)
    assert torch.equal(out.output_token_ids[:, 0], normal)


def test_refusals() -> None:
    batch = case("refuse", torch.float32, "probs", n=3, max_k=2)
    inputs = v2_inputs(batch)
    with pytest.raises(ValueError, match="unknown"):
        rejection_sample(**inputs, method="strictest", synthetic_rates=None)
    with pytest.raises(ValueError, match="synthetic_rates"):
        rejection_sample(**inputs, method="synthetic", synthetic_rates=None)
    states = inputs["states"]
    row = int(inputs["idx_mapping_np"][0])
    states.add_request(row, SamplingParams(seed=3, max_tokens=4, repetition_penalty=1.2),
                       [1], [1], None)
    with pytest.raises(ValueError, match="penalties"):
        rejection_sample(**inputs, method="standard", synthetic_rates=None)
    states.add_request(row, SamplingParams(seed=3, max_tokens=4, logprobs=2), [1], [1], None)
    with pytest.raises(ValueError, match="logprobs"):
        rejection_sample(**inputs, method="standard", synthetic_rates=None)
    states.add_request(row, SamplingParams(seed=3, max_tokens=4, bad_words_token_ids=[[2]]),
                       [1], [1], None)
    with pytest.raises(ValueError, match="bad words"):
        rejection_sample(**inputs, method="standard", synthetic_rates=None)


def test_all_greedy_batch() -> None:
    rng = np.random.default_rng(4)
    reqs = [random_request(rng, 32, torch.float32, 3, "onehot", "greedy") for _ in range(5)]
    reqs[0].draft_token_ids = [int(np.argmax(x)) for x in reqs[0].logits[:-1]]
    batch = make_batch(reqs)
    want = reference_outputs(batch, "block")
    assert len(want[0]) == reqs[0].num_drafts + 1
    for method in ("standard", "block"):
        assert as_lists(v2_run(batch, method)) == want
