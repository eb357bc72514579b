"""Decode step time vs the HBM floor, both runners side by side (issue: CUDA graphs).

  python3 scripts/bench_decode.py --out decode.json [--steps N] [--skip-llama] [--skip-qwen]
      [--rows v1,v2,...] [--repeats N]

1. llama-3-8b shape, dummy bf16 weights, batch 1, context 1024, FULL graphs:
   step GPU time (forward, LM head and sampler, CUDA events from the forward's start to the
   sample stage's end) against floor = non-embedding weight bytes (the LM head's included)
   / measured read bandwidth; the forward alone against the floor less the LM head; for
   V1, V2, V2 with async scheduling, V1 with the fused GEMVs off ("v1-cublas"), V1
   without programmatic dependent launch ("v1-nopdl") and V1 with a KV-write kernel
   before the decode attention ("v1-nofusedkv"); see make_engine for the modes a row may
   combine.
2. qwen3-0.6b shape, batch 1 / 64 / 256 / 512: GPU and wall step time per runner,
   graphs vs eager, and the launch-bound gap at batch 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time

import torch

from policy.kernel_options import KernelOptions
from shared.harness.measure import measure_read_bandwidth, run_decode
from shared.serving.engine import LLMEngine

LLAMA_RUNNERS = ("v1-cublas", "v1-nopdl", "v1-nofusedkv", "v1", "v2", "v2-async")
_FLAGS = {  # mode -> the KernelOptions it sets
    "cublas": {"gemv": False}, "nopdl": {"pdl": False},
    "nofusedkv": {"fused_decode_kv_write": "never"},
    "fusedkv": {"fused_decode_kv_write": "always"},
    "preload": {"decode_attention_preload": True},
    "nopreload": {"decode_attention_preload": False},
    "bi": {"batch_invariant": True},
}
_NUMBERED = {  # attn<knob>N -> the KernelOptions field it sets to N
    "min": "attention_min_tiles_per_split", "tile": "attention_tile_n",
    "warps": "attention_num_warps", "stages": "decode_attention_num_stages",
    "splits": "attention_num_splits",
}


def kernel_options_for(modes: set[str], gemv_configs: dict | None = None) -> KernelOptions:
    """The KernelOptions a row's modes ask for (see make_engine)."""
    changes: dict = {"gemv_configs": dict(gemv_configs or {})}
    for m in modes & _FLAGS.keys():
        changes.update(_FLAGS[m])
    for m in modes:
        if g := re.fullmatch(r"attn(min|tile|warps|stages|splits)(\d+)", m):
            changes[_NUMBERED[g[1]]] = int(g[2])
    return KernelOptions(**changes)


def make_engine(model: str, runner: str, eager: bool, max_num_seqs: int, sizes: list[int],
                max_model_len: int, blocks: int, gemv_configs: dict | None = None) -> LLMEngine:
    """runner: "v1" or "v2", then optionally "-" and modes joined by "+", each for the
    engine's graph capture and every step after it (its KernelOptions, policy/kernel_options.py):
    - "async": the engine's async scheduling;
    - "cublas": batch-1 fused GEMV path off (cuBLAS + separate kernels);
    - "nopdl": no programmatic dependent launch;
    - "nofusedkv" / "fusedkv": the uniform-decode KV write in its own kernel / inside the
      decode attention, whatever the batch (default: triton_backend's rule);
    - "preload" / "nopreload": the decode attention holds its first tile across the PDL
      wait always / never (default: preload_first_tile's rule);
    - "bi": batch-invariant mode (policy/batch_invariance.py), to price it against the
      row without;
    - "attnminN" / "attntileN" / "attnwarpsN" / "attnstagesN" / "attnsplitsN", N an integer:
      the unified attention's fewest tiles per split, single-query tile and warps, the fused
      decode kernel's pipeline stages, and N KV splits for every decode launch;
    - "noattn" (a diagnostic, its tokens are wrong): the benchmark-only NULL attention
      backend, which launches nothing, so the row prices the attention's share of the step.
    gemv_configs: GEMV launch configs by shape key over the device's table (the tuner's).
    E.g. "v1-cublas+nopdl"."""
    from policy import EngineArgs

    runner, _, mode = runner.partition("-")
    modes = set(mode.split("+")) - {""}
    numbered = {m for m in modes if re.fullmatch(r"attn(min|tile|warps|stages|splits)\d+", m)}
    unknown = modes - {"async", "noattn", *_FLAGS} - numbered
    if unknown:
        raise ValueError(f"bench_decode --rows: unknown mode(s) {sorted(unknown)} in {runner}-{mode}")
    args = EngineArgs(
        async_scheduling="async" in modes,
        model=model, load_format="dummy", dtype="bfloat16", device="cuda", seed=0,
        model_runner=runner, enforce_eager=eager, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(8192, max_num_seqs), max_model_len=max_model_len,
        num_gpu_blocks_override=blocks, cudagraph_capture_sizes=None if eager else sizes,
        enable_prefix_caching=False, kernel_options=kernel_options_for(modes, gemv_configs),
        attention_backend="NULL" if "noattn" in modes else "auto",
    )
    return LLMEngine.from_engine_args(args)


