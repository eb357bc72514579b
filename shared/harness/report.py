"""The text report of `runnerlab ab`: the header (what ran, with which engine loop and
graphs, and what its numbers do not mean) and one table per workload and engine loop.
The chart is shared/harness/chart.py.

Columns are engines (ab.json's keys: "v1", "v2", or "v1-sync" ... with --engine-loop
both); a table holds the engines of one loop, with V2/V1 ratios when it has both runners.
The spec workload's table has a row per (config, runner) instead (_print_spec), the embed
workload's a row per runner (_print_embed).
"""

from __future__ import annotations

from shared.harness.ab_engines import engine_groups
from shared.runtime.step_timing import STAGES

ROWS = ("wall",) + STAGES  # what a step's time is made of, in the table and the chart
RATE_KEYS = ("output_tokens_per_s", "prefill_tokens_per_s")


def median(d: dict, *keys: str) -> float | None:
    return _stat(d, keys, "median")


def _stat(d: dict, keys: tuple[str, ...], stat: str) -> float | None:
    for k in keys:
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d.get(stat) if isinstance(d, dict) else None


def stat_keys(row: str) -> tuple[str, ...]:
    return ("wall_ms",) if row == "wall" else ("stages_ms", row)


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.3f}{unit}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{b / a:.2f}"


def engine_labels(report: dict) -> list[str]:
    """The engines in measuring order (a report without "engines": one per runner)."""
    return list(report.get("engines") or report.get("runners", ["v1", "v2"]))


def _compares_runners(labels: list[str]) -> bool:
    return [label.partition("-")[0] for label in labels] == ["v1", "v2"]


def _bytes(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x / 1e3:.3g} kB"


def header_lines(report: dict) -> list[str]:
    """The report's first lines: what ran where and how, and what its numbers do not mean."""
    runners = ", ".join(r.upper() for r in report.get("runners", ["v1", "v2"]))
    threads = report.get("settings", {}).get("threads")
    lines = [f"runnerlab ab: {report['model']} ({report['dtype']}) on {report['device']}; "
             f"runners {runners}" + (f"; torch threads {threads}" if threads else "")]
    engines = report.get("engines")
    if engines:
        lines.append("engines: " + "; ".join(
            f"{label.upper()} {e['engine_loop']} loop, graphs {e['cudagraph_mode']}"
            + ("" if not e["cudagraph_capture_sizes"] else f" at {e['capture_sizes']}")
            + ("" if e.get("tensor_parallel_size", 1) == 1
               else f", tensor parallel {e['tensor_parallel_size']}")
            + (", batch-invariant kernels" if e.get("batch_invariant") else "")
            for label, e in engines.items()))
    embed = report.get("workloads", {}).get("embed")
    if embed and list(report["workloads"]) != ["embed"]:  # (alone: they are the engines above)
        lines.append("embed engines (pooling_task='embed'): " + "; ".join(
            f"{r.upper()} {e['engine_loop']} loop, graphs {e['cudagraph_mode']}"
            + ("" if e["capture_sizes"] == "none" else f" at {e['capture_sizes']}")
            for r, e in embed[0]["engines"].items()))
    lines += [f"WARNING: {w}" for w in report.get("warnings", [])]
    lines += [f"CAVEAT: {c}" for c in report.get("caveats", [])]
    note = report.get("settings", {}).get("defaults_note")
    if note:
        lines.append(note)
    return lines


def rates_line(report: dict) -> str | None:
    bw, gemm = report.get("read_bandwidth_GBps"), report.get("gemm_TFLOPs")
    if not bw:
        return None
    line = f"measured read bandwidth {bw:.0f} GB/s"
    if gemm:
        line += f", {report.get('gemm_dtype', report['dtype'])} matmul {gemm:.3g} TFLOP/s"
    if report["device"] == "cpu":
        line += " (the CPU's, on the torch threads above: the floors below are for these rates)"
    return line + f"; a decode step reads {_bytes(report['weight_bytes'])} of weights"


def print_tables(report: dict) -> None:
    labels = engine_labels(report)
    print()
    print("\n".join(header_lines(report)))
    rates = rates_line(report)
    if rates:
        print(rates)
    if len(labels) == 1:
        across = f"{labels[0].upper()}'s runs"
    else:
        across = "runners" if len(report.get("engine_loops", [None])) == 1 else \
            "engines (every runner under every loop)"
    if "tokens_identical" in report:  # (the embed workload alone generates no tokens)
        print(f"tokens identical across {across}: {report['tokens_identical']}")
    groups = engine_groups(labels)
    for name, entries in report["workloads"].items():
        if name in ("spec", "embed"):
            (_print_spec if name == "spec" else _print_embed)(entries, report)
            continue
        for group in groups:
            _print_table(name, entries, group, len(groups) > 1, report["device"])


