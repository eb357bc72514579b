"""V1's ngram proposer against a plain-Python prompt lookup: longest n first, the
earliest occurrence (vLLM's rule), continuation cut at the sequence end and at
max_model_len - L - 1. The table is filled past num_tokens with tokens of the same
alphabet, so a proposer reading past a row's end gives different drafts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_v1.spec_decode.ngram_proposer import NgramProposer


def reference(t: list[int], k: int, min_n: int, max_n: int, max_model_len: int) -> list[int]:
    """Straight loops: for n = max_n .. min_n, the first i with i + n <= L - 1 whose
    n tokens equal the last n; its next (up to) k tokens, capped by the model length."""
    L = len(t)
    cap = max(0, max_model_len - L - 1)
    for n in range(max_n, min_n - 1, -1):
        for i in range(0, L - n):  # i + n <= L - 1
            if t[i : i + n] == t[L - n :]:
                return t[i + n : min(i + n + k, L)][:cap]
    return []


def propose_one(
    t: list[int], k: int, min_n: int, max_n: int, max_model_len: int | None = None
) -> list[int]:
    """One request in row 1 of a 3-row table whose other cells hold tokens of t's
    alphabet (garbage a correct proposer never reads)."""
    width = max_model_len if max_model_len is not None else len(t) + 64
    rng = np.random.default_rng(len(t))
    alphabet = np.array(sorted(set(t)) or [0], dtype=np.int32)
    table = rng.choice(alphabet, size=(3, width)).astype(np.int32)
    table[1, : len(t)] = t
    num_tokens = np.array([width, len(t), 0], dtype=np.int32)
    drafts, num = NgramProposer(k, min_n, max_n, width).propose(
        table, num_tokens, np.array([1], dtype=np.int64))
    assert drafts.shape == (1, k) and drafts.dtype == np.int32 and num.dtype == np.int32
    assert (drafts[0, num[0]:] == -1).all()  # padding
    return drafts[0, : num[0]].tolist()


# ---- hand-written cases ----------------------------------------------------------------

def test_no_match():
    assert propose_one([1, 2, 3, 4, 5], k=2, min_n=2, max_n=2) == []
    assert propose_one([1, 2, 3, 4, 5], k=2, min_n=1, max_n=4) == []
    assert propose_one([1, 2, 3, 4, 1, 2, 3], k=2, min_n=4, max_n=4) == []  # 3-gram only


def test_earliest_of_several_occurrences_wins():
    # vLLM's case: [1,2,3] occurs at 0, 4 and 8; the first one's continuation is taken.
    t = [1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3]
    assert propose_one(t, k=2, min_n=3, max_n=3) == [100, 1]
    assert propose_one(t, k=1, min_n=1, max_n=1) == [100]
    assert propose_one(t, k=2, min_n=1, max_n=1) == reference(t, 2, 1, 1, 10**6)


def test_longest_n_wins_over_shorter():
    # 4-gram [1,2,3,4] at 4; 3-gram [2,3,4] earlier at 0 -> the 4-gram's continuation.
    assert propose_one([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], k=2, min_n=3, max_n=4) == [1, 2]
    assert propose_one([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], k=2, min_n=2, max_n=4) == [1, 2]
    # the 1-gram [3] occurs first at 1, the 2-gram [2,3] only at 4
    t = [9, 3, 7, 1, 2, 3, 8, 2, 3]
    assert propose_one(t, k=2, min_n=1, max_n=2) == [8, 2]
    assert propose_one(t, k=2, min_n=1, max_n=1) == [7, 1]
    # no 3-gram recurs; max_n = 3 falls back to 2
    assert propose_one(t, k=2, min_n=2, max_n=3) == [8, 2]


def test_continuation_truncated_at_the_sequence_end():
    assert propose_one([1, 2, 3, 4, 1, 2, 3], k=5, min_n=2, max_n=2) == [4, 1, 2, 3]
    # the occurrence may overlap the suffix; one token must follow it
    assert propose_one([5, 5, 5, 5], k=3, min_n=2, max_n=2) == [5, 5]
    assert propose_one([5, 5, 5, 5], k=3, min_n=3, max_n=3) == [5]
    assert propose_one([5, 5, 5, 5], k=3, min_n=4, max_n=4) == []
    assert propose_one([7, 7], k=4, min_n=1, max_n=3) == [7]


def test_max_model_len_cap():
    t = [1, 2, 3] * 4  # L = 12, 3-periodic: [1, 2, 3] follows the first [1, 2, 3]
    assert propose_one(t, k=4, min_n=3, max_n=3, max_model_len=100) == [1, 2, 3, 1]
    assert propose_one(t, k=4, min_n=3, max_n=3, max_model_len=15) == [1, 2]  # 15 - 12 - 1
    assert propose_one(t, k=4, min_n=3, max_n=3, max_model_len=14) == [1]
    assert propose_one(t, k=4, min_n=3, max_n=3, max_model_len=13) == []
    assert propose_one(t, k=4, min_n=3, max_n=3, max_model_len=12) == []  # row is full


def test_k_1_and_16():
    t = [4, 6, 8] * 10
    assert propose_one(t, k=1, min_n=2, max_n=5) == [4]
    assert propose_one(t, k=16, min_n=2, max_n=5) == ([4, 6, 8] * 6)[:16]
    assert propose_one(t[:8], k=16, min_n=1, max_n=1) == t[2:8]  # fewer than k remain


def test_short_and_empty_rows_get_nothing():
    assert propose_one([], k=3, min_n=1, max_n=1) == []
    assert propose_one([5], k=3, min_n=1, max_n=1) == []
    assert propose_one([5, 6], k=3, min_n=2, max_n=2) == []  # L - 1 < min_n


def test_rows_order_subset_duplicates_and_no_writes():
    table = np.full((4, 20), 9, dtype=np.int32)
    table[0, :6] = [1, 2, 1, 2, 1, 2]
    table[1, :5] = [1, 2, 3, 4, 5]
    table[2, :5] = [3, 3, 4, 3, 3]
    num_tokens = np.array([6, 5, 5, 20], dtype=np.int32)
    before = table.copy()
    drafts, num = NgramProposer(3, 1, 2, 20).propose(
        table, num_tokens, np.array([2, 0, 1, 2], dtype=np.int64))
    assert num.tolist() == [3, 3, 0, 3]
    assert drafts.tolist() == [[4, 3, 3], [1, 2, 1], [-1, -1, -1], [4, 3, 3]]
    assert (table == before).all()
    d0, n0 = NgramProposer(3, 1, 2, 20).propose(table, num_tokens, np.zeros(0, np.int64))
    assert d0.shape == (0, 3) and n0.shape == (0,)


def test_long_rows():
    rng = np.random.default_rng(0)
    for vocab, L in ((3, 3000), (2, 2500), (50_000, 4000)):
        t = rng.integers(0, vocab, L).tolist()
        if vocab > 100:  # plant a repeat so a real-vocabulary row matches too
            t[1000:1006] = t[-6:]
        assert propose_one(t, 8, 2, 5) == reference(t, 8, 2, 5, L + 64)


@pytest.mark.parametrize("args", [(0, 1, 1, 8), (17, 0, 1, 8), (2, 3, 2, 8), (2, 1, 1, 0)])
def test_bad_settings(args):
    with pytest.raises(ValueError):
        NgramProposer(*args)


# ---- properties ------------------------------------------------------------------------

@st.composite
def batches(draw):
    max_model_len = draw(st.integers(1, 40))
    num_rows = draw(st.integers(1, 6))
    alphabet = draw(st.integers(2, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    table = np.random.default_rng(seed).integers(0, alphabet, (num_rows, max_model_len))
    num_tokens = draw(st.lists(st.integers(0, max_model_len), min_size=num_rows,
                               max_size=num_rows))
    rows = draw(st.lists(st.integers(0, num_rows - 1), max_size=8))
    min_n = draw(st.integers(1, 5))
    max_n = draw(st.integers(min_n, 6))
    k = draw(st.integers(1, 16))
    return (table.astype(np.int32), np.array(num_tokens, np.int32),
            np.array(rows, np.int64), k, min_n, max_n, max_model_len)


@settings(max_examples=400, deadline=None)
@given(batches())
def test_matches_the_reference(batch):
    table, num_tokens, rows, k, min_n, max_n, max_model_len = batch
    drafts, num = NgramProposer(k, min_n, max_n, max_model_len).propose(table, num_tokens, rows)
    assert drafts.shape == (len(rows), k) and num.shape == (len(rows),)
    for out, (row, count) in enumerate(zip(rows, num)):
        t = table[row, : num_tokens[row]].tolist()
        expected = reference(t, k, min_n, max_n, max_model_len)
        assert drafts[out, :count].tolist() == expected
        assert (drafts[out, count:] == -1).all()
