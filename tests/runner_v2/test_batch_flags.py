"""SamplingStates.batch_flags against a plain-Python model of each request's needs, read
from its SamplingParams: rows written, rewritten and batched in any order, with the cache
of the last batch's flags in the way (a rewrite of a row in the cached batch must show)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_v2.sample import SamplingStates
from shared.contract.sampling_params import SamplingParams

VOCAB, ROWS = 64, 6

params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_k=st.sampled_from([0, 5, VOCAB, VOCAB + 3]),  # >= VOCAB: no top-k
    top_p=st.sampled_from([1.0, 0.9, 1 - 1e-9]),  # 1 - 1e-9 is 1.0 in float32
    min_p=st.sampled_from([0.0, 0.05]),
    min_tokens=st.sampled_from([0, 3]),
    logprobs=st.sampled_from([None, 0, 4]),
    presence_penalty=st.sampled_from([0.0, 0.5]),
    allowed_token_ids=st.sampled_from([None, [1, 2]]),
    logit_bias=st.sampled_from([None, {3: -1.0}]),
    bad_words_token_ids=st.sampled_from([None, [[4, 5]]]),
)
ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, ROWS - 1), params),
    st.tuples(st.just("batch"), st.lists(st.integers(0, ROWS - 1), max_size=ROWS, unique=True)),
    st.tuples(st.just("all"), st.none()),
), min_size=1, max_size=25)


def expected(sps: list[SamplingParams], per_row: bool) -> dict:
    """What a batch of these requests needs, from their parameters alone."""
    def random(sp):
        return sp.temperature != 0

    def filters(sp):  # as the kernels read it: float32 top_p / min_p
        return 0 < sp.top_k < VOCAB or np.float32(sp.top_p) < 1 or np.float32(sp.min_p) > 0

    counts = [-1 if sp.logprobs is None else sp.logprobs for sp in sps]
    return dict(
        any_penalties=any(sp.uses_penalties for sp in sps),
        any_min_tokens=any(sp.min_tokens > 0 for sp in sps),
        any_filter=any(random(sp) and filters(sp) for sp in sps),
        num_logprobs=tuple(counts) if per_row else (),
        max_num_logprobs=max(counts) if max(counts, default=-1) >= 0 else None,
        any_allowed_token_ids=any(bool(sp.allowed_token_ids) for sp in sps),
        any_logit_bias=any(bool(sp.logit_bias) for sp in sps),
        any_bad_words=any(bool(sp.bad_words_token_ids) for sp in sps),
        all_greedy=not any(random(sp) for sp in sps),
    )


@settings(max_examples=150, deadline=None)
@given(ops)
def test_batch_flags_follow_the_rows_parameters(sequence):
    states = SamplingStates(ROWS, VOCAB, "cpu")
    written: dict[int, SamplingParams] = {}
    for op, arg, *rest in sequence:
        if op == "add":
            states.add_request(arg, rest[0], [1, 2], [1, 2], None)
            written[arg] = rest[0]
        elif op == "batch":
            rows = [r for r in arg if r in written]
            flags = states.batch_flags(np.asarray(rows, np.int32))
            assert flags.__dict__ == expected([written[r] for r in rows], True), rows
        else:  # no batch: every row ever written
            flags = states.batch_flags(None)
            assert flags.__dict__ == expected([written[r] for r in sorted(written)], False)
