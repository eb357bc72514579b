"""Metrics, the text table, the JSON report and the chart of `runnerlab bench serve`.

Per (runner, request rate), over the requests that completed:
  TTFT  first token-bearing chunk - send
  TPOT  (E2E - TTFT) / (output tokens - 1), requests with >= 2 output tokens
  ITL   every gap between consecutive token-bearing chunks of a request, all requests pooled
  E2E   end - send
each as mean, p50, p90, p99 in ms (numpy percentiles, linear interpolation); the duration
is from the first send to the last end of any request, and the throughputs divide the
completed requests' counts by it.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from shared.harness.bench_serve_client import RequestRecord

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


def latency_stats(seconds: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of a sample, in ms; None for each when the sample is empty."""
    if len(seconds) == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    out: dict[str, float | None] = {"mean": float(ms.mean())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(ms, p, method="linear"))
    return out


def latency_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """The TTFT, TPOT, ITL and E2E samples (seconds) of the completed requests."""
    out: dict[str, list[float]] = {name: [] for name in LATENCIES}
    for r in records:
        if not r.ok:
            continue
        out["e2e"].append(r.end_s - r.send_s)
        if not r.chunk_s:
            continue
        ttft = r.chunk_s[0] - r.send_s
        out["ttft"].append(ttft)
        out["itl"] += np.diff(r.chunk_s).tolist()
        if r.output_tokens >= 2:
            out["tpot"].append((r.end_s - r.send_s - ttft) / (r.output_tokens - 1))
    return out


