"""V2's built-in logits processors (allowed_token_ids, logit_bias, bad words) through the
whole Triton sampler (interpreter on CPU) against the NumPy oracle
(tests/oracles/sampling_reference.py): the same token on every row, processed logits
equal to the last bit, float32 and float64, with slots reused as the runner reuses them
and bad words reading the outputs from the RequestState's token table."""

from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from runner_v2.post_update import post_update
from runner_v2.sample import Sampler, SamplingStates
from runner_v2.states import RequestState
from shared.contract.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_TOTAL_TOKENS,
    MAX_LOGIT_BIAS_TOKENS,
    SamplingParams,
)
from tests.oracles.sampling_reference import processed_logits, reference_sample_row
from tests.runner_v1.test_sampler import EOS, VOCAB, Row

MAX_REQS = 8


class Harness:
    """Request and sampling state as the V2 model runner keeps them."""

    def __init__(self, vocab: int = VOCAB, max_model_len: int = 64, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.states = SamplingStates(MAX_REQS, vocab, device)
        self.req_states = RequestState(MAX_REQS, max_model_len, 256, vocab, device)
        self.sampler = Sampler(self.states, self.req_states)
        self.reqs: dict[int, Row] = {}  # state row -> request

    def add(self, req_id: str, req: Row) -> int:
        # as _add_requests: outputs generated before a preemption are in the prefill
        prefill = req.prompt + req.outputs
        row = self.req_states.add_request(req_id, len(req.prompt), prefill, len(prefill))
        self.states.add_request(row, req.params, req.prompt, prefill, req.eos)
        self.reqs[row] = req
        return row

    def add_all(self, reqs: list[Row]) -> list[int]:
        rows = [self.add(f"r{len(self.reqs)}-{i}", r) for i, r in enumerate(reqs)]
        self.apply()
        return rows

    def apply(self) -> None:
        self.req_states.apply_staged_writes()
        self.states.apply_staged_writes()

    def sample(self, rows: list[int], logits: torch.Tensor, pass_np: bool = True):
        """(SamplerOutput, processed logits) for the batch `rows` (batch order)."""
        idx_np = np.asarray(rows, dtype=np.int32)
        idx = torch.from_numpy(idx_np).to(self.device)
        positions = torch.tensor([self.reqs[r].pos for r in rows], dtype=torch.int64,
                                 device=self.device)
        max_n = max((self.reqs[r].params.logprobs for r in rows
                     if self.reqs[r].params.logprobs is not None), default=None)
        flags = self.states.batch_flags(idx_np if pass_np else None)
        x = self.sampler.processed_logits(logits, idx, positions, flags)
        out = self.sampler(logits, idx, positions, max_n, idx_np if pass_np else None)
        return out, x

    def post_update(self, rows: list[int], sampled: torch.Tensor) -> None:
        """The runner's post_update after a decode step: each token appended to the
        token table on the device (and counted for penalties); the host copy follows."""
        n = len(rows)
        idx = torch.tensor(rows, dtype=torch.int32, device=self.device)
        seq_lens = torch.from_numpy(self.req_states.prefill_len_np[rows].astype(np.int32))
        seq_lens = seq_lens.to(self.device)
        qsl = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        post_update(idx, n, sampled.to(self.device), seq_lens, qsl, self.req_states,
                    self.states.output_bin_counts)
        for r, t in zip(rows, sampled.tolist()):
            self.reqs[r].outputs.append(t)


def oracle(logits_row: torch.Tensor, req: Row):
    logits_row = logits_row.cpu()
    raw = logits_row.float().numpy() if logits_row.dtype == torch.bfloat16 else logits_row.numpy()
    ref = reference_sample_row(raw, req.params, req.params.seed, req.pos, req.prompt,
                               req.outputs, req.eos)
    cdt = np.float64 if raw.dtype == np.float64 else np.float32
    want = processed_logits(raw.astype(cdt), req.params, req.pos, req.prompt, req.outputs,
                            req.eos)
    return ref, want


def assert_matches_oracle(h: Harness, rows: list[int], logits: torch.Tensor,
                          pass_np: bool = True) -> list[int]:
    """Tokens equal the oracle's, processed logits bitwise; returns the tokens."""
    out, x = h.sample(rows, logits, pass_np)
    tokens = out.sampled_token_ids.tolist()
    for i, r in enumerate(rows):
        req = h.reqs[r]
        ref, want = oracle(logits[i], req)
        assert tokens[i] == ref.token_id, f"batch row {i}"
        assert x.dtype == (torch.float64 if logits.dtype == torch.float64 else torch.float32)
        assert np.array_equal(x[i].cpu().numpy(), want), f"processed logits of batch row {i}"
        if req.params.logprobs is not None:  # raw logprobs, untouched by the built-ins
            assert int(out.ranks[i]) == ref.rank
            top = out.logprob_token_ids[i, 1:1 + req.params.logprobs]
            # the same top logits (which of two tied ids comes first is topk's choice)
            assert torch.equal(logits[i, top.tolist()], logits[i, ref.top_token_ids])
            tol = 1e-12 if logits.dtype == torch.float64 else 1e-5
            assert out.logprobs[i, 0].item() == pytest.approx(ref.logprob, abs=tol)
    return tokens


def stripped(req: Row) -> Row:
    """The request without its built-ins (everything else kept)."""
    return replace(req, params=replace(req.params, allowed_token_ids=None, logit_bias=None,
                                       bad_words_token_ids=None))


# ---- cases ------------------------------------------------------------------------

SAMPLING = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.0, top_k=10),
            dict(temperature=0.7, top_p=0.8, min_p=0.05)]
PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7,
                 min_tokens=8, stop_token_ids=[5])


def builtin_params(rng: np.random.Generator, feature: str, outputs: list[int]) -> dict:
    kw: dict = {}
    if feature in ("allowed", "all", "all_penalties"):
        ids = rng.choice(VOCAB, int(rng.integers(1, 24)), replace=False).tolist()
        kw["allowed_token_ids"] = ids + [VOCAB + 7]  # an id beyond the vocabulary: ignored
    if feature in ("bias", "all", "all_penalties"):
        ids = rng.choice(VOCAB, int(rng.integers(1, 30)), replace=False).tolist()
        # tenths: not exact in float32, so the widening of float32(bias) is tested
        kw["logit_bias"] = {t: float(rng.integers(-80, 80)) / 10 for t in ids} | {VOCAB + 1: 5.0}
    if feature in ("bad_words", "all", "all_penalties"):
        words = [[int(t)] for t in rng.choice(VOCAB, 3, replace=False)]  # always banned
        for n in (1, 2, 3):  # prefixes equal to the output tail, and near misses
            if len(outputs) >= n:
                words.append(outputs[-n:] + [int(rng.integers(VOCAB))])
                words.append([(outputs[-n] + 1) % VOCAB] + outputs[len(outputs) - n + 1:]
                             + [int(rng.integers(VOCAB))])
        words.append([int(rng.integers(VOCAB)), VOCAB + 3])  # a last id beyond the vocabulary
        kw["bad_words_token_ids"] = words
    return kw


def builtin_case(feature: str, dtype: torch.dtype) -> tuple[list[Row], torch.Tensor]:
    """Six requests with the feature (greedy, random and filtered rows) and two plain
    ones, with logits where the feature matters."""
    rng = np.random.default_rng(zlib.crc32(feature.encode()))
    reqs = []
    for i in range(8):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 8))).tolist()
        outputs = rng.integers(0, VOCAB, int(rng.integers(0, 6))).tolist()
        kw = dict(SAMPLING[i % len(SAMPLING)])
        if feature == "all_penalties":
            kw |= PENALTIES
            outputs = outputs * 2  # counts of 2: frequency and presence differ
        if i < 6:
            kw |= builtin_params(rng, feature, outputs)
        sp = SamplingParams(seed=int(rng.integers(0, 2**63)), max_tokens=32, **kw)
        reqs.append(Row(sp, prompt, outputs))
    logits = rng.normal(0, 3, (len(reqs), VOCAB))
    for i, r in enumerate(reqs):  # what a built-in removes would win otherwise
        sp = r.params
        if sp.allowed_token_ids is not None:
            logits[i, [t for t in range(VOCAB) if t not in sp.allowed_token_ids][:3]] += 9.0
        for w in sp.bad_words_token_ids or []:
            if w[-1] < VOCAB:
                logits[i, w[-1]] += 9.0
    return reqs, torch.from_numpy(logits).to(dtype)


