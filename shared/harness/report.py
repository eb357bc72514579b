"""Tables and the chart for `runnerlab ab`: one runner or both (ratios only with both)."""

from __future__ import annotations

from typing import Any

from shared.runtime.step_timing import STAGES

ROWS = ("wall",) + STAGES  # what a step's time is made of, in the table and the chart
# A runner is told apart by line and fill, never by colour alone (colour is the stage):
# V1 solid lines, filled circles, solid bars; V2 dashed lines, open squares, hatched bars.
LINE_STYLE = {"v1": {"linestyle": "-", "marker": "o", "markersize": 5},
              "v2": {"linestyle": "--", "marker": "s", "markersize": 8,
                     "markerfacecolor": "none", "linewidth": 1.8}}
BAR_STYLE = {"v1": {"alpha": 0.9}, "v2": {"fill": False, "hatch": "///", "linewidth": 1.2}}
STAGE_COLOURS = dict(zip(ROWS, ("black", "tab:blue", "tab:orange", "tab:green", "tab:red")))
RATE_KEYS = ("output_tokens_per_s", "prefill_tokens_per_s")


def _med(d: dict, *keys: str) -> float | None:
    for k in keys:
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d.get("median") if isinstance(d, dict) else None


def _p90(d: dict, *keys: str) -> float | None:
    for k in keys:
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d.get("p90") if isinstance(d, dict) else None


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.3f}{unit}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{b / a:.2f}"


def _keys(row: str) -> tuple[str, ...]:
    return ("wall_ms",) if row == "wall" else ("stages_ms", row)


def _runners(report: dict) -> list[str]:
    return report.get("runners", ["v1", "v2"])


def _both(report: dict) -> bool:
    return _runners(report) == ["v1", "v2"]


def header_lines(report: dict) -> list[str]:
    """The report's first lines: what ran where, and what its numbers do not mean."""
    runners = ", ".join(r.upper() for r in _runners(report))
    threads = report.get("settings", {}).get("threads")
    lines = [f"runnerlab ab: {report['model']} ({report['dtype']}) on {report['device']}; "
             f"runners {runners}" + (f"; torch threads {threads}" if threads else "")]
    lines += [f"CAVEAT: {c}" for c in report.get("caveats", [])]
    note = report.get("settings", {}).get("defaults_note")
    if note:
        lines.append(note)
    return lines


def print_tables(report: dict) -> None:
    runners, both = _runners(report), _both(report)
    print()
    print("\n".join(header_lines(report)))
    bw = report.get("read_bandwidth_GBps")
    if bw:
        print(f"measured read bandwidth {bw:.0f} GB/s; non-embedding weights "
              f"{report['weight_bytes'] / 1e9:.3f} GB")
    across = "runners" if both else f"{runners[0].upper()}'s runs"
    print(f"tokens identical across {across}: {report['tokens_identical']}")
    modes = report.get("async_scheduling", {})
    print("engine loop: " + ", ".join(
        f"{r.upper()} {'async scheduling' if on else 'synchronous'}" for r, on in modes.items()))
    for name, entries in report["workloads"].items():
        ratio = "; ratio = V2/V1 of medians" if both else ""
        print(f"\n== {name} ==  (ms per step: median / p90{ratio})")
        print(f"{'run':>12} {'stage':>12} " + " ".join(f"{r.upper():>17}" for r in runners)
              + (f" {'V2/V1':>6}" if both else ""))
        for e in entries:
            _print_entry(e, runners, both)


def _print_entry(e: dict, runners: list[str], both: bool) -> None:
    first = e[runners[0]]
    rows = [(row, _keys(row)) for row in ROWS]
    if _med(first, "forward_gpu_ms") is not None:
        rows.append(("fwd GPU", ("forward_gpu_ms",)))
    if _med(first, "steady_ms") is not None:
        rows.append(("steady", ("steady_ms",)))
    for stage, keys in rows:
        medians = [_med(e[r], *keys) for r in runners]
        if all(m is None for m in medians):
            continue
        cells = " ".join(f"{_fmt(m) + '/' + _fmt(_p90(e[r], *keys)):>17}"
                         for r, m in zip(runners, medians))
        print(f"{e['label']:>12} {stage:>12} {cells}"
              + (f" {_ratio(*medians):>6}" if both else ""))
    if "floor_ms" in e:
        achieved = " ".join(f"{r.upper()} {_fmt(e[r].get('achieved_GBps'))}" for r in runners)
        print(f"{e['label']:>12} {'floor':>12} {e['floor_ms']:.3f} ms (weights/bandwidth);"
              f" achieved GB/s {achieved}")
    for key in RATE_KEYS:
        rates = [_med(e[r], key) for r in runners]
        if rates[0] is None:
            continue
        cells = "  ".join(f"{r.upper()} {rate:.0f} [{e[r][key]['min']:.0f}..{e[r][key]['max']:.0f}]"
                          for r, rate in zip(runners, rates))
        print(f"{e['label']:>12} {key:>12} {cells}"
              + (f"  V2/V1 {_ratio(*rates)}" if both else ""))