def compute_metrics(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The metrics of one (runner, rate) run."""
    done = [r for r in records if r.ok]
    duration = (max(r.end_s for r in records) - min(r.send_s for r in records)
                if records else 0.0)
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens or 0 for r in done)

    def per_s(count: float) -> float | None:
        return count / duration if duration > 0 else None

    metrics: dict[str, Any] = {
        "completed": len(done), "failed": len(records) - len(done),
        "duration_s": duration, "output_tokens": output, "prompt_tokens": prompt,
        "request_throughput": per_s(len(done)), "output_throughput": per_s(output),
        "total_token_throughput": per_s(output + prompt),
    }
    for name, sample in latency_samples(records).items():
        metrics[f"{name}_ms"] = latency_stats(sample)
    errors = [r.error for r in records if not r.ok]
    metrics["errors"] = dict(sorted({e: errors.count(e) for e in errors}.items()))
    return metrics


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def result_entry(runner: str, rate: float, records: Sequence[RequestRecord],
                 save_requests: bool) -> dict[str, Any]:
    """One row of the report (JSON-safe: an infinite rate is the string "inf")."""
    entry: dict[str, Any] = {"runner": runner,
                             "request_rate": "inf" if math.isinf(rate) else rate,
                             "metrics": compute_metrics(records)}
    if save_requests:
        entry["requests"] = [r.to_json() for r in records]
    return entry


def _ms(stats: dict, key: str) -> str:
    value = stats.get(key)
    return "-" if value is None else f"{value:.1f}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


TABLE_COLUMNS = (
    ("runner", 8), ("rate", 6), ("done", 5), ("fail", 5), ("dur s", 7), ("req/s", 7),
    ("out tok/s", 10), ("tot tok/s", 10), ("TTFT p50", 9), ("TTFT p99", 9),
    ("TPOT p50", 9), ("TPOT p99", 9), ("ITL p50", 8), ("ITL p99", 8), ("E2E p50", 9),
    ("E2E p99", 9),
)


def format_table(results: Sequence[dict]) -> str:
    """One row per (runner, rate); latencies in ms."""
    head = " ".join(name.rjust(width) for name, width in TABLE_COLUMNS)
    lines = [head, "-" * len(head)]
    for entry in results:
        m = entry["metrics"]
        cells = [
            entry["runner"], rate_label(_rate_of(entry)), str(m["completed"]), str(m["failed"]),
            f"{m['duration_s']:.2f}", _num(m["request_throughput"], ".2f"),
            _num(m["output_throughput"], ".1f"), _num(m["total_token_throughput"], ".1f"),
            _ms(m["ttft_ms"], "p50"), _ms(m["ttft_ms"], "p99"), _ms(m["tpot_ms"], "p50"),
            _ms(m["tpot_ms"], "p99"), _ms(m["itl_ms"], "p50"), _ms(m["itl_ms"], "p99"),
            _ms(m["e2e_ms"], "p50"), _ms(m["e2e_ms"], "p99"),
        ]
        lines.append(" ".join(c.rjust(w) for c, (_, w) in zip(cells, TABLE_COLUMNS)))
    return "\n".join(lines)


def error_lines(results: Sequence[dict], limit: int = 5) -> list[str]:
    """The distinct errors of failed requests, most frequent first, per row."""
    out = []
    for entry in results:
        errors = sorted(entry["metrics"]["errors"].items(), key=lambda kv: -kv[1])
        for text, count in errors[:limit]:
            out.append(f"{entry['runner']} @ {entry['request_rate']}: {count} x {text}")
    return out


# ------------------------------------------------------------------ chart

PANELS = (("ttft_ms", "p50", "TTFT p50 (ms)"), ("ttft_ms", "p99", "TTFT p99 (ms)"),
          ("tpot_ms", "p50", "TPOT p50 (ms)"), ("tpot_ms", "p99", "TPOT p99 (ms)"),
          ("itl_ms", "p99", "ITL p99 (ms)"), ("output_throughput", None, "output tokens/s"))
# a runner is told apart by line and marker, not colour alone (as ab.png does)
STYLES = ({"linestyle": "-", "marker": "o"}, {"linestyle": "--", "marker": "s",
                                              "markerfacecolor": "none"},
          {"linestyle": ":", "marker": "^"}, {"linestyle": "-.", "marker": "D"})


def chart_positions(rates: Sequence[float]) -> dict[float, float]:
    """x of each rate: finite rates at their value, inf ("max") to the right of them."""
    finite = sorted({r for r in rates if not math.isinf(r)})
    out = {r: r for r in finite}
    if any(math.isinf(r) for r in rates):
        out[math.inf] = finite[-1] * 1.35 if finite and finite[-1] > 0 else 1.0
    return out


def _rate_of(entry: dict) -> float:
    rate = entry["request_rate"]
    return math.inf if rate == "inf" else float(rate)


def _panel_value(metrics: dict, key: str, stat: str | None) -> float:
    value = metrics[key] if stat is None else metrics[key][stat]
    return math.nan if value is None else value


def build_figure(results: Sequence[dict], title: str) -> Any:
    """A Figure (no pyplot: nothing process-wide) with the panels of PANELS."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 8.5))
    axes = fig.subplots(2, 3).ravel()
    positions = chart_positions([_rate_of(e) for e in results])
    runners = list(dict.fromkeys(e["runner"] for e in results))
    for ax, (key, stat, label) in zip(axes, PANELS):
        for i, runner in enumerate(runners):
            rows = sorted((e for e in results if e["runner"] == runner), key=_rate_of)
            xs = [positions[_rate_of(e)] for e in rows]
            ys = [_panel_value(e["metrics"], key, stat) for e in rows]
            ax.plot(xs, ys, label=runner.upper(), **STYLES[i % len(STYLES)])
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("request rate (req/s; max: all at once)")
        ax.set_xticks(list(positions.values()))
        ax.set_xticklabels(["max" if math.isinf(r) else f"{r:g}" for r in positions])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=9)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def write_png(results: Sequence[dict], title: str, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = build_figure(results, title)
    FigureCanvasAgg(fig)  # the Agg canvas, attached to this figure only
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------ JSON


def git_commit(cwd: str) -> str | None:
    """`git rev-parse --short HEAD` of the checkout at cwd, with "-dirty" when it has
    uncommitted changes; None outside a git checkout or without git."""
    import subprocess

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                                 timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    return commit


def write_outputs(report: dict, json_path: str | None, png_path: str | None) -> list[str]:
    """The report as JSON and its rows as a chart; -> the paths written."""
    if json_path is not None:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    if png_path is not None:
        title = (f"{report['model']}: {report['workload']['name']} workload, "
                 f"{report['workload']['num_prompts']} requests")
        write_png(report["results"], title, png_path)
    return [p for p in (json_path, png_path) if p is not None]


def finish(report: dict, json_path: str | None, png_path: str | None, prog: str) -> int:
    """Print the table (stdout) and the failed requests (stderr), write the JSON and the
    chart; -> the exit status: 1 when a request failed or a file could not be written."""
    rows = report["results"]
    if report.get("device") == "cpu" and "v2" in report["runners"]:
        print("note: without a GPU, V2's Triton kernels run under the Triton interpreter: "
              "its latencies measure the interpreter, not the design")
    print(format_table(rows))
    errors = error_lines(rows)
    for line in errors:
        print(f"{prog}: failed requests: {line}", file=sys.stderr)
    try:
        written = write_outputs(report, json_path, png_path)
    except OSError as exc:
        print(f"{prog}: error: writing the results: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if written:
        print("\nwrote " + " and ".join(written))
    return 1 if errors else 0
