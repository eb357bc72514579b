"""V2 Triton sampler (interpreter on CPU) vs the V1 PyTorch sampler on the same logits
and parameters: identical tokens, logprobs within 1e-6 (float32) / 1e-9 (float64),
with idx_mapping permuted and state rows reused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner_v1.sampler import Sampler as V1Sampler
from runner_v1.sampler import apply_min_tokens, apply_penalties, filter_threshold
from runner_v2.sample import Sampler, SamplingStates
from runner_v2.sample.penalties import apply_penalties_and_min_tokens
from runner_v2.sample.top_k_top_p import compute_thresholds
from shared.contract.sampling_params import SamplingParams
from shared.sampling.noise import uniform
from tests.runner_v1.test_sampler import (
    FEATURES,
    VOCAB,
    Row,
    feature_case,
    make_metadata,
    random_rows,
)

MAX_REQS = 16


def v1_sample(rows: list[Row], logits: torch.Tensor):
    md, positions = make_metadata(rows, logits.shape[1])
    return V1Sampler()(logits, md, positions), md.max_num_logprobs


def add_rows(states: SamplingStates, state_rows: list[int], rows: list[Row]) -> None:
    for s, r in zip(state_rows, rows):
        # prefill = prompt + outputs: a request resumed after preemption
        states.add_request(s, r.params, r.prompt, r.prompt + r.outputs, r.eos)
    states.apply_staged_writes()


def v2_sample(states, state_rows, rows, logits, max_num_logprobs, pass_np=True):
    idx_np = np.asarray(state_rows, dtype=np.int32)
    positions = torch.tensor([r.pos for r in rows], dtype=torch.int64)
    return Sampler(states)(
        logits,
        torch.from_numpy(idx_np),
        positions,
        max_num_logprobs,
        idx_mapping_np=idx_np if pass_np else None,
    )


def assert_same(v2, v1) -> None:
    assert torch.equal(v2.sampled_token_ids, v1.sampled_token_ids)
    if v1.logprobs is None:
        assert v2.logprobs is None
        return
    tol = 1e-9 if v1.logprobs.dtype == torch.float64 else 1e-6
    assert v2.logprobs.dtype == v1.logprobs.dtype
    assert torch.equal(v2.logprob_token_ids, v1.logprob_token_ids)
    assert torch.equal(v2.ranks, v1.ranks)
    torch.testing.assert_close(v2.logprobs, v1.logprobs, atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_matches_v1(feature: str, dtype: torch.dtype) -> None:
    rows, logits = feature_case(feature, dtype, n=5)
    v1, max_n = v1_sample(rows, logits)
    state_rows = np.random.default_rng(len(feature)).permutation(MAX_REQS)[: len(rows)].tolist()
    states = SamplingStates(MAX_REQS, VOCAB, "cpu")
    add_rows(states, state_rows, rows)
    assert_same(v2_sample(states, state_rows, rows, logits, max_n), v1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_processed_logits_bit_identical_to_v1(dtype: torch.dtype) -> None:
    """The penalties + min_tokens kernel alone: exact equality, on rows where every
    penalty and the min_tokens mask change values (independent of sampling luck)."""
    rows = []
    for f in (
        "all_penalties",
        "repetition",
        "frequency",
        "presence",
        "min_tokens",
        "min_tokens_ignore_eos",
        "temperature",
    ):
        rows += feature_case(f, dtype, n=1)[0][:1]
    logits = feature_case("all_penalties", dtype, n=len(rows))[1][: len(rows)]
    md, positions = make_metadata(rows, VOCAB)
    want = apply_min_tokens(apply_penalties(logits, md), md)
    assert not torch.equal(want, logits)
    states = SamplingStates(MAX_REQS, VOCAB, "cpu")
    state_rows = list(range(len(rows)))[::-1]
    add_rows(states, state_rows, rows)
    idx = torch.tensor(state_rows, dtype=torch.int32)
    got = apply_penalties_and_min_tokens(logits, idx, positions, states, True, True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("feature", ["top_k", "top_p", "min_p", "all_filters"])
def test_filter_keeps_same_tokens_as_v1(feature: str, dtype: torch.dtype) -> None:
    """The threshold kernel alone: the kept set equals V1's on every row, and the
    filter does remove tokens (so the comparison is not vacuous)."""
    vocab = 512  # many tokens near each boundary
    rows = feature_case(feature, dtype, n=4)[0]
    rng = np.random.default_rng(len(feature))
    logits = torch.from_numpy(rng.normal(0, 1, (len(rows), vocab))).to(dtype)
    md, _ = make_metadata(rows, vocab)
    temp = md.temperature.to(dtype)
    scaled = logits / torch.where(temp == 0, torch.ones_like(temp), temp)[:, None]
    keep_v1 = scaled >= filter_threshold(scaled, md)[:, None]
    states = SamplingStates(MAX_REQS, vocab, "cpu")
    state_rows = [3, 0, 9, 5, 1, 14, 7]
    add_rows(states, state_rows, rows)
    thr = compute_thresholds(logits, torch.tensor(state_rows, dtype=torch.int32),
                             states.temperature, states.top_k, states.top_p, states.min_p)
    keep_v2 = scaled >= thr[:, None]
    is_random = md.temperature != 0
    assert torch.equal(keep_v2[is_random], keep_v1[is_random])
    assert not keep_v1[:4].all(dim=1).any()


def test_min_tokens_boundary() -> None:
    """Masked while num_outputs = pos + 1 - prompt_len < min_tokens, not after."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 5.0  # the stop id would win
    logits[:, 3] = 4.0  # then EOS
    sp = SamplingParams(seed=1, temperature=0.0, min_tokens=3, stop_token_ids=[7])
    rows = [Row(sp, [1, 2], [5] * n, eos=3) for n in (2, 3)]
    rows.append(Row(SamplingParams(seed=1, temperature=0.0, min_tokens=3, stop_token_ids=[7],
                                   ignore_eos=True), [1, 2], [5, 5]))
    states = SamplingStates(MAX_REQS, VOCAB, "cpu")
    add_rows(states, [0, 1, 2], rows)
    out = v2_sample(states, [0, 1, 2], rows, logits, None)
    assert out.sampled_token_ids.tolist() == [0, 7, 3]


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=3),
        dict(temperature=1.0, top_p=0.5),
        dict(temperature=1.0, top_p=0.3, top_k=4, min_p=0.2),
    ],
)
def test_ties_match_v1(params: dict) -> None:
    """Logits on a coarse grid: exact ties at the argmax and at the filter boundaries."""
    rng = np.random.default_rng(7)
    rows = random_rows(rng, 6, VOCAB, **params)
    logits = torch.from_numpy(rng.integers(-3, 3, (len(rows), VOCAB)) * 0.5).float()
    states = SamplingStates(MAX_REQS, VOCAB, "cpu")
    state_rows = [4, 15, 0, 8, 2, 6]
    add_rows(states, state_rows, rows)
    assert_same(v2_sample(states, state_rows, rows, logits, None), v1_sample(rows, logits)[0])


