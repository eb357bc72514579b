"""Tables and the chart for `runnerlab ab`."""

from __future__ import annotations

from shared.step_timing import STAGES


def _med(d: dict, *keys: str) -> float | None:
    for k in keys:
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d.get("median") if isinstance(d, dict) else None


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.3f}{unit}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{b / a:.2f}"


def print_tables(report: dict) -> None:
    print(f"\nrunnerlab ab: {report['model']} ({report['dtype']}) on {report['device']}")
    bw = report.get("read_bandwidth_GBps")
    if bw:
        print(f"measured read bandwidth {bw:.0f} GB/s; non-embedding weights "
              f"{report['weight_bytes'] / 1e9:.3f} GB")
    print(f"tokens identical across runners: {report['tokens_identical']}")
    modes = report.get("async_scheduling", {})
    print("engine loop: " + ", ".join(
        f"{r.upper()} {'async scheduling' if on else 'synchronous'}" for r, on in modes.items()))
    for name, entries in report["workloads"].items():
        print(f"\n== {name} ==  (ms per step: median / p90; ratio = V2/V1 of medians)")
        header = f"{'run':>12} {'stage':>12} {'V1':>17} {'V2':>17} {'V2/V1':>6}"
        print(header)
        for e in entries:
            rows = [("wall", ("wall_ms",))] + [(s, ("stages_ms", s)) for s in STAGES]
            if _med(e["v1"], "forward_gpu_ms") is not None:
                rows.append(("fwd GPU", ("forward_gpu_ms",)))
            if _med(e["v1"], "steady_ms") is not None:
                rows.append(("steady", ("steady_ms",)))
            for stage, keys in rows:
                a, b = _med(e["v1"], *keys), _med(e["v2"], *keys)
                if a is None and b is None:
                    continue
                p90a = e["v1"].get(keys[0], {}) if len(keys) == 1 else e["v1"].get(keys[0], {}).get(keys[1], {})
                p90b = e["v2"].get(keys[0], {}) if len(keys) == 1 else e["v2"].get(keys[0], {}).get(keys[1], {})
                va = f"{_fmt(a)}/{_fmt(p90a.get('p90') if isinstance(p90a, dict) else None)}"
                vb = f"{_fmt(b)}/{_fmt(p90b.get('p90') if isinstance(p90b, dict) else None)}"
                print(f"{e['label']:>12} {stage:>12} {va:>17} {vb:>17} {_ratio(a, b):>6}")
            if "floor_ms" in e:
                ga, gb = e["v1"].get("achieved_GBps"), e["v2"].get("achieved_GBps")
                print(f"{e['label']:>12} {'floor':>12} {e['floor_ms']:.3f} ms (weights/bandwidth);"
                      f" achieved GB/s V1 {_fmt(ga)} V2 {_fmt(gb)}")
            for key in ("output_tokens_per_s", "prefill_tokens_per_s"):
                a, b = _med(e["v1"], key), _med(e["v2"], key)
                if a is not None:
                    def spread(r: str, e=e, key=key) -> str:
                        return f"[{e[r][key]['min']:.0f}..{e[r][key]['max']:.0f}]"

                    print(f"{e['label']:>12} {key:>12} V1 {a:.0f} {spread('v1')}  V2 {b:.0f} "
                          f"{spread('v2')}  V2/V1 {_ratio(a, b)}")


def write_png(report: dict, path: str) -> str | None:
    """Stage time vs batch size for both runners (decode ladder)."""
    entries = report["workloads"].get("decode")
    if not entries:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    batches = [int(e["label"][1:]) for e in entries]
    stages = ["wall"] + list(STAGES)
    fig, axes = plt.subplots(1, len(stages), figsize=(4 * len(stages), 3.6), squeeze=False)
    for ax, stage in zip(axes[0], stages):
        for runner, style in (("v1", "o-"), ("v2", "s-")):
            keys = ("wall_ms",) if stage == "wall" else ("stages_ms", stage)
            ys = [_med(e[runner], *keys) for e in entries]
            ax.plot(batches, ys, style, label=runner.upper())
        ax.set_xscale("log", base=2)
        ax.set_title(stage)
        ax.set_xlabel("decode batch size")
        ax.set_ylabel("ms / step (median)")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"runnerlab ab: {report['model']} {report['dtype']} on {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
