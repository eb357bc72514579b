"""V1 PyTorch sampler vs the NumPy reference (tests/oracles/sampling_reference.py)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch

from runner_v1.sampler import Sampler, filter_threshold, greedy_argmax
from runner_v1.sampling_metadata import SamplingMetadata
from shared.contract.sampling_params import SamplingParams
from tests.oracles.sampling_reference import keep_mask, reference_sample_row

VOCAB = 96
EOS = 3


@dataclass
class Row:
    """One request as the sampler sees it this step."""

    params: SamplingParams  # with a seed
    prompt: list[int]
    outputs: list[int] = field(default_factory=list)
    eos: int | None = EOS

    @property
    def pos(self) -> int:  # position of the input token of this step's logit
        return len(self.prompt) + len(self.outputs) - 1

    def min_tokens_stop_ids(self) -> list[int]:
        sp = self.params
        if self.pos + 1 - len(self.prompt) >= sp.min_tokens:
            return []
        ids = list(sp.stop_token_ids)
        if self.eos is not None and not sp.ignore_eos:
            ids.append(self.eos)
        return ids


def make_metadata(rows: list[Row], vocab_size: int) -> tuple[SamplingMetadata, torch.Tensor]:
    """What runner_v1's PersistentBatch builds, written out directly for the test."""
    sps = [r.params for r in rows]

    def f32(vals):
        return torch.tensor(vals, dtype=torch.float32)

    temperature = f32([sp.temperature for sp in sps])
    any_pen = any(sp.uses_penalties for sp in sps)
    prompt = None
    if any_pen:
        width = max(len(r.prompt) for r in rows)
        prompt = torch.full((len(rows), width), vocab_size, dtype=torch.int64)
        for i, r in enumerate(rows):
            prompt[i, : len(r.prompt)] = torch.tensor(r.prompt)
    max_n = max((sp.logprobs for sp in sps if sp.logprobs is not None), default=None)
    stop = {i: r.min_tokens_stop_ids() for i, r in enumerate(rows) if r.min_tokens_stop_ids()}
    md = SamplingMetadata(
        num_reqs=len(rows),
        temperature=temperature,
        all_greedy=bool((temperature == 0).all()),
        all_random=bool((temperature != 0).all()),
        top_k=torch.tensor([sp.top_k for sp in sps], dtype=torch.int32)
        if any(sp.top_k > 0 for sp in sps) else None,
        top_p=f32([sp.top_p for sp in sps]) if any(sp.top_p < 1 for sp in sps) else None,
        min_p=f32([sp.min_p for sp in sps]) if any(sp.min_p > 0 for sp in sps) else None,
        seeds=torch.tensor([sp.seed for sp in sps], dtype=torch.int64),
        presence_penalty=f32([sp.presence_penalty for sp in sps]) if any_pen else None,
        frequency_penalty=f32([sp.frequency_penalty for sp in sps]) if any_pen else None,
        repetition_penalty=f32([sp.repetition_penalty for sp in sps]) if any_pen else None,
        prompt_token_ids=prompt,
        output_token_ids=[r.outputs for r in rows],
        num_logprobs=[-1 if sp.logprobs is None else sp.logprobs for sp in sps],
        max_num_logprobs=max_n,
        min_tokens_stop_ids=stop,
    )
    positions = torch.tensor([r.pos for r in rows], dtype=torch.int64)
    return md, positions


def random_rows(rng: np.random.Generator, n: int, vocab_size: int, **overrides) -> list[Row]:
    rows = []
    for _ in range(n):
        prompt = rng.integers(0, vocab_size, rng.integers(1, 12)).tolist()
        outputs = rng.integers(0, vocab_size, rng.integers(0, 10)).tolist()
        sp = SamplingParams(seed=int(rng.integers(0, 2**63)), max_tokens=64, **overrides)
        rows.append(Row(sp, prompt, outputs))
    return rows


