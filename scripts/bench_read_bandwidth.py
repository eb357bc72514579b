"""How much the floor's read bandwidth depends on how it is measured.

bench_decode's floor divides the weight bytes by measure_read_bandwidth. Over 4 GiB of
float32 (its form until 2026-11-30's fifth session) identical decode steps gave ratios
that moved with what the measurement read (docs/journal/2026-11-h200-sessions.md, fifth
session; docs/results/raw/8b91117/h200_read_bandwidth_4gib_measure.json), so this script
measures the same
quantity several ways in one process, trial after trial: measure_read_bandwidth as it is,
the sum in float32 and bfloat16 over 1, 4 and 16 GiB (median and best of the reps), and
the LM head's GEMV (llama-3-8b's 128256 x 4096 bf16 weight, one token, the launch table's
config, replayed from a CUDA graph), the read rate a kernel of the step reaches.

  python3 scripts/bench_read_bandwidth.py --out bw.json [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.harness.measure import cuda_times_ms, graph_time_ms, measure_read_bandwidth  # noqa: E402
from shared.model.kernels import gemv  # noqa: E402


def sum_bandwidth(gib: float, dtype: torch.dtype, reps: int) -> dict:
    x = torch.ones(int(gib * 2**30) // torch.tensor([], dtype=dtype).element_size(),
                   dtype=dtype, device="cuda")
    t = cuda_times_ms(lambda: x.sum(dtype=torch.float32), reps, warmup=1) / 1e3
    nbytes = x.numel() * x.element_size()
    return {"median_GBps": nbytes / np.median(t) / 1e9, "best_GBps": nbytes / t.min() / 1e9}


def lm_head_bandwidth(reps: int) -> dict:
    w = torch.randn(128256, 4096, dtype=torch.bfloat16, device="cuda") * 0.02
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    s = graph_time_ms(lambda: gemv.gemv(x, w, None), reps) / 1e3
    return {"median_GBps": w.numel() * w.element_size() / s / 1e9, "median_us": s * 1e6}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "trials": []}
    for trial in range(args.trials):
        row = {"measure_read_bandwidth_GBps": measure_read_bandwidth(torch.device("cuda")) / 1e9}
        for gib in (1.0, 4.0, 16.0):
            for dtype in (torch.float32, torch.bfloat16):
                row[f"sum_{str(dtype)[6:]}_{gib:g}GiB"] = sum_bandwidth(gib, dtype, args.reps)
                torch.cuda.empty_cache()
        row["lm_head_gemv"] = lm_head_bandwidth(args.reps)
        torch.cuda.empty_cache()
        report["trials"].append(row)
        print(f"trial {trial}: " + json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
