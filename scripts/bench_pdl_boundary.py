"""What one kernel boundary costs on this GPU: a chain of near-empty kernels under PDL.

Each kernel waits for its predecessor (griddepcontrol.wait), lets its successor launch,
and adds one to one float per program, so every boundary is a real dependency with
almost no work. A chain of N launches is replayed from one CUDA graph and timed per launch,
for several grid sizes, with programmatic dependent launch on and off. The batch-1 decode
step of llama-3-8b has 6 such boundaries per layer (4 GEMVs, the decode attention and its
split reduce) and 192 in all: this prices their fixed part.

  python3 scripts/bench_pdl_boundary.py --out boundary.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.harness.measure import graph_time_ms  # noqa: E402
from shared.runtime.triton_utils import pdl_wait_and_release, tl, triton  # noqa: E402


@triton.jit
def _link_kernel(x_ptr, USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl_wait_and_release()
    pid = tl.program_id(0)
    tl.store(x_ptr + pid, tl.load(x_ptr + pid) + 1.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launches", type=int, default=192)
    p.add_argument("--grids", default="1,132,528,1584")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    gpu = torch.cuda.get_device_name()
    report = {"command": "python3 scripts/bench_pdl_boundary.py " + " ".join(sys.argv[1:]),
              "gpu": gpu, "launches": args.launches, "rows": []}
    for grid in (int(g) for g in args.grids.split(",")):
        x = torch.zeros(grid, device="cuda")
        for pdl in (True, False):
            extra = {"USE_PDL": True, "launch_pdl": True} if pdl else {"USE_PDL": False}

            def chain(grid=grid, x=x, extra=extra):
                for _ in range(args.launches):
                    _link_kernel[(grid,)](x, num_warps=4, **extra)

            x.zero_()
            chain()
            torch.cuda.synchronize()
            assert torch.all(x == args.launches), "a link lost an update"
            us = graph_time_ms(chain, args.reps, calls=1) / args.launches * 1e3
            report["rows"].append({"grid": grid, "pdl": pdl, "us_per_launch": us})
            print(f"grid {grid:>5}, PDL {'on ' if pdl else 'off'}: {us:.2f} us per launch",
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