def test_near_ties_of_noisy_scores_match_v1_and_reference() -> None:
    """float64 logits built so that each row's best score (logit + noise) ties, to the
    last bit, with a rival at a vocab id where the platform log (libm) and the spec's nlog
    round the noise differently. A runner whose noise came from the platform log would
    flip such rows (checked below, so the test has teeth); the runners agree."""
    from shared.sampling.noise import torch_gumbel_noise
    from tests.oracles.sampling_reference import reference_sample_row

    vocab, n = 4096, 8
    rng = np.random.default_rng(13)
    rows = [Row(SamplingParams(temperature=1.0, seed=int(rng.integers(2**62))),
                prompt=[int(t) for t in rng.integers(4, vocab, 5)]) for _ in range(n)]
    seeds = torch.tensor([r.params.seed for r in rows], dtype=torch.int64)
    positions = torch.tensor([r.pos for r in rows], dtype=torch.int64)
    noise = torch_gumbel_noise(seeds, positions, vocab)
    u = uniform(seeds[:, None], positions[:, None], torch.arange(vocab)[None, :])
    libm_noise = -torch.log(-torch.log(u))
    differs = noise != libm_noise
    rival = differs.to(torch.int64).argmax(dim=1)  # the first id the two logs round apart
    assert differs.gather(1, rival[:, None]).all()
    # Every other token is out of the race; the rival's score is its noise, exactly (logit
    # 0); a partner's logit is nudged until its score equals the rival's to the last bit.
    logits = torch.full((n, vocab), -1000.0, dtype=torch.float64)
    for i in range(n):
        r, b = int(rival[i]), (int(rival[i]) + 1 + i) % vocab
        target, nb = noise[i, r], noise[i, b]
        lb = target - nb
        for _ in range(8):
            if lb + nb == target:
                break
            lb = torch.nextafter(lb, target - nb + (target - (lb + nb)) * 2)
        logits[i, r], logits[i, b] = 0.0, lb
    tied = (logits + noise).max(dim=1).values == noise.gather(1, rival[:, None])[:, 0]
    assert tied.sum() >= n // 2  # near-ties built for most rows
    flipped = (logits + libm_noise).argmax(dim=1) != (logits + noise).argmax(dim=1)
    assert flipped.any()  # the platform log would have changed some row's token
    states = SamplingStates(MAX_REQS, vocab, "cpu")
    state_rows = [3, 9, 0, 12, 5, 1, 7, 14]
    add_rows(states, state_rows, rows)
    v1 = v1_sample(rows, logits)[0]
    assert_same(v2_sample(states, state_rows, rows, logits, None), v1)
    for i, r in enumerate(rows):
        ref = reference_sample_row(logits[i].numpy(), r.params, r.params.seed, r.pos,
                                   r.prompt, r.outputs, r.eos)
        assert int(v1.sampled_token_ids[i]) == ref.token_id, f"row {i}"


