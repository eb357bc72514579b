"""Comparing two runs of one scenario, request by request (for `runnerlab diff`).

Two runners must agree exactly: the same labels, tokens, finish reasons and logprob
dicts (the same top ids; values within a tolerance). A reference (`hf`: transformers
greedy, `solo`: each request alone) is checked over the tokens the runner produced:
an aborted request's prefix, and the reference's own labels only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.harness.scenario_run import RequestRecord


@dataclass
class Divergence:
    request_id: str
    position: int


@dataclass
class PairReport:
    a: str
    b: str
    identical: bool
    first_divergence: Divergence | None
    max_logprob_diff: float | None
    logprob_tol: float
    requests_compared: int
    detail: str | None = None

    @property
    def agrees(self) -> bool:
        return self.identical and self.first_divergence is None


def compare_runs(
    a: str, runs_a: dict[str, RequestRecord], b: str, runs_b: dict[str, RequestRecord],
    tol: float, reference: bool, in_flight: bool = False,
) -> PairReport:
    """Compare two runs request by request. reference=False: both are runners and must
    match exactly over the union of labels. reference=True: `b` (hf or solo) checks each
    of its labels over the tokens `a` produced. in_flight=True (one side ran with async
    scheduling): a request aborted on both sides may lack, on one side, the one token
    that was in flight when the abort came."""
    labels = sorted(runs_b) if reference else sorted(set(runs_a) | set(runs_b))
    report = PairReport(a, b, True, None, None, tol, 0)
    for label in labels:
        ra, rb = runs_a.get(label), runs_b.get(label)
        if ra is None or rb is None:
            _diverge(report, label, 0, f"request missing from {a if ra is None else b}", True)
            continue
        report.requests_compared += 1
        n, token_problem = _compare_tokens(ra, rb, reference, in_flight)
        if token_problem is not None:
            _diverge(report, label, token_problem[0], token_problem[1], True)
        _compare_logprobs(report, label, ra, rb, n, strict_keys=b != "hf")
    return report


def _compare_tokens(ra: RequestRecord, rb: RequestRecord, reference: bool,
                    in_flight: bool = False):
    """-> (positions compared, None | (position, what differs))."""
    ta, tb = ra.token_ids, rb.token_ids
    prefix = reference and (rb.finish_reason is None or ra.finish_reason == "abort")
    if prefix:
        tb = tb[: len(ta)]  # a reference that ran on must agree over what `a` produced
    both_aborted = ra.finish_reason == rb.finish_reason == "abort"
    if in_flight and both_aborted and abs(len(ta) - len(tb)) <= 1:
        n = min(len(ta), len(tb))
        ta, tb = ta[:n], tb[:n]  # the in-flight token is dropped by the abort
    for i, (x, y) in enumerate(zip(ta, tb)):
        if x != y:
            return i, (i, f"token {x} vs {y}")
    n = min(len(ta), len(tb))
    if len(ta) != len(tb):
        return n, (n, f"{len(ta)} vs {len(tb)} tokens")
    if not prefix and ra.finish_reason != rb.finish_reason:
        return n, (max(n - 1, 0), f"finish_reason {ra.finish_reason} vs {rb.finish_reason}")
    return n, None


def _compare_logprobs(
    report: PairReport, label: str, ra: RequestRecord, rb: RequestRecord, n: int,
    strict_keys: bool,
) -> None:
    if ra.logprobs is None or rb.logprobs is None:
        if strict_keys and (ra.logprobs is None) != (rb.logprobs is None):
            _diverge(report, label, 0, "logprobs returned by one side only", False)
        return
    for pos, (da, db) in enumerate(zip(ra.logprobs[:n], rb.logprobs[:n])):
        if strict_keys and set(da) != set(db):
            _diverge(report, label, pos, f"top logprob ids {sorted(da)} vs {sorted(db)}", False)
        for token in set(da) & set(db):
            d = abs(da[token] - db[token])
            if math.isnan(d):
                d = math.inf
            report.max_logprob_diff = max(report.max_logprob_diff or 0.0, d)
            if d > report.logprob_tol:
                _diverge(report, label, pos, f"|logprob diff| {d:.3g} > {report.logprob_tol:g}",
                         False)


def _diverge(report: PairReport, label: str, pos: int, detail: str, tokens: bool) -> None:
    if tokens:
        report.identical = False
    if report.first_divergence is None:
        report.first_divergence = Divergence(label, pos)
        report.detail = detail