# ---------------------------------------------------------------- the chart


def build_figure(report: dict) -> Any:
    """A matplotlib Figure with one panel per measured workload, in the order measured:
    decode as ms/step against batch size, the others as bars per stage (throughput: output
    tokens/s). None when nothing was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    if not workloads:
        return None
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 4.6),
                             squeeze=False)
    runners = _runners(report)
    for ax, (name, entries) in zip(axes[0], workloads.items()):
        if name == "decode":
            _decode_panel(ax, entries, runners)
        elif name == "throughput":
            _rate_panel(ax, entries, runners, "output_tokens_per_s", "output tokens / s")
        else:
            _stage_bars(ax, entries, runners)
        single = len(entries) == 1 and name != "decode"
        ax.set_title(f"{name} ({entries[0]['label']})" if single else name)
        ax.set_axisbelow(True)  # the grid behind the bars
        ax.grid(alpha=0.3, which="both")
    _legend(fig, runners)
    fig.suptitle("\n".join(_title_lines(report)), fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def _title_lines(report: dict) -> list[str]:
    """The header, each caveat wrapped so that a narrow (one-panel) figure keeps it."""
    import textwrap

    width = 64 * len(report["workloads"])  # characters of 9 pt text across 5.2 in panels
    lines: list[str] = []
    for line in header_lines(report):
        lines += textwrap.wrap(line, width)
    return lines


def _decode_panel(ax: Any, entries: list[dict], runners: list[str]) -> None:
    batches = [int(e["label"][1:]) for e in entries]
    for row in ROWS:
        for runner in runners:
            ys = [_med(e[runner], *_keys(row)) for e in entries]
            ax.plot(batches, [float("nan") if y is None else y for y in ys],
                    color=STAGE_COLOURS[row], **LINE_STYLE[runner])
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_yscale("log")  # V1 and V2 differ by up to 100x on CPU; linear hides V1
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("ms / step (median)")


def _stage_bars(ax: Any, entries: list[dict], runners: list[str]) -> None:
    """Bars per (run, stage); within a group, one bar per runner."""
    width = 0.8 / len(runners)
    ticks, labels = [], []
    for i, (entry, row) in enumerate((e, r) for e in entries for r in ROWS):
        for j, runner in enumerate(runners):
            y = _med(entry[runner], *_keys(row))
            if y is None:
                continue
            colour = STAGE_COLOURS[row]
            style = dict(BAR_STYLE[runner], edgecolor=colour)
            if runner == "v1":
                style["color"] = colour
            ax.bar(i + (j - (len(runners) - 1) / 2) * width, y, width, **style)
        ticks.append(i)
        labels.append(row if len(entries) == 1 else f"{entry['label']}\n{row}")
    ax.set_xticks(ticks, labels, rotation=30, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms / step (median)")


def _rate_panel(ax: Any, entries: list[dict], runners: list[str], key: str, unit: str) -> None:
    width = 0.8 / len(runners)
    for i, entry in enumerate(entries):
        for j, runner in enumerate(runners):
            stats = entry[runner].get(key)
            if not stats:
                continue
            x = i + (j - (len(runners) - 1) / 2) * width
            err = [[stats["median"] - stats["min"]], [stats["max"] - stats["median"]]]
            style = dict(BAR_STYLE[runner], edgecolor="tab:purple")
            if runner == "v1":
                style["color"] = "tab:purple"
            ax.bar(x, stats["median"], width, yerr=err, capsize=4, **style)
    ax.set_xticks(range(len(entries)), [e["label"] for e in entries])
    ax.set_ylabel(f"{unit} (median, min..max)")


def _legend(fig: Any, runners: list[str]) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=STAGE_COLOURS[row], label=row) for row in ROWS]
    for runner in runners:
        handles.append(Line2D([], [], color="grey", label=f"{runner.upper()} (line)",
                              **LINE_STYLE[runner]))
        style = dict(BAR_STYLE[runner], edgecolor="grey")
        if runner == "v1":
            style["facecolor"] = "grey"
        handles.append(Patch(label=f"{runner.upper()} (bar)", **style))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8,
               frameon=False)


def write_png(report: dict, path: str) -> str | None:
    """The chart as a PNG at `path`; None when there is nothing to draw or no matplotlib."""
    try:
        fig = build_figure(report)
    except ImportError:
        return None
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
