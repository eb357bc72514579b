"""The comparison of two runs' request records that the differential tests share: the same
tokens and finish reasons, and logprobs within a tolerance, request by request."""

from __future__ import annotations

from shared.harness.scenario_run import RequestRecord


def assert_same_records(a: dict[str, RequestRecord], b: dict[str, RequestRecord],
                        logprob_tol: float) -> None:
    assert a.keys() == b.keys()
    for label in a:
        ra, rb = a[label], b[label]
        assert ra.token_ids == rb.token_ids, label
        assert ra.finish_reason == rb.finish_reason, label
        assert (ra.logprobs is None) == (rb.logprobs is None), label
        for pos, (da, db) in enumerate(zip(ra.logprobs or [], rb.logprobs or [])):
            assert da.keys() == db.keys(), (label, pos)
            for token in da:
                assert abs(da[token] - db[token]) <= logprob_tol, (label, pos, token)
