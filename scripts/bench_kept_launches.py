"""Host cost of the per-step sampler launches through Triton's dispatch and through kept
compiled kernels (shared/runtime/triton_launch.py KeptLaunches; GPU machine). Shapes are
small (8 rows of a 4,096-token vocabulary) so that the GPU work is far shorter than a
launch and a loop of N calls measures the host, microseconds per call.

    python scripts/bench_kept_launches.py [--rows 8] [--vocab 4096] [--iters 2000]
        [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from policy.kernel_options import KernelOptions
from runner_v2.sample.gumbel import gumbel_sample
from runner_v2.sample.top_k_top_p import compute_thresholds
from shared.harness.measure import host_us_per_call
from shared.runtime.kernel_options import use_kernel_options
from shared.sampling.noise_kernels import triton_gumbel_noise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n, v, dev = args.rows, args.vocab, torch.device("cuda")
    logits = torch.randn(n, v, device=dev)
    idx = torch.arange(n, dtype=torch.int32, device=dev)
    positions = torch.arange(n, dtype=torch.int64, device=dev)
    temperature = torch.full((n,), 0.8, device=dev)
    seeds = torch.arange(n, dtype=torch.int64, device=dev)
    top_k = torch.zeros(n, dtype=torch.int32, device=dev)
    top_p = torch.full((n,), 0.9, device=dev)
    min_p = torch.zeros(n, device=dev)
    threshold = compute_thresholds(logits, idx, temperature, top_k, top_p, min_p)
    cases = {
        "V2 gumbel_sample (2 launches)": lambda: gumbel_sample(
            logits, idx, positions, temperature, seeds, threshold),
        "V2 compute_thresholds (1 launch)": lambda: compute_thresholds(
            logits, idx, temperature, top_k, top_p, min_p),
        "V1 triton_gumbel_noise (1 launch)": lambda: triton_gumbel_noise(seeds, positions, v),
    }
    results: dict[str, dict[str, list[float]]] = {}
    for name, fn in cases.items():
        results[name] = {"dispatch": [], "kept": []}
        for _ in range(args.repeats):  # alternating, so drift hits both alike
            for mode, keep in (("dispatch", False), ("kept", True)):
                with use_kernel_options(KernelOptions(repeat_launches=keep)):
                    results[name][mode].append(host_us_per_call(fn, args.iters))
    print(f"host us per call, median of {args.repeats} ({torch.cuda.get_device_name()}; "
          f"{n} rows x {v})")
    for name, r in results.items():
        d, k = sorted(r["dispatch"])[args.repeats // 2], sorted(r["kept"])[args.repeats // 2]
        print(f"{name:36s} dispatch {d:7.1f}  kept {k:7.1f}  kept/dispatch {k / d:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": n, "vocab": v,
                       "iters": args.iters, "results_us": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