def _print_table(name: str, entries: list[dict], labels: list[str], per_loop: bool,
                 device: str) -> None:
    both = _compares_runners(labels)
    ratio = "; ratio = V2/V1 of medians" if both else ""
    loop = f", {labels[0].partition('-')[2]} loop" if per_loop else ""
    print(f"\n== {name}{loop} ==  (ms per step: median / p90{ratio})")
    print(f"{'run':>12} {'stage':>12} " + " ".join(f"{label.upper():>17}" for label in labels)
          + (f" {'V2/V1':>6}" if both else ""))
    for e in entries:
        _print_entry(e, labels, both)
        if "floor" in e:
            _print_floor(e, labels, device)


def _print_entry(e: dict, labels: list[str], both: bool) -> None:
    first = e[labels[0]]
    rows = [(row, stat_keys(row)) for row in ROWS]
    if median(first, "forward_gpu_ms") is not None:
        rows.append(("fwd GPU", ("forward_gpu_ms",)))
    if median(first, "step_gpu_ms") is not None:
        # forward + LM head + sampler: a steady step this close to it leaves no GPU idle
        rows.append(("step GPU", ("step_gpu_ms",)))
    if median(first, "steady_ms") is not None:
        rows.append(("steady", ("steady_ms",)))
    for stage, keys in rows:
        medians = [median(e[label], *keys) for label in labels]
        if all(m is None for m in medians):
            continue
        cells = " ".join(f"{_fmt(m) + '/' + _fmt(_stat(e[label], keys, 'p90')):>17}"
                         for label, m in zip(labels, medians))
        print(f"{e['label']:>12} {stage:>12} {cells}"
              + (f" {_ratio(*medians):>6}" if both else ""))
    if "floor_ms" in e:
        achieved = [e[label].get("achieved_GBps") for label in labels]
        shown = "" if all(a is None for a in achieved) else "; achieved GB/s " + " ".join(
            f"{label.upper()} {_fmt(a)}" for label, a in zip(labels, achieved))
        print(f"{e['label']:>12} {'floor':>12} {e['floor_ms']:.3f} ms (weights/bandwidth){shown}")
    for key in RATE_KEYS:
        rates = [median(e[label], key) for label in labels]
        if rates[0] is None:
            continue
        cells = "  ".join(f"{label.upper()} {rate:.0f} [{e[label][key]['min']:.0f}.."
                          f"{e[label][key]['max']:.0f}]" for label, rate in zip(labels, rates))
        print(f"{e['label']:>12} {key:>12} {cells}"
              + (f"  V2/V1 {_ratio(*rates)}" if both else ""))


def _print_floor(e: dict, labels: list[str], device: str) -> None:
    """The workload's floor (shared/harness/floor.py) and the fraction of it each engine
    reached."""
    f, run = e["floor"], f"{e['label']:>12}"
    where = " at the CPU's measured rates" if device == "cpu" else ""
    print(f"{run} {'floor':>12} {f['tokens_per_s']:,.0f} output tokens/s{where} "
          f"({_seconds(f['seconds'])})")
    print(f"{run} {'floor time':>12} decode {f['decode_steps']} steps reading "
          f"{_bytes(f['weight_bytes_read'])} of weights + {_bytes(f['kv_bytes_read'])} of KV: "
          f"{_seconds(f['decode_s'])}; prefill {f['prefill_flops']:.3g} FLOP: "
          f"{_seconds(f['prefill_s'])}")
    cells = "  ".join(f"{label.upper()} {e[label]['floor_fraction']:.3g}" for label in labels)
    print(f"{run} {'of floor':>12} {cells}  (floor time / measured time)")


def _seconds(x: float) -> str:
    return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.3g} ms"


def _print_spec(entries: list[dict], report: dict) -> None:
    """A row per (config, runner): output tokens/s and the speedup over the runner's
    baseline, tokens per step, step and forward GPU times (verify / baseline),
    acceptance; a refused or failed engine's reason; the token mismatches."""
    s = report["settings"]["spec"]
    mode = "greedy" if not s["temperature"] else f"temperature {s['temperature']:g}, seeded"
    print(f"\n== spec, {s['engine_loop']} loop ==  ({s['batch']} x {s['prompt_len']}-token "
          f"prompts, {s['max_tokens']} output tokens each, {mode}; speedup = output tokens/s "
          "over the runner's baseline's; step ms after the prefill, median/p90; fwd GPU ms "
          "verify/baseline)")
    width = max(12, *(len(e["label"]) for e in entries))
    print(f"{'config':>{width}} {'runner':>6} {'tok/s':>9} {'speedup':>7} {'tok/step':>8} "
          f"{'step ms':>15} {'fwd GPU ms':>15} {'accepted':>8} {'mean len':>8}  per position")
    for e in entries:
        for runner in report.get("runners", ["v1", "v2"]):
            print(f"{e['label']:>{width}} {runner.upper():>6} {_spec_cells(e[runner])}")
        for line in e.get("mismatches", []):
            print(f"{e['label']:>{width}} tokens: {line}")


