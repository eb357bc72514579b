"""bench serve's metrics against answers worked out by hand on hand-built timelines, and
against a plain-Python oracle (its own percentile, its own gap loops) on random ones."""

from __future__ import annotations

import json
import math
import random

import pytest

from shared.harness.bench_serve_client import RequestRecord
from shared.harness.bench_serve_report import (
    build_figure,
    chart_positions,
    compute_metrics,
    format_table,
    result_entry,
    write_outputs,
)


def record(index: int, send: float, chunks: list[float], end: float, tokens: int,
           error: str | None = None, prompt: int = 10) -> RequestRecord:
    return RequestRecord(index=index, max_tokens=tokens, prompt_tokens=prompt, arrival_s=send,
                         send_s=send, chunk_s=tuple(chunks), end_s=end, output_tokens=tokens,
                         finish_reason=None if error else "length", error=error)


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks, written out (numpy's "linear")."""
    xs = sorted(values)
    h = (len(xs) - 1) * p / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


# A: 3 tokens in 3 chunks; B: 4 tokens in 3 chunks (its last chunk carries two);
# C: one token (a TTFT, no TPOT, no ITL); D: failed (in the duration, in nothing else)
HAND_BUILT = [
    record(0, 0.0, [0.1, 0.15, 0.25], 0.3, 3),
    record(1, 1.0, [1.2, 1.3, 1.6], 1.6, 4, prompt=20),
    record(2, 0.5, [0.55], 0.6, 1, prompt=5),
    record(3, 0.2, [0.4], 2.0, 1, error="HTTP 500: boom"),
]


def test_hand_built_timelines_give_the_worked_answers() -> None:
    m = compute_metrics(HAND_BUILT)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["duration_s"] == pytest.approx(2.0)  # first send 0.0, last end 2.0 (the failed D)
    assert m["output_tokens"] == 8 and m["prompt_tokens"] == 35
    assert m["request_throughput"] == pytest.approx(3 / 2.0)
    assert m["output_throughput"] == pytest.approx(8 / 2.0)
    assert m["total_token_throughput"] == pytest.approx(43 / 2.0)
    # TTFT: A 100, B 200, C 50 ms
    assert m["ttft_ms"]["mean"] == pytest.approx(350 / 3)
    assert m["ttft_ms"]["p50"] == pytest.approx(100)
    assert m["ttft_ms"]["p90"] == pytest.approx(100 + 0.8 * 100)
    # TPOT: A (300 - 100) / 2 = 100, B (600 - 200) / 3 = 133.33; C has one token
    assert m["tpot_ms"]["mean"] == pytest.approx((100 + 400 / 3) / 2)
    assert m["tpot_ms"]["p99"] == pytest.approx(100 + 0.99 * (400 / 3 - 100))
    # ITL: A 50, 100; B 100, 300 (a gap per pair of chunks, not per token)
    assert m["itl_ms"]["p50"] == pytest.approx(100)
    assert m["itl_ms"]["mean"] == pytest.approx(550 / 4)
    assert m["itl_ms"]["p99"] == pytest.approx(100 + 0.97 * 200)
    # E2E: 300, 600, 100
    assert m["e2e_ms"]["p50"] == pytest.approx(300)
    assert m["e2e_ms"]["mean"] == pytest.approx(1000 / 3)
    assert m["errors"] == {"HTTP 500: boom": 1}


def test_random_timelines_agree_with_a_plain_python_oracle() -> None:
    rng = random.Random(7)
    records = []
    for i in range(60):
        send = rng.uniform(0, 5)
        t, chunks, tokens = send + rng.expovariate(5.0), [], 0
        for _ in range(rng.randint(1, 12)):
            chunks.append(t)
            tokens += rng.choice((1, 1, 1, 2))
            t += rng.expovariate(40.0)
        failed = rng.random() < 0.15
        records.append(record(i, send, chunks, chunks[-1] + rng.uniform(0, 0.01), tokens,
                              error="timed out" if failed else None, prompt=rng.randint(1, 99)))
    m = compute_metrics(records)
    ok = [r for r in records if r.error is None]
    ttft = [(r.chunk_s[0] - r.send_s) * 1e3 for r in ok]
    tpot = [((r.end_s - r.send_s) - (r.chunk_s[0] - r.send_s)) * 1e3 / (r.output_tokens - 1)
            for r in ok if r.output_tokens > 1]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.chunk_s, r.chunk_s[1:])]
    e2e = [(r.end_s - r.send_s) * 1e3 for r in ok]
    for name, sample in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        stats = m[f"{name}_ms"]
        assert stats["mean"] == pytest.approx(sum(sample) / len(sample)), name
        for p in (50, 90, 99):
            assert stats[f"p{p}"] == pytest.approx(percentile(sample, p)), (name, p)
    duration = max(r.end_s for r in records) - min(r.send_s for r in records)
    assert m["output_throughput"] == pytest.approx(sum(r.output_tokens for r in ok) / duration)
    assert m["completed"] + m["failed"] == 60 and m["failed"] == 60 - len(ok)


def test_no_completed_request_gives_empty_latencies_not_a_crash() -> None:
    m = compute_metrics([record(0, 0.0, [], 1.0, 0, error="HTTP 400: no")])
    assert m["completed"] == 0 and m["ttft_ms"]["p99"] is None and m["output_throughput"] == 0
    assert "-" in format_table([{"runner": "v1", "request_rate": 1.0, "metrics": m}])


def test_rows_are_json_safe_and_the_chart_puts_inf_at_max(tmp_path) -> None:
    rows = [result_entry(runner, rate, HAND_BUILT[:3], save_requests=runner == "v1")
            for runner in ("v1", "v2") for rate in (2.0, math.inf, 0.5)]
    assert rows[1]["request_rate"] == "inf" and "requests" in rows[0] and "requests" not in rows[3]
    json.loads(json.dumps(rows, allow_nan=False))  # no Infinity / NaN in the report
    table = format_table(rows).splitlines()
    assert len(table) == 2 + 6 and table[3].split()[:2] == ["v1", "inf"]
    positions = chart_positions([2.0, math.inf, 0.5])
    assert positions[math.inf] > positions[2.0] > positions[0.5]
    assert chart_positions([math.inf]) == {math.inf: 1.0}
    fig = build_figure(rows, "t")
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["0.5", "2", "max"]
    assert len(fig.axes) == 6 and len(fig.axes[0].lines) == 2
    report = {"model": "m", "workload": {"name": "nano-vllm", "num_prompts": 3},
              "results": rows}
    written = write_outputs(report, str(tmp_path / "r.json"), str(tmp_path / "r.png"))
    assert len(written) == 2
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "r.json").read_text())["results"][0]["runner"] == "v1"
