"""V1 rejection sampler vs the NumPy reference (tests/oracles/rejection_reference.py),
token for token: random logits (float32, float64), draft-model q and one-hot q, random
draft counts (0 included), greedy and random rows mixed, filtered rows, and constructed
all-accepted / first-rejected edges whose outcome the test states itself. The batch
builders here serve the V2 tests too."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from runner_v1.sampling_metadata import SamplingMetadata
from runner_v1.spec_decode.rejection_sampler import rejection_sample
from shared.contract.sampler_output import RejectionOutput
from shared.contract.sampling_params import SamplingParams
from tests.oracles.rejection_reference import (
    SpecRequest,
    reference_rejection_sample,
    target_probs,
)
from tests.runner_v1.test_sampler import FEATURES, Row, make_metadata

VOCAB = 64
RATES = (0.9, 0.6, 0.75, 0.3, 0.5)  # synthetic: one conditional rate per draft position
# the sampling parameters a request may draw: the normal sampler's filter features
PARAMS = {name: FEATURES[name] for name in
          ("greedy", "temperature", "hot", "top_k", "top_p", "min_p", "all_filters")}
DRAFTS = ("likely", "likely", "random", "excluded", "from_q")  # how a draft is chosen


def make_params(rng: np.random.Generator, name: str) -> SamplingParams:
    return SamplingParams(seed=int(rng.integers(0, 2**63)), max_tokens=64, **PARAMS[name])


def pick_draft(rng, style: str, p: np.ndarray, q: np.ndarray | None) -> int:
    """A draft for a row with target p: its most likely token, any token, a token p
    excludes (p == 0; any token when nothing is excluded) or a sample of q."""
    if style == "likely":
        return int(np.argmax(p))
    if style == "excluded" and (p == 0).any():
        return int(rng.choice(np.flatnonzero(p == 0)))
    if style == "from_q" and q is not None:
        return int(rng.choice(len(q), p=q))
    return int(rng.integers(0, len(p)))


def random_request(rng, vocab: int, dtype, max_k: int, q_style: str, params: str | None = None,
                   k: int | None = None, draft_style: str | None = None) -> SpecRequest:
    """q_style: "probs" (a random draft distribution), "onehot" (None) or "equal" (q == p);
    draft_style: one of DRAFTS for every draft, or None: drawn per draft."""
    k = int(rng.integers(0, max_k + 1)) if k is None else k
    sp = make_params(rng, params or str(rng.choice(list(PARAMS))))
    scale = rng.choice([1.0, 8.0])  # flat rows reject, peaked rows accept their likely draft
    logits = rng.normal(0, scale, (k + 1, vocab)).astype(np.float64 if dtype == torch.float64
                                                       else np.float32)
    drafts, qs = [], []
    for i in range(k):
        p = target_probs(logits[i], sp)
        if q_style == "probs":
            q = rng.dirichlet(np.full(vocab, 0.3))
        elif q_style == "equal":
            q = p.copy()
        else:
            q = None
        drafts.append(pick_draft(rng, draft_style or str(rng.choice(DRAFTS)), p, q))
        qs.append(q)
    pos0 = int(rng.integers(0, 5000))
    probs = np.stack(qs) if q_style != "onehot" and k else (
        np.zeros((0, vocab)) if q_style != "onehot" else None)
    return SpecRequest(logits, sp, sp.seed, list(range(pos0, pos0 + k + 1)), drafts, probs)


@dataclass
class Batch:
    """The requests as flat tensors (V1's layout: drafts [sum k])."""

    requests: list[SpecRequest]
    logits: torch.Tensor  # [M, V]
    positions: torch.Tensor  # int64 [M]
    num_draft_tokens: np.ndarray  # int32 [N]
    draft_token_ids: torch.Tensor  # int64 [sum k]
    draft_probs: torch.Tensor | None  # float64 [sum k, V]

    @property
    def vocab(self) -> int:
        return self.logits.shape[1]

    def metadata(self) -> SamplingMetadata:
        rows = [Row(request_params(r), [1], [], None) for r in self.requests]
        return make_metadata(rows, self.vocab)[0]


def request_params(r: SpecRequest) -> SamplingParams:
    """The request's parameters carrying its seed (the reference reads r.seed)."""
    return r.params if r.params.seed == r.seed else replace(r.params, seed=r.seed)


def make_batch(requests: list[SpecRequest]) -> Batch:
    vocab = requests[0].logits.shape[1]
    onehot = all(r.draft_probs is None for r in requests)
    assert onehot or all(r.draft_probs is not None for r in requests)
    drafts = [t for r in requests for t in r.draft_token_ids]
    return Batch(
        requests,
        torch.from_numpy(np.concatenate([r.logits for r in requests])),
        torch.tensor([p for r in requests for p in r.positions], dtype=torch.int64),
        np.array([r.num_drafts for r in requests], dtype=np.int32),
        torch.tensor(drafts, dtype=torch.int64),
        None if onehot else torch.from_numpy(
            np.concatenate([r.draft_probs.reshape(-1, vocab) for r in requests])),
    )


def reference_outputs(batch: Batch, method: str, rates=RATES) -> list[list[int]]:
    return [reference_rejection_sample(r, method, rates) for r in batch.requests]


def v1_run(batch: Batch, method: str, rates=RATES) -> RejectionOutput:
    return rejection_sample(batch.logits, batch.metadata(), batch.positions,
                            batch.num_draft_tokens, batch.draft_token_ids, batch.draft_probs,
                            method, rates if method == "synthetic" else None)


def as_lists(out: RejectionOutput) -> list[list[int]]:
    """The rows of an output, checking the -1 padding and the counts on the way."""
    tokens, counts = out.output_token_ids, out.num_sampled
    assert tokens.dtype == torch.int64 and counts.dtype == torch.int32
    rows = []
    for row, n in zip(tokens.tolist(), counts.tolist()):
        assert n >= 1 and all(t == -1 for t in row[n:]) and all(t >= 0 for t in row[:n])
        rows.append(row[:n])
    return rows


def assert_matches_reference(out: RejectionOutput, batch: Batch, want: list[list[int]]) -> None:
    assert out.output_token_ids.shape == (len(batch.requests),
                                          int(batch.num_draft_tokens.max()) + 1)
    got = as_lists(out)
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"(request, got, want): {bad[:5]}"


def case(name: str, dtype: torch.dtype, q_style: str, n: int = 12, max_k: int = 4,
         vocab: int = VOCAB) -> Batch:
    rng = np.random.default_rng(zlib.crc32(f"{name}{dtype}{q_style}".encode()))
    cycle = [*PARAMS, "greedy"]  # every kind of row in every batch, greedy twice as often

    def num_drafts(i: int) -> int:
        return 0 if i % 5 == 4 or max_k == 0 else 1 + i % max_k

    def style(i: int) -> str | None:  # every third request drafts its likely tokens only
        return "likely" if i % 3 == 1 else None

    return make_batch([random_request(rng, vocab, dtype, max_k, q_style, cycle[i % len(cycle)],
                                      num_drafts(i), style(i)) for i in range(n)])


def coverage(batch: Batch, want: list[list[int]]) -> set[str]:
    """Which outcomes the reference produced: proof that a comparison is not vacuous."""
    seen = set()
    for r, out in zip(batch.requests, want):
        n = len(out) - 1
        kind = "greedy" if r.greedy else "random"
        if r.num_drafts == 0:
            seen.add("no_drafts")
        elif n == r.num_drafts:
            seen.add(f"{kind}_all_accepted")
        else:
            seen.add(f"{kind}_rejected")
            if not r.greedy and n > 0:
                seen.add("partial")
    return seen


@pytest.mark.parametrize("q_style", ["probs", "onehot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["standard", "synthetic"])
def test_matches_reference(method: str, dtype: torch.dtype, q_style: str) -> None:
    batch = case("v1", dtype, q_style, n=24)
    want = reference_outputs(batch, method)
    assert coverage(batch, want) >= {"no_drafts", "random_all_accepted", "random_rejected",
                                     "greedy_rejected", "partial"}
    assert_matches_reference(v1_run(batch, method), batch, want)


def edge_batch(dtype: torch.dtype) -> tuple[Batch, list[int]]:
    """Requests whose standard outcome is known without the oracle, with the expected
    number of accepted drafts: greedy drafts = argmax (all accepted); q == p (every ratio
    is 1: all accepted); p(d) = 1 under top_k = 1 (all accepted, one-hot q); a first
    draft that top_k excludes (p(d) = 0: rejected at once, whatever the rest)."""
    rng = np.random.default_rng(99)
    reqs, expect = [], []
    for params, q_style, k in (("greedy", "onehot", 3), ("temperature", "equal", 4),
                               ("hot", "equal", 2), ("top_k", "equal", 3)):
        r = random_request(rng, VOCAB, dtype, 4, q_style, params, k)
        if params == "greedy":
            r.draft_token_ids = [int(np.argmax(x)) for x in r.logits[:k]]
        reqs.append(r)
        expect.append(k)
    sp1 = SamplingParams(seed=5, max_tokens=8, temperature=1.0, top_k=1)
    r = random_request(rng, VOCAB, dtype, 3, "onehot", "temperature", 3)
    r.params, r.seed = sp1, sp1.seed
    r.draft_token_ids = [int(np.argmax(x)) for x in r.logits[:3]]
    reqs.append(r)
    expect.append(3)
    for q_style in ("onehot", "probs"):  # q(d) > 0 (q(d) == 0 would accept)
        r = random_request(rng, VOCAB, dtype, 3, q_style, "top_k", 3)
        r.draft_token_ids[0] = int(np.argmin(r.logits[0]))  # outside the top 6
        reqs.append(r)
        expect.append(0)
    reqs.append(random_request(rng, VOCAB, dtype, 0, "equal", "top_p", 0))  # no drafts
    expect.append(0)
    # one batch needs one q style: one-hot requests get q = one-hot rows explicitly
    for r in reqs:
        if r.draft_probs is None:
            r.draft_probs = np.eye(VOCAB)[r.draft_token_ids].reshape(-1, VOCAB)
    return make_batch(reqs), expect


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constructed_edges(dtype: torch.dtype) -> None:
    batch, expect = edge_batch(dtype)
    want = reference_outputs(batch, "standard")
    assert [len(w) - 1 for w in want] == expect  # the oracle agrees with the construction
    out = v1_run(batch, "standard")
    assert out.num_accepted.tolist() == expect
    assert_matches_reference(out, batch, want)
    # the rejected draft is never the recovered token (residual = p without the draft's mass)
    for i in np.flatnonzero(np.array(expect) == 0):
        r = batch.requests[i]
        if r.num_drafts:
            assert want[i][0] != r.draft_token_ids[0]


def test_all_greedy_and_no_drafts() -> None:
    rng = np.random.default_rng(3)
    reqs = [random_request(rng, VOCAB, torch.float32, 3, "onehot", "greedy") for _ in range(6)]
    reqs.append(random_request(rng, VOCAB, torch.float32, 0, "onehot", "greedy", 0))
    batch = make_batch(reqs)
    assert_matches_reference(v1_run(batch, "standard"), batch,
                             reference_outputs(batch, "standard"))
    batch = make_batch([random_request(rng, VOCAB, torch.float32, 0, "onehot", None, 0)
                        for _ in range(5)])
    out = v1_run(batch, "standard")
    assert out.output_token_ids.shape == (5, 1) and out.num_sampled.tolist() == [1] * 5
    assert_matches_reference(out, batch, reference_outputs(batch, "standard"))


def test_no_drafts_is_normal_sampling() -> None:
    """k = 0: bit for bit the token of the normal V1 sampler."""
    from runner_v1.sampler import Sampler

    batch = case("k0", torch.float32, "onehot", n=16, max_k=0)
    md = batch.metadata()
    normal = Sampler()(batch.logits, md, batch.positions).sampled_token_ids
    out = v1_run(batch, "standard")
    assert torch.equal(out.output_token_ids[:, 0], normal)


def test_block_is_refused_by_name() -> None:
    batch = case("block", torch.float32, "probs", n=3)
    with pytest.raises(ValueError, match="rejection_sample_method='block'.*V2-only"):
        v1_run(batch, "block")
    with pytest.raises(ValueError, match="unknown"):
        v1_run(batch, "strictest")


@pytest.mark.parametrize("field,value,what", [
    ("repetition_penalty", torch.ones(3), "penalties"),
    ("min_tokens_stop_ids", {0: [1]}, "min_tokens"),
    ("max_num_logprobs", 2, "logprobs"),
])
def test_unsupported_features_are_refused(field: str, value, what: str) -> None:
    batch = case("unsupported", torch.float32, "probs", n=3)
    md = batch.metadata()
    setattr(md, field, value)
    with pytest.raises(ValueError, match=what):
        rejection_sample(batch.logits, md, batch.positions, batch.num_draft_tokens,
                         batch.draft_token_ids, batch.draft_probs, "standard")


def test_synthetic_needs_a_rate_per_position() -> None:
    batch = case("rates", torch.float32, "probs", n=6)
    with pytest.raises(ValueError, match="rate per draft position"):
        v1_run(batch, "synthetic", rates=(0.5,))