def free(engine: LLMEngine) -> None:
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def llama_row(runner: str, bw: float, steps: int) -> tuple[dict, dict]:
    """One engine of the llama-3-8b batch-1 comparison: (its figures, its tokens)."""
    engine = make_engine("llama-3-8b", runner, False, 8, [1, 2, 4, 8], 2048, 512)
    executor = engine.runner.executor
    weight_bytes = executor.weight_bytes(include_embedding=False)
    head = executor.model.lm_head.weight
    head_bytes = head.numel() * head.element_size()
    samples, steady_ms, tokens = run_decode(engine, 1, 1024, warmup=10, steps=steps, tag="r")
    free(engine)
    s = samples.summary()
    return {
        "summary": s, "steady_ms": steady_ms, "forward_gpu_ms": s["forward_gpu_ms"]["median"],
        "step_gpu_ms": s["step_gpu_ms"]["median"], "wall_ms": s["wall_ms"]["median"],
        "weight_bytes": weight_bytes, "floor_ms": weight_bytes / bw * 1e3,
        # the graph's share of the floor: the LM head runs after it, in the sample stage
        "forward_floor_ms": (weight_bytes - head_bytes) / bw * 1e3,
    }, tokens


def llama_batch1(bw: float, steps: int, rows: list[str], repeats: int) -> dict:
    """Each row's engine `repeats` times, in the order rows, reversed rows, rows, ... (so a
    drift of the machine over the run does not favour the rows that come first); a row's
    figures are the medians over its repeats of the per-run medians."""
    result = {"model": "llama-3-8b", "batch": 1, "context": 1024, "repeats": repeats}
    runs: dict[str, list[dict]] = {r: [] for r in rows}
    tokens = {}
    for i in range(repeats):
        for runner in rows if i % 2 == 0 else rows[::-1]:
            run, tokens[runner] = llama_row(runner, bw, steps)
            runs[runner].append(run)
            for k in ("weight_bytes", "floor_ms", "forward_floor_ms"):
                result[k] = run[k]
    floor_ms = result["floor_ms"]
    for runner, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("step_gpu_ms", "forward_gpu_ms", "wall_ms", "steady_ms")}
        # v2-async: the step loop overlaps the host's next step with the GPU's current
        # one, so its per-step wall time is only meaningful unsynchronised (steady_ms).
        # The headline is step_gpu (forward + LM head + sampler) against the whole floor;
        # the forward alone is compared with the floor less the LM head's weight.
        result[runner] = {
            **med, "runs": rs,
            "step_gpu_ms_per_run": [r["step_gpu_ms"] for r in rs],
            "step_gpu_over_floor": med["step_gpu_ms"] / floor_ms,
            "forward_gpu_over_forward_floor": med["forward_gpu_ms"] / result["forward_floor_ms"],
            "wall_over_floor": med["wall_ms"] / floor_ms,
            "steady_over_floor": med["steady_ms"] / floor_ms,
            "achieved_GBps_step": result["weight_bytes"] / med["step_gpu_ms"] / 1e6,
        }
    # The run ends in an abort: the async engine drops the token it had in flight, so
    # its lists may be one token shorter (a prefix of the synchronous ones).
    if "v1" in tokens and tokens.keys() & {"v2", "v2-async"}:  # whichever V2 rows ran
        ref = tokens["v1"]
        same = "v2" not in tokens or ref == tokens["v2"]
        if "v2-async" in tokens:
            late = tokens["v2-async"]
            same = same and ref.keys() == late.keys() and all(
                ref[r][: len(late[r])] == late[r] and len(ref[r]) - len(late[r]) <= 1 for r in ref)
        result["tokens_identical"] = same
    if "v1" in tokens:  # per row; bf16 rows with another summation order may flip a tie
        for runner in rows:
            if runner.startswith("v1"):
                result[runner]["tokens_same_as_v1"] = tokens[runner] == tokens["v1"]
    if {"v1", "v1-cublas"} <= tokens.keys():
        # bf16: a different summation order may flip a near-tie, so this one is reported only.
        result["tokens_same_as_cublas"] = tokens["v1-cublas"] == tokens["v1"]
    return result


