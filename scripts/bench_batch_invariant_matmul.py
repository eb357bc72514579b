"""The batch-invariant matmul (shared.model.kernels.batch_invariant_matmul) against cuBLAS
(F.linear) on llama-3-8b's layer and LM-head shapes, bf16, M from 1 to 8192; and the
experiment that decides whether a later version may choose BLOCK_M from M. GPU only.

Timing: each call is captured in a CUDA graph of its own (no Python launch cost, as under
the runners' graphs) and its replay timed by triton.testing.do_bench (median), which
clears L2 between calls, so the weight streams from HBM as in a decode step. Each row of
the table also says whether the batch's row 0 equals that row computed alone (bitwise),
the property the kernel exists for.

Experiment: the same rows (M = 256) computed with BLOCK_M 16, the engine's, and 32, 64, 128
(on sm_90 Triton lowers a 16- or 32-row dot to mma.sync and a 64-row one to wgmma: the
script reads the instruction from each compiled kernel's PTX), then at BLOCK_M 16 with
other BLOCK_K / BLOCK_N. Bitwise equal to the engine's rows or not, per shape. Equal
BLOCK_M rows would let a later version pick tall tiles for large M without losing the
invariance; unequal ones mean BLOCK_M must stay fixed. (Equal BLOCK_K / BLOCK_N rows mean
the config may be retuned without changing any result.)

  python3 scripts/bench_batch_invariant_matmul.py --out bi_matmul.json [--rep 50]

Runs in about a minute on an H200 (the M = 8192 LM head dominates).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.model.kernels import batch_invariant_matmul as bim  # noqa: E402
from shared.runtime.triton_utils import triton  # noqa: E402

SHAPES = {  # name: (N, K), llama-3-8b
    "qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
    "down": (4096, 14336), "lm_head": (128256, 4096),
}
ROWS = [1, 8, 64, 256, 1024, 8192]
BLOCK_MS = [16, 32, 64, 128]
EXPERIMENT_ROWS = 256


def graph_ms(fn, rep_ms: int) -> float:
    """Median ms of one call of `fn`, replayed from a CUDA graph."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = triton.testing.do_bench(graph.replay, warmup=max(5, rep_ms // 5), rep=rep_ms,
                                 return_mode="median")
    del graph
    return ms


def _inputs(n: int, k: int, seed: int, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn((n, k), generator=gen, device="cuda") * k**-0.5).to(dtype)
    needle = torch.randn((1, k), generator=gen, device="cuda").to(dtype)
    return gen, w, needle


def time_shape(name: str, rep_ms: int) -> list[dict]:
    n, k = SHAPES[name]
    gen, w, needle = _inputs(n, k, seed=0)
    config = bim.invariant_config(n, k, w.dtype, w.device)
    alone = bim.invariant_linear(needle, w)[0]
    rows = []
    for m in ROWS:
        x = torch.randn((m, k), generator=gen, device="cuda").to(w.dtype)
        x[0] = needle[0]
        ours = bim.invariant_linear(x, w)
        ref = F.linear(x, w)
        invariant = bool(torch.equal(ours[0], alone))
        rel_err = ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        del ours, ref
        ours_ms = graph_ms(lambda x=x: bim.invariant_linear(x, w), rep_ms)
        cublas_ms = graph_ms(lambda x=x: F.linear(x, w), rep_ms)
        flops = 2.0 * m * n * k
        row = {"shape": name, "n": n, "k": k, "m": m, "config": list(config),
               "invariant_ms": ours_ms, "cublas_ms": cublas_ms, "ratio": ours_ms / cublas_ms,
               "invariant_tflops": flops / ours_ms / 1e9, "cublas_tflops": flops / cublas_ms / 1e9,
               "weight_gbps": w.numel() * w.element_size() / ours_ms / 1e6,
               "row0_equals_alone": invariant, "max_rel_diff_vs_cublas": rel_err}
        rows.append(row)
        print(f"{name:8s} {n:6d}x{k:5d} M={m:5d} {str(config):20s} ours {ours_ms * 1e3:9.1f} us "
              f"cuBLAS {cublas_ms * 1e3:9.1f} us  {ours_ms / cublas_ms:5.2f}x  "
              f"{row['invariant_tflops']:6.1f} TFLOP/s {row['weight_gbps']:6.0f} GB/s  "
              f"invariant={invariant} rel_diff={rel_err:.1e}", flush=True)
        del x
    return rows