def _spec_cells(st: dict) -> str:
    for key in ("refused", "failed"):
        if key in st:
            return f"{key}: {st[key]}"
    speedup = st.get("speedup")
    gpu = median(st, "forward_gpu_ms")
    gpu_cell = "-" if gpu is None else _fmt(gpu) + (
        "" if st.get("baseline_forward_gpu_ms") is None
        else "/" + _fmt(st["baseline_forward_gpu_ms"]))
    acc = st.get("acceptance")
    acc_cells = (f"{'-':>8} {'-':>8}" if acc is None else
                 f"{acc['acceptance_rate']:>8.3f} {acc['mean_acceptance_length']:>8.3f}  "
                 + ",".join(f"{r:.2f}" for r in acc["acceptance_rate_per_position"]))
    return (f"{median(st, 'output_tokens_per_s') or 0:>9.1f} "
            f"{'-' if speedup is None else f'{speedup:.3f}':>7} "
            f"{median(st, 'tokens_per_step') or 0:>8.3f} "
            f"{_fmt(median(st, 'wall_ms')) + '/' + _fmt(_stat(st, ('wall_ms',), 'p90')):>15} "
            f"{gpu_cell:>15} {acc_cells}")


def _print_embed(entries: list[dict], report: dict) -> None:
    """A row per runner: embeddings/s (median [min..max]), prompt tokens/s, seconds, steps
    and the fraction of the GEMM-rate floor; the floor; the V1 - V2 agreement."""
    runners = report.get("runners", ["v1", "v2"])
    for e in entries:
        f, check = e["floor"], e["agreement"]
        pooler = next(iter(e["engines"].values())).get("pooler") or {}
        pooled = "" if not pooler else f"{pooler['pooling_type']} pooling" + (
            ", normalised" if pooler.get("normalize") else "") + "; "
        print(f"\n== embed, {e['engine_loop']} loop ==  ({e['prompts']} prompts of "
              f"{e['min_len']}..{e['max_len']} tokens, seeded, {e['prompt_tokens']:,} prompt "
              f"tokens; {pooled}wall time from the first add to the last embedding, median "
              "over the runs)")
        print(f"{'runner':>6} {'embeddings/s':>24} {'prompt tok/s':>13} {'seconds':>9} "
              f"{'steps':>6} {'of floor':>8}")
        for r in runners:
            st, rate = e[r], e[r]["embeddings_per_s"]
            cell = f"{rate['median']:,.1f} [{rate['min']:,.1f}..{rate['max']:,.1f}]"
            print(f"{r.upper():>6} {cell:>24} {median(st, 'prompt_tokens_per_s'):>13,.0f} "
                  f"{median(st, 'seconds'):>9.3f} {median(st, 'steps'):>6.0f} "
                  f"{st['floor_fraction']:>8.3g}")
        if _compares_runners(runners):
            ratio = _ratio(*(median(e[r], "embeddings_per_s") for r in ("v1", "v2")))
            print(f"{'V2/V1':>6} {ratio:>24}")
        print(f"{'floor':>6} {f['embeddings_per_s']:,.1f} embeddings/s: {f['prompt_tokens']:,} "
              f"prompt tokens x 2 x {f['matmul_params']:.4g} matmul parameters (of "
              f"{f['parameters']:.4g}) / {f['gemm_flops_per_s'] / 1e12:.3g} TFLOP/s "
              f"{report.get('gemm_dtype', report['dtype'])} = {_seconds(f['seconds'])}; "
              "of floor = floor time / measured time")
        print("embeddings: " + _agreement_line(check))


def _agreement_line(check: dict) -> str:
    cells = [] if check["v1_vs_v2"] is None else [f"max |V1 - V2| {check['v1_vs_v2']:.3g}"]
    cells += [f"{r.upper()}'s runs {d:.3g}" for r, d in check["runs"].items()]
    if check["agree"] is None:
        verdict = f"({check['dtype']}: reported only)"
    else:
        verdict = (f"({check['dtype']}: must be <= {check['tolerance']:g}): "
                   + ("agree" if check["agree"] else "DIFFER"))
    return ", ".join(cells) + " " + verdict