def qwen_ladder(steps: int, batches: list[int], runners: list[str], eager_too: bool) -> dict:
    result = {"model": "qwen3-0.6b", "context": 128, "rows": []}
    for runner in runners:
        for eager in (False, True) if eager_too else (False,):
            engine = make_engine("qwen3-0.6b", runner, eager, max(batches), batches, 1024, 16384)
            for batch in batches:
                samples, steady_ms, _ = run_decode(engine, batch, 128, warmup=5, steps=steps,
                                                   tag=f"{runner}{eager}{batch}-")
                s = samples.summary()
                result["rows"].append({
                    "runner": runner, "graphs": not eager, "batch": batch,
                    "step_gpu_ms": s["step_gpu_ms"]["median"],
                    "forward_gpu_ms": s["forward_gpu_ms"]["median"], "wall_ms": s["wall_ms"]["median"],
                    "steady_ms": steady_ms, "stages_ms": {k: v.get("median") for k, v in s["stages_ms"].items()},
                    "modes": s["cudagraph_modes"],
                })
                print(json.dumps(result["rows"][-1]), flush=True)
            free(engine)
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--skip-qwen", action="store_true")
    p.add_argument("--rows", default=",".join(LLAMA_RUNNERS),
                   help="llama-3-8b rows, comma-separated (default: all of them)")
    p.add_argument("--repeats", type=int, default=1, help="engines per llama row")
    p.add_argument("--qwen-runners", default="v1,v2",
                   help="qwen3-0.6b rows, comma-separated, with modes as --rows")
    p.add_argument("--qwen-graphs-only", action="store_true", help="no eager qwen3 rows")
    p.add_argument("--qwen-batches", default="1,64,256,512", help="qwen3-0.6b batch sizes")
    args = p.parse_args()
    device = torch.device("cuda")
    bw = measure_read_bandwidth(device)
    report = {
        "command": "python3 scripts/bench_decode.py " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(), "read_bandwidth_GBps": bw / 1e9,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(f"GPU {report['gpu']}: measured read bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    if not args.skip_llama:
        rows = args.rows.split(",")
        report["llama_3_8b_batch1"] = r = llama_batch1(bw, args.steps, rows, args.repeats)
        print(f"llama-3-8b B=1 ctx 1024: floor {r['floor_ms']:.3f} ms "
              f"(without the LM head {r['forward_floor_ms']:.3f})", flush=True)
        for runner in rows:
            x = r[runner]
            print(f"  {runner}: step GPU {x['step_gpu_ms']:.3f} ms ({x['step_gpu_over_floor']:.3f}x floor), "
                  f"forward GPU {x['forward_gpu_ms']:.3f} ms ({x['forward_gpu_over_forward_floor']:.3f}x "
                  f"its floor), steady {x['steady_ms']:.2f} ms ({x['steady_over_floor']:.3f}x); "
                  "step GPU per run " + " ".join(f"{ms:.3f}" for ms in x["step_gpu_ms_per_run"])
                  + f"; tokens same as v1: {x.get('tokens_same_as_v1')}",
                  flush=True)
        v2_rows = " vs ".join(n.upper() for n in ("v2", "v2-async") if n in r)
        print(f"  tokens identical V1 vs {v2_rows or 'V2'} (fused GEMVs): {r.get('tokens_identical')}; "
              f"same as with cuBLAS: {r.get('tokens_same_as_cublas')}", flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if not args.skip_qwen:
        batches = [int(b) for b in args.qwen_batches.split(",")]
        report["qwen3_0_6b_ladder"] = qwen_ladder(args.steps, batches,
                                                  args.qwen_runners.split(","),
                                                  not args.qwen_graphs_only)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
