"""Which tile of the batch-invariant matmul runs qwen3-0.6b's decode GEMMs fastest at the
medium row counts (M = 64, 256) where the mode's cost sits above its 1.15x target, beside
cuBLAS (F.linear) on the same shapes.

For each shape, every (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the grid below
is timed at each M (a CUDA graph of one call, median) beside the engine's own launch
(`invariant_linear`) and cuBLAS. A config counts only if its output for 256 rows equals
the engine's bitwise: the tile must not change the bits, only the speed. GPU only.

  python3 scripts/sweep_bi_matmul_medium.py --out sweep_medium.json [--rep 20]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_batch_invariant_matmul import _inputs, graph_ms  # noqa: E402
from shared.model.kernels import batch_invariant_matmul as bim  # noqa: E402

SHAPES = {  # name: (N, K), qwen3-0.6b (16 / 8 heads of 128, hidden 1024, MLP 3072), largest first
    "lm_head": (151936, 1024), "gate_up": (6144, 1024), "qkv": (4096, 1024),
    "down": (1024, 3072), "o_proj": (1024, 2048),
}
GRID = dict(block_m=(16, 32, 64, 128), block_n=(32, 64, 128), block_k=(64, 128),
            warps=(4, 8), stages=(3, 4))
ROWS = (64, 256)


def run(x, w, block_m, config):
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    bim._launch(x, w, None, out, config, block_m)
    return out


def sweep_shape(name: str, rep: int) -> dict:
    n, k = SHAPES[name]
    gen, w, _ = _inputs(n, k, seed=0)
    probe = torch.randn((max(ROWS), k), generator=gen, device="cuda").to(w.dtype)
    want = bim.invariant_linear(probe, w)
    engine_us = {m: graph_ms(lambda m=m: bim.invariant_linear(probe[:m], w), rep) * 1e3
                 for m in ROWS}
    cublas_us = {m: graph_ms(lambda m=m: F.linear(probe[:m], w), rep) * 1e3 for m in ROWS}
    results = []
    for bm, bn, bk, warps, stages in itertools.product(*GRID.values()):
        config = (bn, min(bk, k), warps, stages)
        try:
            same = bool(torch.equal(run(probe, w, bm, config), want))
        except Exception as exc:  # noqa: BLE001 (a config that does not compile: skipped)
            results.append({"block_m": bm, "config": config, "error": repr(exc)[:200]})
            continue
        times = {m: graph_ms(lambda m=m, bm=bm, config=config: run(probe[:m], w, bm, config),
                             rep) * 1e3 for m in ROWS}
        results.append({"block_m": bm, "config": config, "bitwise_equal": same, "us": times})
    ok = [r for r in results if r.get("bitwise_equal")]
    print(f"{name} N={n} K={k}: engine " + ", ".join(
        f"M={m} {engine_us[m]:.1f} us (cuBLAS {cublas_us[m]:.1f})" for m in ROWS))
    for m in ROWS:
        best = min(ok, key=lambda r: r["us"][m])
        print(f"  best at M={m}: BLOCK_M {best['block_m']} {best['config']} "
              f"{best['us'][m]:.1f} us (at M={ROWS}: {[round(best['us'][r], 1) for r in ROWS]})")
    print(f"  bitwise different: "
          f"{[(r['block_m'], r['config']) for r in results if r.get('bitwise_equal') is False]}")
    return {"engine_us": engine_us, "cublas_us": cublas_us, "results": results}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rep", type=int, default=20)
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    report = {"command": " ".join(["python3", *sys.argv]),
              "gpu": torch.cuda.get_device_name()}
    for name in args.shapes.split(","):  # written after each shape: a timeout keeps the rest
        report[name] = sweep_shape(name, args.rep)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