def check_against_reference(logits: torch.Tensor, rows: list[Row], out) -> None:
    n_lp = max((r.params.logprobs or 0) for r in rows)
    for i, r in enumerate(rows):
        ref = reference_sample_row(
            logits[i].numpy(), r.params, r.params.seed, r.pos, r.prompt, r.outputs, r.eos
        )
        assert int(out.sampled_token_ids[i]) == ref.token_id, f"row {i}"
        if r.params.logprobs is None:
            continue
        tol = 1e-12 if logits.dtype == torch.float64 else 1e-5
        assert int(out.ranks[i]) == ref.rank
        assert out.logprob_token_ids[i, 0] == ref.token_id
        assert out.logprobs[i, 0].item() == pytest.approx(ref.logprob, abs=tol)
        n = r.params.logprobs
        assert out.logprob_token_ids[i, 1 : 1 + n].tolist() == ref.top_token_ids
        np.testing.assert_allclose(out.logprobs[i, 1 : 1 + n].numpy(), ref.top_logprobs, atol=tol)
        assert out.logprobs.shape == (len(rows), 1 + n_lp)


FEATURES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "hot": dict(temperature=2.5),
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=1.0, top_p=0.6),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "all_filters": dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05),
    "repetition": dict(temperature=1.0, repetition_penalty=1.7),
    "repetition_greedy": dict(temperature=0.0, repetition_penalty=0.6),
    "frequency": dict(temperature=1.0, frequency_penalty=2.0),
    "presence": dict(temperature=0.0, presence_penalty=-1.2),
    "all_penalties": dict(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4,
                          presence_penalty=0.7, top_k=10),
    "min_tokens": dict(temperature=1.0, min_tokens=6, stop_token_ids=[5, 7]),
    "min_tokens_greedy": dict(temperature=0.0, min_tokens=6, stop_token_ids=[9]),
    "min_tokens_ignore_eos": dict(temperature=0.0, min_tokens=6, ignore_eos=True),
    "logprobs": dict(temperature=1.0, logprobs=4),
    "logprobs_greedy": dict(temperature=0.0, logprobs=0),
}
# the features whose removal must change some token (proof that the test exercises them)
SENSITIVE = {"top_k", "top_p", "min_p", "all_filters", "repetition", "repetition_greedy",
             "frequency", "presence", "all_penalties", "min_tokens", "min_tokens_greedy"}


def feature_case(feature: str, dtype: torch.dtype, n: int = 24):
    """Rows using `feature`, plus plain random and greedy rows (per-row parameters must
    not leak between rows), and logits where the feature matters."""
    rng = np.random.default_rng(zlib.crc32(feature.encode()))
    rows = random_rows(rng, n, VOCAB, **FEATURES[feature])
    rows += random_rows(rng, 2, VOCAB, temperature=1.0) + random_rows(rng, 1, VOCAB, temperature=0.0)
    logits = rng.normal(0, 3, (len(rows), VOCAB))
    if feature.startswith("min_tokens"):
        logits[:, [EOS, 5, 7, 9]] += 12.0  # the masked ids would win otherwise
    if FEATURES[feature].keys() & {"repetition_penalty", "frequency_penalty", "presence_penalty"}:
        for i, r in enumerate(rows):
            r.outputs = r.outputs * 2  # counts of 2: frequency and presence differ
            logits[i, r.outputs] += 6.0  # the penalised tokens would win otherwise
    return rows, torch.from_numpy(logits).to(dtype)


