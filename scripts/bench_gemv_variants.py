"""GEMV kernel variants against the tuned table on the llama-3-8b batch-1 shapes, per
shape and in a chain of the four layer GEMVs (what a decode step sees).

1. Per shape: the table's config with and without its first weight tile loaded before the
   PDL wait (config field 6, "preload"), tensor-core tiles both ways, and the
   double-buffered FMA kernel (config field 5 = 2); each checked against the float32
   oracle, then timed as bench_gemv times (per call from a CUDA graph of back-to-back PDL
   launches over ~1 GiB of weight copies).
2. A layer chain: qkv -> o_proj -> gate_up -> down over distinct layer weights in one
   graph, with the table's configs and with the fastest variant per shape.

With --configs-out, the fastest variant per shape goes into that table (merged, like
bench_gemv's) when the chain with them beats the chain with the table.

  python3 scripts/bench_gemv_variants.py --out variants.json [--configs-out FILE]
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv import SHAPES, Case, merge_configs, timed  # noqa: E402

from shared.harness.measure import graph_time_ms, measure_read_bandwidth  # noqa: E402
from shared.model.kernels import gemv  # noqa: E402

LLAMA = [s for s in SHAPES if s[0].startswith("llama") and s[0] != "llama lm_head"]


def candidates(epilogue: str, head_dim: int, table_cfg: tuple) -> list[tuple]:
    """Configs (BLOCK_N, BLOCK_K, warps, stages, kernel, 1) to time for one shape."""
    out = [table_cfg]
    for bn, bk, stages in ((64, 128, 3), (64, 256, 3), (32, 256, 4), (32, 512, 5)):
        out.append((bn, bk, 4, stages, 1, 1))
    for bn, bk, warps in itertools.product((4, 8, 16, 32), (128, 256, 512), (4, 8)):
        if epilogue != "rope" or (head_dim // 2) % bn == 0:
            out.append((bn, bk, warps, 1, 2, 1))
    return list(dict.fromkeys(out))


def bench_shape(shape, bw) -> dict:
    name, rows, k, epilogue, has_norm, head_dim, rope_heads = shape
    case = Case(rows, k, epilogue, has_norm, head_dim, rope_heads, 1, torch.bfloat16)
    key = gemv.config_key(epilogue, has_norm, rows, k, 1, torch.bfloat16)
    table_cfg = gemv._config_for(case.x, key, None)
    gbps = lambda ms: case.weight_bytes / ms / 1e6 / bw  # noqa: E731
    result = {"shape": name, "key": key, "weight_bytes": case.weight_bytes,
              "table_config": list(table_cfg),
              "cublas_ms": timed([lambda w=w: F.linear(case.x, w) for w in case.weights]),
              "variants": []}
    for cfg in candidates(epilogue, head_dim, table_cfg):
        try:
            out = gemv.gemv(case.x, case.weights[0], **case.kw, config=cfg).float()
        except Exception as e:  # noqa: BLE001 (e.g. shared memory exceeded: not a candidate)
            print(f"  {name} {cfg}: does not run ({type(e).__name__})", flush=True)
            continue
        err = (out - case.ref).abs().max().item()
        if err > 0.05 * max(1.0, case.ref.abs().max().item()):
            raise AssertionError(f"{name} {cfg}: differs from float32 by {err}")
        ms = timed(case.fused(cfg))
        result["variants"].append({"config": list(cfg), "time_ms": ms})
    result["variants"].sort(key=lambda r: r["time_ms"])
    result["table_ms"] = next(r["time_ms"] for r in result["variants"]
                              if tuple(r["config"]) == table_cfg)
    print(f"{name:>14}: cuBLAS {result['cublas_ms'] * 1e3:6.1f} us ({gbps(result['cublas_ms']):.0%})"
          f" | table {list(table_cfg)} {result['table_ms'] * 1e3:6.1f} us "
          f"({gbps(result['table_ms']):.0%})", flush=True)
    for r in result["variants"][:10]:
        print(f"      {r['config']} {r['time_ms'] * 1e3:6.1f} us ({gbps(r['time_ms']):.0%})")
    result["case"] = case
    return result


def layer_chain(results: list[dict], layers: int = 8) -> dict:
    """Per-layer time of the four GEMVs back to back over `layers` distinct weight sets:
    the table's configs, then the fastest variant per shape."""
    cases = [r["case"] for r in results]
    weights = [[c.weights[i % len(c.weights)] for c in cases] for i in range(layers)]
    picks = {"table": [tuple(r["table_config"]) for r in results],
             "fastest": [tuple(r["variants"][0]["config"]) for r in results]}
    out = {}
    for label, pick in picks.items():
        def step(pick=pick):
            for ws in weights:
                for case, w, cfg in zip(cases, ws, pick):
                    gemv.gemv(case.x, w, **case.kw, config=cfg)
        out[label] = {"per_layer_ms": graph_time_ms(step, 20, calls=1) / layers,
                      "configs": [list(c) for c in pick]}
        print(f"layer chain {label:>7}: {out[label]['per_layer_ms'] * 1e3:6.1f} us per layer "
              f"{out[label]['configs']}", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--configs-out", type=Path, default=None)
    args = p.parse_args()
    bw = measure_read_bandwidth(torch.device("cuda")) / 1e9
    gpu = torch.cuda.get_device_name()
    print(f"GPU {gpu}: read bandwidth {bw:.0f} GB/s", flush=True)
    results = [bench_shape(shape, bw) for shape in LLAMA]
    chain = layer_chain(results)
    for r in results:
        del r["case"]
    if args.configs_out and chain["fastest"]["per_layer_ms"] < chain["table"]["per_layer_ms"]:
        merge_configs(args.configs_out, gpu, {r["key"]: r["variants"][0]["config"] for r in results})
    report = {"command": "python3 scripts/bench_gemv_variants.py " + " ".join(sys.argv[1:]),
              "gpu": gpu, "read_bandwidth_GBps": bw, "shapes": results, "layer_chain": chain}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
