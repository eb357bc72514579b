"""Where a decode step's time goes: torch.profiler over a few decode steps (CUDA graphs
unless --eager), the top GPU kernels by device time and the top CPU ops by self time.

  python3 scripts/profile_decode.py --model qwen3-0.6b --batch 1 [--runner v2] [--eager]
      [--pdl] [--async-scheduling] [--nano-prompts] [--batch-invariant] [--prompt-len N]
      [--out DIR]

--nano-prompts takes the prompts of the throughput workload (lengths 100-1024, ragged
contexts as in `runnerlab ab --workloads throughput`) instead of 128 tokens each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict

import torch

from shared.contract.sampling_params import SamplingParams
from shared.serving.engine import LLMEngine


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--runner", default="v2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--pdl", action="store_true",
                   help="keep programmatic dependent launch on: a kernel's time then includes "
                        "its wait for the one before, so per-kernel times overlap")
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--nano-prompts", action="store_true")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant mode (issue 26): where its step's time goes")
    p.add_argument("--prompt-len", type=int, default=128)
    args = p.parse_args()
    from policy import EngineArgs
    from policy.kernel_options import KernelOptions

    if args.nano_prompts:
        from shared.harness.workloads import nano_vllm_workload

        prompts = nano_vllm_workload(num_requests=args.batch)[0]
    else:
        prompts = [[(i * 7 + j) % 1000 + 1 for j in range(args.prompt_len)]
                   for i in range(args.batch)]
    # KV blocks for every prompt plus its 64 outputs (and a margin): no preemption
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, load_format="dummy", dtype="bfloat16", device="cuda", seed=0,
        model_runner=args.runner, enforce_eager=args.eager, max_num_seqs=max(8, args.batch),
        max_model_len=2048, num_gpu_blocks_override=max(
            2048 // 16, sum(-(-(len(p) + 80) // 16) for p in prompts)),
        enable_prefix_caching=False, kernel_options=KernelOptions(pdl=args.pdl),
        async_scheduling=args.async_scheduling, max_num_batched_tokens=8192,
        batch_invariant=args.batch_invariant,
    ))
    params = SamplingParams(max_tokens=64, temperature=0.6, seed=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    # past the prefills (chunked by the 8192-token budget), then a few decode steps
    for _ in range(8 + -(-sum(map(len, prompts)) // 8192)):
        engine.step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    out_dir = args.out or tempfile.mkdtemp()
    os.makedirs(out_dir, exist_ok=True)
    trace = os.path.join(out_dir, f"trace_{args.model}_{args.runner}_b{args.batch}.json")
    prof.export_chrome_trace(trace)
    print_kernels_by_grid(trace, steps=5)
    return 0


def print_kernels_by_grid(trace_path: str, steps: int) -> None:
    """GPU kernels grouped by (name, grid), per step: the aggregate table above lumps
    every GEMV shape into one row, and a kernel's grid tells the shapes apart."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            groups[(e["name"][:48], str(e.get("args", {}).get("grid")))].append(e["dur"])
    total = sum(sum(v) for v in groups.values())
    print(f"\nkernels by (name, grid), per step of {steps}; all kernels {total / steps:.1f} us")
    print(f"{'kernel':48} {'grid':>18} {'calls':>6} {'us/step':>9} {'us/call':>8}")
    for (name, grid), durs in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name:48} {grid:>18} {len(durs) / steps:6.0f} {sum(durs) / steps:9.1f} "
              f"{sum(durs) / len(durs):8.2f}")


if __name__ == "__main__":
    sys.exit(main())