FEATURES = ["allowed", "bias", "bad_words", "all", "all_penalties"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("feature", FEATURES)
def test_builtins_match_oracle(feature: str, dtype: torch.dtype) -> None:
    reqs, logits = builtin_case(feature, dtype)
    h = Harness()
    rows = h.add_all(reqs)
    order = np.random.default_rng(1).permutation(len(rows))  # batch order != row order
    tokens = assert_matches_oracle(h, [rows[i] for i in order], logits[order])
    # non-vacuity: without its built-ins some row samples another token
    plain = [oracle(logits[i], stripped(reqs[i]))[0].token_id for i in order]
    assert plain != tokens


def test_logprobs_and_bf16_logits() -> None:
    """Logprobs stay the raw ones; bf16 logits are processed in float32."""
    reqs, logits = builtin_case("all", torch.float32)
    for r in reqs[:4]:
        r.params.logprobs = 3
    h = Harness()
    rows = h.add_all(reqs)
    assert_matches_oracle(h, rows, logits)
    assert_matches_oracle(h, rows, logits.to(torch.bfloat16))


# ---- non-vacuity, one built-in at a time --------------------------------------------


def greedy(**kw) -> SamplingParams:
    return SamplingParams(seed=1, temperature=0.0, **kw)


def ranked_logits(n: int, order: list[int], dtype=torch.float32) -> torch.Tensor:
    """Logits whose greedy preference is `order` (best first), the rest far below."""
    logits = torch.from_numpy(np.random.default_rng(5).normal(0, 1, (n, VOCAB))).to(dtype)
    for k, t in enumerate(order):
        logits[:, t] = 20.0 - k
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_builtin_changes_the_token(dtype: torch.dtype) -> None:
    reqs = [
        Row(greedy(), [1, 2], [4]),  # control: the raw argmax
        Row(greedy(allowed_token_ids=[60, 41, 11]), [1, 2], [4]),
        Row(greedy(logit_bias={42: 2.5}), [1, 2], [4]),
        Row(greedy(logit_bias={40: -1.5}), [1, 2], [4]),
        Row(greedy(bad_words_token_ids=[[40]]), [1, 2], [4]),
        Row(greedy(bad_words_token_ids=[[4, 40]]), [1, 2], [4]),
        # allowed, then bias: the bias lifts 60 above 41 among the allowed
        Row(greedy(allowed_token_ids=[60, 41], logit_bias={60: 30.0, 40: 50.0}), [1], [4]),
    ]
    h = Harness()
    rows = h.add_all(reqs)
    logits = ranked_logits(len(reqs), [40, 41, 42])
    assert assert_matches_oracle(h, rows, logits.to(dtype)) == [40, 41, 42, 41, 41, 41, 60]


def test_bad_word_prefixes_against_the_output_tail() -> None:
    """Multi-token words: banned only when the OUTPUTS end with the prefix; a prefix
    that would reach into the prompt, or that the prompt alone ends with, bans nothing."""
    word = [7, 8, 40]
    reqs = [
        Row(greedy(bad_words_token_ids=[word]), [1, 2], [5, 7, 8]),  # tail matches
        Row(greedy(bad_words_token_ids=[word]), [1, 2], [5, 7, 9]),  # last differs
        Row(greedy(bad_words_token_ids=[word]), [1, 2], [9, 8]),  # first differs
        Row(greedy(bad_words_token_ids=[word]), [1, 7], [8]),  # reaches into the prompt
        Row(greedy(bad_words_token_ids=[word]), [1, 7, 8], []),  # the prompt's tail
        Row(greedy(bad_words_token_ids=[[8, 40], [8, 41], [3, 42]]), [1], [8, 8]),  # two bans
        Row(greedy(bad_words_token_ids=[[9, 40], word]), [1], [7, 8]),  # the second matches
    ]
    h = Harness()
    rows = h.add_all(reqs)
    logits = ranked_logits(len(reqs), [40, 41, 42])
    assert assert_matches_oracle(h, rows, logits) == [41, 40, 40, 40, 40, 42, 41]


def test_long_bad_word_spans_many_prefix_blocks() -> None:
    """One word of the maximal length: its 1023-token prefix is compared in many
    blocks; a single differing token in the middle lifts the ban."""
    rng = np.random.default_rng(21)
    outputs = rng.integers(0, VOCAB, 1100).tolist()
    n = MAX_BAD_WORDS_TOTAL_TOKENS
    word = outputs[-(n - 1):] + [40]
    near = list(word)
    near[500] = (near[500] + 1) % VOCAB
    reqs = [Row(greedy(bad_words_token_ids=[word]), [1], list(outputs)),
            Row(greedy(bad_words_token_ids=[near]), [1], list(outputs))]
    h = Harness(max_model_len=1200)
    rows = h.add_all(reqs)
    assert assert_matches_oracle(h, rows, ranked_logits(2, [40, 41])) == [41, 40]


def test_bad_words_follow_post_update() -> None:
    """Decode steps with the runner's post_update appending each token to the token
    table on the device: the bans follow the growing outputs."""
    alternate = Row(greedy(bad_words_token_ids=[[40, 40]]), [1, 2], [])
    rng = np.random.default_rng(8)
    noisy = [Row(SamplingParams(seed=s, temperature=1.5, repetition_penalty=1.2,
                                bad_words_token_ids=[[40, 41], [41, 40], [41, 41, 42], [43]]),
                 rng.integers(0, VOCAB, 3).tolist(), [40]) for s in range(3)]
    h = Harness()
    rows = h.add_all([alternate] + noisy)
    logits = ranked_logits(len(rows), [40, 41, 42, 43])
    logits[1:, [40, 41, 42]] = 3.0  # the noise decides among them
    for _ in range(6):
        tokens = assert_matches_oracle(h, rows, logits)
        h.post_update(rows, torch.tensor(tokens, dtype=torch.int64))
    assert alternate.outputs == [40, 41, 40, 41, 40, 41]  # the ban is active every 2nd step
    assert all(43 not in r.outputs for r in noisy)


# ---- slots, flags, allocation ---------------------------------------------------------


def test_reused_slot_applies_nothing_stale() -> None:
    """A slot that held a request with every built-in is re-added with a request without
    them (and then one with smaller ones) while another row keeps every stage running."""
    big = Row(SamplingParams(seed=1, temperature=0.0, allowed_token_ids=list(range(10, 60)),
                             logit_bias={t: -9.5 for t in range(40, 90)},
                             bad_words_token_ids=[[t] for t in range(20, 40)] + [[4, 5, 6]]),
              [1, 2], [4, 5])
    keeper = Row(SamplingParams(seed=2, temperature=0.9, allowed_token_ids=[40, 41, 30, 2],
                                logit_bias={2: 1.5}, bad_words_token_ids=[[5, 41]]), [3], [5])
    h = Harness()
    a, b = h.add_all([big, keeper])
    logits = ranked_logits(2, [21, 30, 45, 70, 2])
    # 21 and 30 are banned words, 45 the best allowed one despite its bias
    assert assert_matches_oracle(h, [a, b], logits)[0] == 45
    h.req_states.remove_request(h.req_states.index_to_req_id[a])
    plain = Row(SamplingParams(seed=3, temperature=0.0), [1, 2], [4, 5])
    assert h.add("plain", plain) == a  # LIFO: the same slot
    h.apply()
    tokens = assert_matches_oracle(h, [b, a], logits.flip(0))
    assert tokens[1] == 21  # nothing of `big` left: the raw argmax
    h.req_states.remove_request("plain")
    small = Row(SamplingParams(seed=4, temperature=0.0, allowed_token_ids=[21, 70],
                               logit_bias={70: 30.0}, bad_words_token_ids=[[5, 21]]),
                [1, 2], [4, 5])
    assert h.add("small", small) == a
    h.apply()
    assert assert_matches_oracle(h, [a, b], logits)[0] == 70


def test_readd_before_apply_last_request_wins() -> None:
    h = Harness()
    first = Row(SamplingParams(seed=1, temperature=0.0, allowed_token_ids=[50],
                               bad_words_token_ids=[[40]]), [1], [2])
    row = h.add("x", first)
    h.req_states.remove_request("x")
    second = Row(SamplingParams(seed=2, temperature=0.0), [1], [2])
    assert h.add("y", second) == row
    h.apply()
    assert h.states.batch_flags(np.array([row], np.int32)).any_builtins is False
    bystander = h.add_all([Row(SamplingParams(seed=3, bad_words_token_ids=[[41]],
                                              allowed_token_ids=[41, 42]), [1], [2])])
    assert assert_matches_oracle(h, [row] + bystander, ranked_logits(2, [40, 41, 42]))[0] == 40


def test_batch_without_builtins_pays_nothing() -> None:
    h = Harness()
    plain = [Row(SamplingParams(seed=i, temperature=t), [1, 2], [3]) for i, t in
             enumerate((0.0, 1.0))]
    rows = h.add_all(plain)
    assert not h.states.logit_bias.allocated and not h.states.bad_words.allocated
    flags = h.states.batch_flags(np.asarray(rows, np.int32))
    assert not flags.any_builtins
    logits = ranked_logits(2, [40, 41])
    idx = torch.tensor(rows, dtype=torch.int32)
    positions = torch.tensor([2, 2])
    assert h.sampler.processed_logits(logits, idx, positions, flags) is logits  # no copy
    assert_matches_oracle(h, rows, logits)
    # tables now exist; a batch of the plain rows still needs none of the stages
    user = h.add_all([Row(SamplingParams(seed=5, logit_bias={1: 1.0},
                                         bad_words_token_ids=[[2]]), [1], [])])
    assert h.states.logit_bias.allocated and h.states.bad_words.allocated
    assert not h.states.batch_flags(np.asarray(rows, np.int32)).any_builtins
    assert h.states.batch_flags(np.asarray(rows + user, np.int32)).any_builtins
    # the stage decision without the host idx_mapping covers every written row
    assert_matches_oracle(h, rows, logits, pass_np=False)
    # a sampler without the token table serves every batch without bad words
    bare = Sampler(h.states)
    out = bare(logits, idx, positions, None, np.asarray(rows, np.int32))
    assert out.sampled_token_ids.tolist() == assert_matches_oracle(h, rows, logits)
    with pytest.raises(ValueError, match="RequestState"):
        bare(logits[:1], torch.tensor(user, dtype=torch.int32), torch.tensor([0]), None,
             np.asarray(user, np.int32))


def test_eager_allocation() -> None:
    h = Harness()
    h.states.ensure_logit_bias_state()
    h.states.ensure_bad_words_state()
    assert h.states.logit_bias.allocated and h.states.bad_words.allocated
    reqs, logits = builtin_case("all", torch.float32)
    rows = h.add_all(reqs)
    assert_matches_oracle(h, rows, logits)


def test_limits_are_refused_at_add() -> None:
    h = Harness()
    kept = Row(greedy(allowed_token_ids=[40]), [1], [2])
    row = h.add_all([kept])[0]
    too_many = [
        dict(allowed_token_ids=list(range(MAX_ALLOWED_TOKEN_IDS + 1))),
        dict(logit_bias={t: 1.0 for t in range(MAX_LOGIT_BIAS_TOKENS + 1)}),
        dict(bad_words_token_ids=[[t] for t in range(MAX_BAD_WORDS + 1)]),
        dict(bad_words_token_ids=[list(range(MAX_BAD_WORDS_TOTAL_TOKENS + 1))]),
    ]
    for kw in too_many:
        with pytest.raises(ValueError, match="at most"):
            h.states.add_request(row, greedy(**kw), [1], [1, 2], EOS)
    # the refused adds left the row's request in place
    h.apply()
    assert assert_matches_oracle(h, [row], ranked_logits(1, [41, 40])) == [40]
    # exactly at the limits is accepted
    at_limit = greedy(allowed_token_ids=list(range(MAX_ALLOWED_TOKEN_IDS)),
                      logit_bias={t: 0.5 for t in range(MAX_LOGIT_BIAS_TOKENS)},
                      bad_words_token_ids=[[t] * (MAX_BAD_WORDS_TOTAL_TOKENS // MAX_BAD_WORDS)
                                           for t in range(MAX_BAD_WORDS)])
    h.req_states.remove_request(h.req_states.index_to_req_id[row])
    assert h.add("at_limit", Row(at_limit, [1], [5] * 7)) == row
    h.apply()
    assert_matches_oracle(h, [row], ranked_logits(1, [5, 6, 41]))