def test_bf16_logits_match_v1() -> None:
    rows, logits = feature_case("all_penalties", torch.float32, n=3)
    rows[0].params.logprobs = 3
    logits = logits.to(torch.bfloat16)
    v1, max_n = v1_sample(rows, logits)
    states = SamplingStates(MAX_REQS, VOCAB, "cpu")
    add_rows(states, [7, 2, 9, 0, 4, 11], rows)
    assert_same(v2_sample(states, [7, 2, 9, 0, 4, 11], rows, logits, max_n), v1)


def test_without_host_idx_mapping_same_result() -> None:
    """Stage flags from every written row (stale ones included) change nothing."""
    rows, logits = feature_case("all_filters", torch.float32, n=3)
    states = SamplingStates(MAX_REQS, VOCAB, "cpu")
    stale = feature_case("min_tokens", torch.float32, n=2)[0]
    add_rows(states, [12, 13], stale)  # rows that are not in this batch
    add_rows(states, [5, 1, 3, 8, 0, 2], rows)
    v1, max_n = v1_sample(rows, logits)
    assert_same(v2_sample(states, [5, 1, 3, 8, 0, 2], rows, logits, max_n, pass_np=False), v1)


def test_reused_row_sees_nothing_of_its_previous_request() -> None:
    rng = np.random.default_rng(11)
    logits = torch.from_numpy(rng.normal(0, 3, (3, VOCAB))).float()
    a = Row(
        SamplingParams(
            seed=1,
            temperature=0.5,
            top_k=2,
            min_p=0.3,
            repetition_penalty=2.0,
            frequency_penalty=2.0,
            presence_penalty=2.0,
            min_tokens=9,
            stop_token_ids=[int(logits[0].argmax())],
            logprobs=3,
        ),
        prompt=[1, 2, 3],
        outputs=[4, 4, 5],
    )
    b = Row(SamplingParams(seed=2, temperature=1.1), prompt=[9, 8], outputs=[4])
    b_pen = Row(SamplingParams(seed=3, temperature=0.0, presence_penalty=1.5), [1, 9], [5, 6])
    other = Row(
        SamplingParams(seed=4, temperature=1.0, frequency_penalty=0.5, min_tokens=5, top_p=0.7),
        prompt=[7],
        outputs=[2, 3],
    )
    states = SamplingStates(MAX_REQS, VOCAB, "cpu")
    add_rows(states, [3, 6], [a, other])
    assert_same(
        v2_sample(states, [3, 6], [a, other], logits[:2], 3), v1_sample([a, other], logits[:2])[0]
    )
    # A leaves (nothing is cleared); B takes row 3 while `other` keeps penalty and
    # min_tokens kernels running for the batch
    add_rows(states, [3], [b])
    v1, _ = v1_sample([other, b], logits[1:])
    assert_same(v2_sample(states, [6, 3], [other, b], logits[1:], None), v1)
    # B' with penalties of its own in row 3: its bins hold its tokens only
    add_rows(states, [3], [b_pen])
    assert states.output_bin_counts[3].sum() == 2 and states.output_bin_counts[3, 4] == 0
    v1, _ = v1_sample([b_pen, other], logits[:2])
    assert_same(v2_sample(states, [3, 6], [b_pen, other], logits[:2], None), v1)