def stripped(row: Row) -> Row:
    """The row with every optional feature off (same seed and temperature)."""
    sp = row.params
    return replace(row, params=SamplingParams(seed=sp.seed, temperature=sp.temperature,
                                              max_tokens=sp.max_tokens, ignore_eos=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_matches_reference(feature: str, dtype: torch.dtype) -> None:
    rows, logits = feature_case(feature, dtype)
    md, positions = make_metadata(rows, VOCAB)
    out = Sampler()(logits, md, positions)
    check_against_reference(logits, rows, out)
    if feature in SENSITIVE:
        plain = [stripped(r) for r in rows]
        md_plain, _ = make_metadata(plain, VOCAB)
        plain_out = Sampler()(logits, md_plain, positions)
        assert not torch.equal(plain_out.sampled_token_ids, out.sampled_token_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("feature", ["top_k", "top_p", "min_p", "all_filters"])
def test_keep_mask_matches_reference(feature: str, dtype: torch.dtype) -> None:
    """The filters alone, token by token (independent of which token the noise picks),
    on a larger vocabulary so that many tokens sit near each boundary."""
    rows = feature_case(feature, dtype)[0]
    rng = np.random.default_rng(zlib.crc32(feature.encode()) + 1)
    logits = torch.from_numpy(rng.normal(0, 1, (len(rows), 512))).to(dtype)
    md, _ = make_metadata(rows, 512)
    temp = md.temperature.to(dtype)
    scaled = logits / torch.where(temp == 0, torch.ones_like(temp), temp)[:, None]
    keep = scaled >= filter_threshold(scaled, md)[:, None]
    for i, r in enumerate(rows):
        if r.params.temperature != 0:
            assert keep[i].tolist() == keep_mask(scaled[i].numpy(), r.params).tolist(), i


@pytest.mark.parametrize("params", [
    dict(temperature=0.0), dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.5),
    dict(temperature=1.0, top_p=0.3, top_k=4), dict(temperature=0.5, min_p=0.5),
])
def test_ties_match_reference(params: dict) -> None:
    """Logits on a coarse grid: many exact ties at the top-k / top-p boundaries."""
    rng = np.random.default_rng(7)
    rows = random_rows(rng, 24, VOCAB, **params)
    logits = torch.from_numpy(rng.integers(-3, 3, (len(rows), VOCAB)) * 0.5).float()
    md, positions = make_metadata(rows, VOCAB)
    check_against_reference(logits, rows, Sampler()(logits, md, positions))


def test_same_seed_and_position_same_token_anywhere_in_the_batch() -> None:
    rng = np.random.default_rng(3)
    target = Row(SamplingParams(seed=2**63 - 1, temperature=1.3, top_k=30, top_p=0.9,
                                repetition_penalty=1.2, logprobs=2), [1, 2, 3], [4, 5])
    target_logits = torch.from_numpy(rng.normal(0, 1, VOCAB)).float()
    alone = Sampler()(target_logits[None], *make_metadata([target], VOCAB))
    others = random_rows(rng, 7, VOCAB, temperature=0.9, min_p=0.1, frequency_penalty=0.5)
    for at in (0, 3, 7):
        rows = others[:at] + [target] + others[at:]
        logits = torch.from_numpy(rng.normal(0, 1, (len(rows), VOCAB))).float()
        logits[at] = target_logits
        out = Sampler()(logits, *make_metadata(rows, VOCAB))
        assert out.sampled_token_ids[at] == alone.sampled_token_ids[0]
        assert torch.equal(out.logprobs[at, :3], alone.logprobs[0])


# ---- distribution --------------------------------------------------------------------

# chi-square critical values at p = 0.001 (degrees of freedom -> value)
CHI2_CRIT_001 = {2: 13.816, 3: 16.266, 7: 24.322}


def draw_counts(probs_logits: torch.Tensor, num_draws: int, **params) -> np.ndarray:
    """Sample one row at positions 0..num_draws-1 (independent noise per position)."""
    sp = SamplingParams(seed=1234, **params)
    rows = [Row(sp, [0], [])] * num_draws
    md, _ = make_metadata(rows, probs_logits.shape[0])
    positions = torch.arange(num_draws, dtype=torch.int64)
    out = Sampler()(probs_logits.expand(num_draws, -1).contiguous(), md, positions)
    return np.bincount(out.sampled_token_ids.numpy(), minlength=probs_logits.shape[0])


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a filtered-out token was sampled"
    expected = counts.sum() * probs[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum())


LOGITS8 = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 1.2, 0.7])


def test_frequencies_follow_softmax() -> None:
    t = 0.8
    probs = torch.softmax(LOGITS8 / t, dim=0).numpy()
    counts = draw_counts(LOGITS8, 6000, temperature=t)
    assert chi2(counts, probs) < CHI2_CRIT_001[7]


def test_frequencies_follow_renormalised_top_k() -> None:
    probs = torch.softmax(LOGITS8, dim=0).numpy()
    probs[np.argsort(-probs)[3:]] = 0.0
    probs /= probs.sum()
    counts = draw_counts(LOGITS8, 4000, temperature=1.0, top_k=3)
    assert chi2(counts, probs) < CHI2_CRIT_001[2]