def _mma_kind(compiled) -> str:
    ptx = getattr(compiled, "asm", {}).get("ptx", "")
    return "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "fma/other"


def _run(x, w, config, block_m: int) -> tuple[torch.Tensor, str]:
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    compiled = bim._launch(x, w, None, out, config, block_m)
    return out, _mma_kind(compiled)


def _compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (got.float() - ref.float()).abs()
    return {"bitwise_equal": bool(torch.equal(got, ref)),
            "elements_differing": int((got != ref).sum()), "max_abs_diff": diff.max().item()}


def experiment_shape(name: str, dtype: torch.dtype) -> list[dict]:
    """BLOCK_M (and BLOCK_K, BLOCK_N) variants against the engine's rows."""
    n, k = SHAPES[name]
    gen, w, _ = _inputs(n, k, seed=1, dtype=dtype)
    x = torch.randn((EXPERIMENT_ROWS, k), generator=gen, device="cuda").to(dtype)
    config = bim.invariant_config(n, k, dtype, w.device)
    block_n, block_k, warps, stages = config
    ref, ref_mma = _run(x, w, config, bim.BLOCK_M)
    variants = [(bm, config) for bm in BLOCK_MS if bm != bim.BLOCK_M]
    variants += [(bim.BLOCK_M, (block_n, bk, warps, stages))
                 for bk in (max(16, block_k // 2), min(k, 2 * block_k)) if bk != block_k]
    variants += [(bim.BLOCK_M, (bn, block_k, warps, stages))
                 for bn in (16, 64, 128) if bn != block_n]
    if dtype.itemsize == 2:  # the engine's own tall tiles, above MEDIUM_ROWS rows
        variants.append((bim.TALL_CONFIG[0], tuple(bim.TALL_CONFIG[1:])))
    results = []
    for block_m, cfg in variants:
        try:
            got, mma = _run(x, w, cfg, block_m)
            result = _compare(got, ref)
        except Exception as exc:  # a variant that does not compile or launch is reported
            mma, result = "-", {"error": f"{type(exc).__name__}: {exc}"[:300]}
        row = {"shape": name, "dtype": str(dtype)[6:], "m": EXPERIMENT_ROWS,
               "reference": {"block_m": bim.BLOCK_M, "config": list(config), "mma": ref_mma},
               "block_m": block_m, "config": list(cfg), "mma": mma, **result}
        results.append(row)
        print(f"{name:8s} {row['dtype']:8s} BLOCK_M {block_m:3d} {str(cfg):20s} {mma:9s} vs "
              f"BLOCK_M 16 {str(config):20s} {ref_mma:9s}: "
              + (result.get("error") or f"bitwise_equal={result['bitwise_equal']} "
                 f"differing={result['elements_differing']} max={result['max_abs_diff']:.2e}"),
              flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON report path")
    parser.add_argument("--rep", type=int, default=50, help="do_bench ms per timing")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the timings and the MMA experiment are GPU questions)")
        return 2
    names = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {list(SHAPES)}")
    report = {"command": " ".join(["python3", *sys.argv]),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "num_sms": torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count,
              "timings": [], "experiment": []}
    for name in names:
        report["timings"] += time_shape(name, args.rep)
    for name in names:
        report["experiment"] += experiment_shape(name, torch.bfloat16)
    if "o_proj" in names:
        report["experiment"] += experiment_shape("o_proj", torch.float32)  # the "ieee" dot
    bm = [r for r in report["experiment"] if r["block_m"] != bim.BLOCK_M]
    report["summary"] = {
        "all_rows_invariant": all(r["row0_equals_alone"] for r in report["timings"]),
        "block_m_changes_bits": any(not r.get("bitwise_equal", False) for r in bm),
        "config_changes_bits": any(not r.get("bitwise_equal", False)
                                   for r in report["experiment"] if r["block_m"] == bim.BLOCK_M),
    }
    print(json.dumps(report["summary"]))
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