def test_readd_before_apply_last_request_wins() -> None:
    rng = np.random.default_rng(12)
    logits = torch.from_numpy(rng.normal(0, 3, (1, VOCAB))).float()
    a = Row(SamplingParams(seed=5, temperature=0.0, repetition_penalty=3.0), [1, 2], [3])
    b = Row(SamplingParams(seed=6, temperature=0.8, top_k=4), [5], [6, 7])
    states = SamplingStates(MAX_REQS, VOCAB, "cpu")
    states.add_request(2, a.params, a.prompt, a.prompt + a.outputs, a.eos)
    states.add_request(2, b.params, b.prompt, b.prompt + b.outputs, b.eos)
    states.apply_staged_writes()
    assert_same(v2_sample(states, [2], [b], logits, None), v1_sample([b], logits)[0])


def test_output_bin_counts_layout_for_post_update() -> None:
    """post_update adds 1 at output_bin_counts[state_row, token] per sampled token:
    doing that by hand must equal V1 with the token appended to the outputs."""
    rng = np.random.default_rng(13)
    logits = torch.from_numpy(rng.normal(0, 2, (2, VOCAB))).float()
    r0 = Row(SamplingParams(seed=7, temperature=0.0, frequency_penalty=2.0), [1, 2], [3])
    r1 = Row(SamplingParams(seed=8, temperature=0.9, repetition_penalty=1.8), [4], [])
    states = SamplingStates(MAX_REQS, VOCAB, "cpu")
    add_rows(states, [9, 4], [r0, r1])
    top0, top1 = int(logits[0].argmax()), int(logits[1].argmax())
    for state_row, tok in [(9, top0), (9, top0), (4, top1)]:
        states.output_bin_counts[state_row, tok] += 1
    r0.outputs += [top0, top0]
    r1.outputs += [top1]
    v1, _ = v1_sample([r0, r1], logits)
    assert_same(v2_sample(states, [9, 4], [r0, r1], logits, None), v1)


def test_too_many_min_tokens_stop_ids_is_an_error() -> None:
    states = SamplingStates(4, VOCAB, "cpu", max_stop_ids=4)
    sp = SamplingParams(min_tokens=2, stop_token_ids=[10, 11, 12, 13])
    with pytest.raises(ValueError, match="at most 4"):
        states.add_request(0, sp, [1], [1], eos_token_id=2)
    # without min_tokens the stop ids are the scheduler's business, not the table's
    states.add_request(0, SamplingParams(stop_token_ids=list(range(20))), [1], [1], 2)


def test_all_greedy_batch_samples_without_positions() -> None:
    """An all-greedy batch (its state table also holds a random row, outside the batch)
    samples with no positions at all: the first maximum of each row, as V1 and the
    NumPy argmax give it, on a coarse grid full of exact ties."""
    rng = np.random.default_rng(3)
    rows = random_rows(rng, 5, VOCAB, temperature=0.0)
    logits = torch.from_numpy(rng.integers(-2, 2, (len(rows), VOCAB)) * 0.5).float()
    states = SamplingStates(MAX_REQS, VOCAB, "cpu")
    add_rows(states, [9], random_rows(rng, 1, VOCAB, temperature=1.0))
    state_rows = [3, 0, 14, 7, 1]
    add_rows(states, state_rows, rows)
    idx_np = np.asarray(state_rows, np.int32)
    assert states.batch_flags(idx_np).all_greedy
    out = Sampler(states)(logits, torch.from_numpy(idx_np), None, None, idx_mapping_np=idx_np)
    assert out.sampled_token_ids.tolist() == logits.numpy().argmax(axis=1).tolist()
    assert_same(out, v1_sample(rows, logits)[0])


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=0.0, min_tokens=3),
                                    dict(temperature=0.0, presence_penalty=0.5)])
def test_positions_are_required_where_the_sampler_reads_them(params: dict) -> None:
    """Random rows key their noise by position; min_tokens and penalties count outputs
    from it: without positions such a batch is an error, not a silent wrong sample."""
    rng = np.random.default_rng(4)
    rows = random_rows(rng, 2, VOCAB, temperature=0.0) + random_rows(rng, 1, VOCAB, **params)
    states = SamplingStates(MAX_REQS, VOCAB, "cpu")
    add_rows(states, [0, 1, 2], rows)
    idx_np = np.arange(3, dtype=np.int32)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="positions"):
        Sampler(states)(logits, torch.from_numpy(idx_np), None, None, idx_mapping_np=idx_np)