def test_chi_square_rejects_uniform_noise(monkeypatch) -> None:
    """The distribution test has teeth: a sampler using uniform instead of Gumbel
    noise (argmax of l + u) must fail it."""
    import runner_v1.sampler as v1
    from shared.sampling.noise import uniform

    def wrong_noise(seeds, positions, vocab_size):
        ids = torch.arange(vocab_size, dtype=torch.int64)
        return uniform(seeds[:, None], positions[:, None], ids[None, :])

    monkeypatch.setattr(v1, "gumbel_noise", wrong_noise)
    t = 0.8
    probs = torch.softmax(LOGITS8 / t, dim=0).numpy()
    counts = draw_counts(LOGITS8, 6000, temperature=t)
    assert chi2(counts, probs) > CHI2_CRIT_001[7]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_greedy_needs_no_positions_and_matches_numpy(dtype):
    """All-greedy rows without penalties, min_tokens or logprobs take the short path (no
    float32 copy, no positions): the first maximum of each row, as np.argmax finds it on
    the float32 values, ties included (bf16 rounding makes several columns equal)."""
    rows = [Row(SamplingParams(temperature=0.0, seed=s), prompt=[5, 6, 7]) for s in range(4)]
    md, _ = make_metadata(rows, VOCAB)
    assert md.all_greedy and md.repetition_penalty is None and not md.min_tokens_stop_ids
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(len(rows), VOCAB, generator=gen) * 0.02).to(dtype)
    logits[2, [9, 40, 70]] = 5.0  # a three-way tie at the top: the first one wins
    out = Sampler()(logits, md, None)
    expected = np.argmax(logits.float().numpy(), axis=1)
    assert out.sampled_token_ids.tolist() == expected.tolist()
    assert out.sampled_token_ids[2].item() == 9 and out.logprobs is None
    # greedy with logprobs takes the full path, still without positions
    with_logprobs = Sampler()(logits, replace(md, max_num_logprobs=2), None)
    assert with_logprobs.sampled_token_ids.tolist() == expected.tolist()
    assert with_logprobs.logprobs is not None
    # with a random row in the batch the positions are required again
    mixed = replace(md, all_greedy=False)
    with pytest.raises(AssertionError):
        Sampler()(logits, mixed, None)


@pytest.mark.parametrize("vocab", [96, 97, 128256, 1000, 7 * 11 * 13])
def test_greedy_argmax_is_the_first_maximum(vocab):
    """The two-stage argmax against np.argmax (first maximum), with ties inside a chunk,
    across chunks and at both ends of the row; 97 is prime (one chunk)."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=gen).to(torch.bfloat16).float()
    x[1, [vocab - 1, vocab - 2]] = 9.0  # tie at the end
    x[2, [0, vocab // 2, vocab - 1]] = 9.0  # tie across the row: index 0 wins
    x[3, :] = 1.0  # every column equal
    x[4, [3, 4]] = 9.0  # neighbours inside one chunk
    got = greedy_argmax(x)
    assert got.tolist() == np.argmax(x.numpy(), axis=1).tolist()
    assert got.dtype == torch.int64 and got.shape == (5,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_sample_as_their_float32_widening(dtype):
    """Random rows (top-k / top-p / min-p on some) straight from half-precision logits take
    no float32 copy: the tokens must be those of the exactly widened float32 logits. 256
    rows of logits near 50, where the half dtype's spacing is coarse next to the gaps
    between Gumbel scores: scaling in the half dtype instead flips some of them."""
    kinds = [(0.7, 0, 1.0, 0.0), (1.3, 20, 1.0, 0.0), (0.9, 0, 0.8, 0.0), (0.0, 0, 1.0, 0.0),
             (1.1, 0, 1.0, 0.05), (0.6, 0, 1.0, 0.0), (0.3, 0, 1.0, 0.0), (1.7, 0, 1.0, 0.0)]
    rows = [Row(SamplingParams(temperature=t, seed=s, top_k=k, top_p=p, min_p=m), prompt=[5])
            for s, (t, k, p, m) in enumerate(kinds * 32)]
    md, positions = make_metadata(rows, VOCAB)
    gen = torch.Generator().manual_seed(5)
    logits = (50 + torch.randn(len(rows), VOCAB, generator=gen) * 2).to(dtype)
    got = Sampler()(logits, md, positions).sampled_token_ids
    want = Sampler()(logits.float(), md, positions).sampled_token_ids
    assert got.tolist() == want.tolist()
