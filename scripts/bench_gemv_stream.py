"""The flat-stream GEMV (shared.model.gemv_stream) against the tuned per-tile GEMV
(shared.model.gemv, the table's config) and cuBLAS on the llama-3-8b batch-1 shapes.

1. Per shape: every stream config of a small sweep, timed as bench_gemv times (per call
   from a CUDA graph of back-to-back PDL launches over ~1 GiB of weight copies), each
   checked against the float32 oracle first.
2. A layer chain: qkv -> o_proj -> gate_up -> down over distinct layer weights, in one
   graph, with the per-tile kernels, the stream kernels (best config per shape), and the
   faster of the two per shape: the per-layer time the decode step would see.

  python3 scripts/bench_gemv_stream.py --out stream.json
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

from bench_gemv import SHAPES, Case, timed  # noqa: E402

from shared.bench.measure import graph_time_ms, measure_read_bandwidth  # noqa: E402
from shared.model import gemv, gemv_stream  # noqa: E402

LLAMA = [s for s in SHAPES if s[0].startswith("llama") and s[0] != "llama lm_head"]


def sweep(name: str, rows: int, k: int, epilogue: str, head_dim: int) -> list[tuple]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for bn, bk, stages in itertools.product((32, 64), (128, 256), (3, 4, 5)):
        if k % bk or (epilogue == "rope" and (head_dim // 2) % bn):
            continue
        for programs in (sms, 2 * sms):
            out.append((bn, bk, 4, stages, programs, 0))
    return out


def bench_shape(shape, bw) -> dict:
    name, rows, k, epilogue, has_norm, head_dim, rope_heads = shape
    case = Case(rows, k, epilogue, has_norm, head_dim, rope_heads, 1, torch.bfloat16)
    key = gemv.config_key(epilogue, has_norm, rows, k, 1, torch.bfloat16)
    table = gemv._config_table(torch.cuda.get_device_name())
    base_cfg = table.get(key)
    gbps = lambda ms: case.weight_bytes / ms / 1e6 / bw  # noqa: E731
    result = {"shape": name, "weight_bytes": case.weight_bytes,
              "cublas_ms": timed([lambda w=w: F.linear(case.x, w) for w in case.weights]),
              "tile_config": base_cfg, "tile_ms": timed(case.fused(base_cfg)), "stream": []}
    kw = case.kw

    def calls(cfg):
        return [lambda w=w: gemv_stream.stream_gemv(case.x, w, **kw, config=cfg)
                for w in case.weights]

    configs = sweep(name, rows, k, epilogue, head_dim)
    for cfg in configs:
        try:
            out = gemv_stream.stream_gemv(case.x, case.weights[0], **kw, config=cfg).float()
        except Exception as e:  # e.g. shared memory exceeded: not a candidate
            print(f"  {name} {cfg}: does not run ({type(e).__name__})", flush=True)
            continue
        err = (out - case.ref).abs().max().item()
        if err > 0.05 * max(1.0, case.ref.abs().max().item()):
            raise AssertionError(f"{name} stream {cfg}: differs from float32 by {err}")
        again = gemv_stream.stream_gemv(case.x, case.weights[0], **kw, config=cfg).float()
        if not torch.equal(out, again):  # split tiles joined in either order: same bits
            raise AssertionError(f"{name} stream {cfg}: two calls differ")
        result["stream"].append({"config": list(cfg), "time_ms": timed(calls(cfg))})
    best = sorted(result["stream"], key=lambda r: r["time_ms"])[:3]
    for r in best:  # the L2 prefetch before the PDL wait, on the best three
        cfg = tuple(r["config"][:5]) + (512,)
        result["stream"].append({"config": list(cfg), "time_ms": timed(calls(cfg))})
    result["stream"].sort(key=lambda r: r["time_ms"])
    top = result["stream"][0]
    print(f"{name:>14}: cuBLAS {result['cublas_ms'] * 1e3:6.1f} us ({gbps(result['cublas_ms']):.0%})"
          f" | tile {base_cfg} {result['tile_ms'] * 1e3:6.1f} us ({gbps(result['tile_ms']):.0%})"
          f" | stream {top['config']} {top['time_ms'] * 1e3:6.1f} us ({gbps(top['time_ms']):.0%})",
          flush=True)
    for r in result["stream"][:8]:
        print(f"      {r['config']} {r['time_ms'] * 1e3:6.1f} us ({gbps(r['time_ms']):.0%})")
    result["case"] = case
    return result


# What the paired SiLU rows and the norm prologue cost: gate_up's matrix as a plain GEMV,
# and with SiLU but no norm, with the per-tile kernel's configs.
PROBES = [("gate_up as plain", 28672, 4096, "none", False, 0, 0),
          ("gate_up silu only", 28672, 4096, "silu", False, 0, 0),
          ("down as plain", 4096, 14336, "none", False, 0, 0)]
PROBE_CONFIGS = [(32, 256, 4, 2, 0), (64, 256, 4, 3, 1), (64, 128, 4, 3, 1), (32, 512, 4, 5, 1)]


def probes(bw) -> list[dict]:
    out = []
    for name, rows, k, epilogue, has_norm, head_dim, rope_heads in PROBES:
        case = Case(rows, k, epilogue, has_norm, head_dim, rope_heads, 1, torch.bfloat16)
        row = {"shape": name, "tile": {}}
        for cfg in PROBE_CONFIGS:
            try:
                row["tile"][str(list(cfg))] = timed(case.fused(cfg))
            except Exception as e:  # noqa: BLE001 (shared memory exceeded)
                print(f"  probe {name} {cfg}: does not run ({type(e).__name__})")
        row["cublas_ms"] = timed([lambda w=w, x=case.x: F.linear(x, w) for w in case.weights])
        print(f"probe {name:>18}: cuBLAS {row['cublas_ms'] * 1e3:6.1f} us | "
              + " | ".join(f"{c} {t * 1e3:6.1f} us ({case.weight_bytes / t / 1e6 / bw:.0%})"
                           for c, t in row["tile"].items()), flush=True)
        out.append(row)
        torch.cuda.empty_cache()
    return out


def layer_chain(results: list[dict], layers: int = 8) -> dict:
    """Per-layer time of the four GEMVs back to back over `layers` distinct weight sets."""
    cases = [r["case"] for r in results]
    weights = [[c.weights[i % len(c.weights)] for c in cases] for i in range(layers)]
    tile_cfgs = [r["tile_config"] for r in results]
    stream_cfgs = [tuple(r["stream"][0]["config"]) for r in results]
    picks = {
        "tile": [("tile", c) for c in tile_cfgs],
        "stream": [("stream", c) for c in stream_cfgs],
        "faster": [("stream", s) if r["stream"][0]["time_ms"] < r["tile_ms"] else ("tile", t)
                   for r, s, t in zip(results, stream_cfgs, tile_cfgs)],
    }
    out = {}
    for label, pick in picks.items():
        def step(pick=pick):
            for ws in weights:
                for case, w, (kind, cfg) in zip(cases, ws, pick):
                    if kind == "tile":
                        gemv.gemv(case.x, w, **case.kw, config=cfg)
                    else:
                        gemv_stream.stream_gemv(case.x, w, **case.kw, config=cfg)
        out[label] = {"per_layer_ms": graph_time_ms(step, 20, calls=1) / layers,
                      "pick": [[k, list(c)] for k, c in pick]}
        print(f"layer chain {label:>6}: {out[label]['per_layer_ms'] * 1e3:6.1f} us per layer",
              flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    bw = measure_read_bandwidth(torch.device("cuda")) / 1e9
    gpu = torch.cuda.get_device_name()
    print(f"GPU {gpu}: read bandwidth {bw:.0f} GB/s", flush=True)
    probe_rows = probes(bw)
    results = [bench_shape(shape, bw) for shape in LLAMA]
    chain = layer_chain(results)
    for r in results:
        del r["case"]
    report = {"command": "python3 scripts/bench_gemv_stream.py " + " ".join(sys.argv[1:]),
              "gpu": gpu, "read_bandwidth_GBps": bw, "shapes": results, "layer_chain": chain,
              "probes": probe_rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
