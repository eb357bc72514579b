"""The chart of `runnerlab ab` (ab.png): one panel per workload, one series per engine.

An engine is told apart by line and fill, never by colour alone (colour is the stage):
V1 solid lines, filled circles, solid bars; V2 dashed lines, open squares, hatched bars;
under --engine-loop both the async engines get their own lines, markers and fills.
"""

from __future__ import annotations

from typing import Any

from shared.harness.report import ROWS, engine_labels, header_lines, median, stat_keys

LINE_STYLE = {"v1": {"linestyle": "-", "marker": "o", "markersize": 5},
              "v2": {"linestyle": "--", "marker": "s", "markersize": 8,
                     "markerfacecolor": "none", "linewidth": 1.8}}
BAR_STYLE = {"v1": {"alpha": 0.9}, "v2": {"fill": False, "hatch": "///", "linewidth": 1.2}}
# what an async engine changes in its runner's style when both loops are drawn
ASYNC_LINE = {"v1": {"linestyle": ":", "marker": "^"}, "v2": {"linestyle": "-.", "marker": "D"}}
ASYNC_BAR = {"v1": {"alpha": 0.4}, "v2": {"hatch": "..."}}
STAGE_COLOURS = dict(zip(ROWS, ("black", "tab:blue", "tab:orange", "tab:green", "tab:red")))


def _runner_loop(label: str) -> tuple[str, str]:
    runner, _, loop = label.partition("-")
    return runner, loop


def line_style(label: str) -> dict:
    runner, loop = _runner_loop(label)
    return {**LINE_STYLE[runner], **(ASYNC_LINE[runner] if loop == "async" else {})}


def bar_style(label: str, colour: str) -> dict:
    """A bar's style; V1's engines are filled with the colour, V2's drawn in it."""
    runner, loop = _runner_loop(label)
    style = {**BAR_STYLE[runner], **(ASYNC_BAR[runner] if loop == "async" else {}),
             "edgecolor": colour}
    if runner == "v1":
        style["color"] = colour
    return style


def build_figure(report: dict) -> Any:
    """A matplotlib Figure with one panel per measured workload, in the order measured:
    decode as ms/step against batch size, the others as bars per stage (throughput: output
    tokens/s beside its floor; embed: embeddings/s per runner beside its floor). None when
    nothing was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    if not workloads:
        return None
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 4.6),
                             squeeze=False)
    labels = engine_labels(report)
    for ax, (name, entries) in zip(axes[0], workloads.items()):
        if name == "decode":
            _decode_panel(ax, entries, labels)
        elif name == "throughput":
            _rate_panel(ax, entries, labels, "output_tokens_per_s", "output tokens / s")
        elif name == "embed":  # (one pooling engine per runner, whatever the loops)
            _rate_panel(ax, entries, report.get("runners", ["v1", "v2"]), "embeddings_per_s",
                        "embeddings / s", floor_key="embeddings_per_s")
        elif name == "spec":
            _spec_panel(ax, entries, report.get("runners", ["v1", "v2"]))
        else:
            _stage_bars(ax, entries, labels)
        single = len(entries) == 1 and name not in ("decode", "spec")
        ax.set_title(f"{name} ({entries[0]['label']})" if single else name)
        ax.set_axisbelow(True)  # the grid behind the bars
        ax.grid(alpha=0.3, which="both")
    _legend(fig, labels)
    fig.suptitle("\n".join(_title_lines(report)), fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def _title_lines(report: dict) -> list[str]:
    """The header, each line wrapped so that a narrow (one-panel) figure keeps it."""
    import textwrap

    width = 64 * len(report["workloads"])  # characters of 9 pt text across 5.2 in panels
    lines: list[str] = []
    for line in header_lines(report):
        lines += textwrap.wrap(line, width)
    return lines


def _decode_panel(ax: Any, entries: list[dict], labels: list[str]) -> None:
    batches = [int(e["label"][1:]) for e in entries]
    for row in ROWS:
        for label in labels:
            ys = [median(e[label], *stat_keys(row)) for e in entries]
            ax.plot(batches, [float("nan") if y is None else y for y in ys],
                    color=STAGE_COLOURS[row], **line_style(label))
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_yscale("log")  # V1 and V2 differ by orders of magnitude on CPU (V2 interpreted); linear hides V1
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("ms / step (median)")


def _stage_bars(ax: Any, entries: list[dict], labels: list[str]) -> None:
    """Bars per (run, stage); within a group, one bar per engine."""
    width = 0.8 / len(labels)
    ticks, names = [], []
    for i, (entry, row) in enumerate((e, r) for e in entries for r in ROWS):
        for j, label in enumerate(labels):
            y = median(entry[label], *stat_keys(row))
            if y is not None:
                ax.bar(i + (j - (len(labels) - 1) / 2) * width, y, width,
                       **bar_style(label, STAGE_COLOURS[row]))
        ticks.append(i)
        names.append(row if len(entries) == 1 else f"{entry['label']}\n{row}")
    ax.set_xticks(ticks, names, rotation=30, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms / step (median)")


def _rate_panel(ax: Any, entries: list[dict], labels: list[str], key: str, unit: str,
                floor_key: str = "tokens_per_s") -> None:
    width = 0.8 / len(labels)
    for i, entry in enumerate(entries):
        for j, label in enumerate(labels):
            stats = entry[label].get(key)
            if not stats:
                continue
            x = i + (j - (len(labels) - 1) / 2) * width
            err = [[stats["median"] - stats["min"]], [stats["max"] - stats["median"]]]
            ax.bar(x, stats["median"], width, yerr=err, capsize=4,
                   **bar_style(label, "tab:purple"))
        if "floor" in entry:  # the workload's floor at the measured rates
            ax.hlines(entry["floor"][floor_key], i - 0.45, i + 0.45, colors="black",
                      linestyles=":", label="floor")
    ax.set_xticks(range(len(entries)), [e["label"] for e in entries])
    ax.set_ylabel(f"{unit} (median, min..max)")


def _spec_panel(ax: Any, entries: list[dict], runners: list[str]) -> None:
    """The spec workload: each config's speedup (output tokens/s over the runner's
    baseline's), a bar per runner; 1 is the baseline. A refused or failed engine: a note
    where its bar would be."""
    configs = [e for e in entries if e["speculative_config"] is not None]
    width = 0.8 / len(runners)
    for i, entry in enumerate(configs):
        for j, runner in enumerate(runners):
            x = i + (j - (len(runners) - 1) / 2) * width
            speedup = entry[runner].get("speedup")
            if speedup is None:
                why = next((k for k in ("refused", "failed") if k in entry[runner]), "no baseline")
                ax.text(x, 0.05, f"{runner.upper()} {why}", rotation=90, ha="center",
                        va="bottom", fontsize=7)
                continue
            ax.bar(x, speedup, width, **bar_style(runner, "tab:purple"))
    ax.axhline(1.0, color="black", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(configs)), [e["label"] for e in configs], rotation=30, ha="right",
                  fontsize=7)
    ax.set_ylabel("speedup (tokens/s over the baseline)")


def _legend(fig: Any, labels: list[str]) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=STAGE_COLOURS[row], label=row) for row in ROWS]
    for label in labels:
        handles.append(Line2D([], [], color="grey", label=f"{label.upper()} (line)",
                              **line_style(label)))
        style = bar_style(label, "grey")
        style["facecolor"] = style.pop("color", "none")
        handles.append(Patch(label=f"{label.upper()} (bar)", **style))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 9), fontsize=8,
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
