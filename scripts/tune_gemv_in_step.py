"""Tune llama-3-8b's batch-1 GEMV launch configs (the four per layer and the LM head's)
inside the decode step they run in.

bench_gemv times each shape alone and bench_gemv_variants the four in a chain; neither
has the attention kernels, the norms and the LM head around them, and a config that wins
there can lose in the step (the step kept only part of the variants table's gain in the
chain: docs/results/raw/77684d6/h200_decode_llama3_8b_variants_table.json). Here each candidate is a whole V1 engine (llama-3-8b, dummy bf16 weights,
batch 1, context 1024, FULL graphs) with the candidates as KernelOptions.gemv_configs, timed by the GPU time
of its decode step, forward + LM head + sampler (median over the steps; the runs before
2026-11-30's fifth session timed the forward alone, which leaves the LM head out).
Coordinate descent from the current table: one shape at a time, each candidate of
CANDIDATES, keep one only if it beats the best so far by more than --margin ms; then the table and the tuned configs side by side, in
alternating order, --confirm times each. One round walks ~130 engines, ~5 minutes on
the H200.

  python3 scripts/tune_gemv_in_step.py --out tune.json [--configs-out FILE] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import free, make_engine  # noqa: E402
from bench_gemv import merge_configs  # noqa: E402

from shared.harness.measure import measure_read_bandwidth, run_decode  # noqa: E402
from shared.model.kernels import gemv  # noqa: E402

# config_key -> configs to try, (BLOCK_N, BLOCK_K, warps, stages, kernel, 1): the
# double-buffered FMA kernel (2) over a grid of tiles, and the other kernels' best few from
# docs/results/raw/77684d6/h200_gemv_variants.log and the tables before.
_FMA2 = [(n, k, w, 1, 2, 1) for n in (4, 8, 16) for k in (128, 256, 512) for w in (4, 8)]
# Not here: the dot kernel in 16- or 32-row tiles with 3-5 cp.async stages (the LM head's
# kind of config at many programs). On the layer GEMVs every one lost
# (docs/results/raw/8b91117/h200_gemv_tune_in_step_dot.log).
CANDIDATES = {
    "rope+norm:6144x4096:m1:bfloat16": _FMA2 + [(8, 256, 8, 2, 0, 1)],
    "residual:4096x4096:m1:bfloat16": _FMA2 + [(8, 512, 8, 4, 0, 1)],
    "silu+norm:28672x4096:m1:bfloat16": _FMA2 + [
        (32, 256, 4, 2, 0, 1)],
    "residual:4096x14336:m1:bfloat16": _FMA2 + [(32, 512, 4, 5, 1, 1)],
    # the LM head: only the runs from the fifth session on time it (see the docstring)
    "none:128256x4096:m1:bfloat16": _FMA2 + [
        (64, 128, 4, 3, 1, 1), (32, 128, 4, 3, 1, 1), (64, 256, 4, 3, 1, 1),
        (64, 128, 8, 4, 1, 1)],
}
ONLY = {  # --only: a subset of the candidates
    "lmhead": lambda key, cfg: key.startswith("none"),
}


def step_ms(configs: dict[str, tuple], steps: int, log: list) -> float:
    """Median decode-step GPU ms (forward + LM head + sampler) of a fresh V1 engine with
    these GEMV configs."""
    try:
        engine = make_engine("llama-3-8b", "v1", False, 8, [1, 2, 4, 8], 2048, 512,
                             gemv_configs=configs)
        samples, _, _ = run_decode(engine, 1, 1024, warmup=10, steps=steps, tag="t")
        ms = statistics.median(samples.step_gpu_ms)
    except Exception as e:  # e.g. a tile past the shared memory: the candidate loses
        print(f"  failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        ms = float("inf")
    engine = None
    free(engine)
    log.append({"configs": {k: list(v) for k, v in configs.items()}, "step_gpu_ms": ms})
    print(f"  {ms:.4f} ms  {[list(configs[k]) for k in CANDIDATES]}", flush=True)
    return ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--configs-out", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--only", default="", choices=["", *ONLY],
                   help="'lmhead': only the LM head's candidates (default: all)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--margin", type=float, default=0.004, help="ms a candidate must win by")
    p.add_argument("--confirm", type=int, default=3)
    args = p.parse_args()
    bw = measure_read_bandwidth(torch.device("cuda")) / 1e9
    gpu = torch.cuda.get_device_name()
    table = gemv._config_table(gpu)
    start = {k: (*table[k], *(0,) * (5 - len(table[k])), *(1,) * (6 - max(5, len(table[k]))))
             for k in CANDIDATES}  # padded as gemv._config_for pads
    print(f"GPU {gpu}: read bandwidth {bw:.0f} GB/s; table {start}", flush=True)
    log: list = []
    best, best_ms = dict(start), step_ms(start, args.steps, log)
    for _ in range(args.rounds):
        for key, cands in CANDIDATES.items():
            if args.only:
                cands = [c for c in cands if ONLY[args.only](key, c)]
            for cfg in cands:
                if cfg == best[key]:
                    continue
                ms = step_ms({**best, key: cfg}, args.steps, log)
                if ms < best_ms - args.margin:
                    best, best_ms = {**best, key: cfg}, ms
    confirm = {"table": [], "tuned": []}
    for i in range(args.confirm):
        for label in ("table", "tuned") if i % 2 == 0 else ("tuned", "table"):
            confirm[label].append(step_ms(start if label == "table" else best, args.steps, log))
    table_ms, tuned_ms = (statistics.median(confirm[k]) for k in ("table", "tuned"))
    print(f"table {table_ms:.4f} ms, tuned {tuned_ms:.4f} ms: {best}", flush=True)
    if args.configs_out and tuned_ms < table_ms - args.margin:
        merge_configs(args.configs_out, gpu, {k: list(v) for k, v in best.items()})
        print(f"wrote {args.configs_out}", flush=True)
    report = {"command": "python3 scripts/tune_gemv_in_step.py " + " ".join(sys.argv[1:]),
              "gpu": gpu, "read_bandwidth_GBps": bw, "table": {k: list(v) for k, v in start.items()},
              "tuned": {k: list(v) for k, v in best.items()}, "confirm_ms": confirm,
              "table_ms": table_ms, "tuned_ms": tuned_ms, "runs": log}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
