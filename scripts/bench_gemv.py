"""Batch-1 weight GEMVs: cuBLAS (what the model runs today, via F.linear) against a plain
Triton GEMV, on the llama-3-8b layer shapes (the decode-floor issue's open gap: the
profile shows cuBLAS streaming the two small matrices, qkv and o_proj, at ~71% of the
read bandwidth and splitting K with an extra reduction kernel for o_proj and down).

An experiment, not a component: the model does not use this kernel. Each configuration
is checked against F.linear before it is timed; times are per call from a CUDA graph of
back-to-back calls (as the runners replay decode), so launch cost is excluded.

  python3 scripts/bench_gemv.py [--out gemv.json] [--batch 1]

On a machine without a GPU, `--check` runs the kernel under the Triton interpreter on small
shapes against F.linear (correctness only).
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

from shared.bench.measure import graph_time_ms, measure_read_bandwidth  # noqa: E402
from shared.triton_utils import tl, triton  # noqa: E402  (sets up the interpreter on CPU)

# (name, out_features N, in_features K) of one llama-3-8b decoder layer, and its LM head
SHAPES = [
    ("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
    ("down", 4096, 14336), ("lm_head", 128256, 4096),
]
BLOCK_N = (4, 8, 16)
BLOCK_K = (256, 512, 1024)
WARPS = (4, 8)
STAGES = (2, 3, 4)
REPS, CALLS = 30, 20  # timed graph replays, GEMV calls per graph


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] activations, row stride K
    w_ptr,  # [N, K] weight, row-major (nn.Linear's layout)
    y_ptr,  # [M, N] output
    N,
    K,
    M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program = BLOCK_N output rows over the whole of K: each weight row is read once,
    contiguously along K; the M (<= 8) activation rows ride along from L2."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    for m in tl.static_range(M):
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < K
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
                        mask=row_mask[:, None] & col_mask[None, :], other=0.0)
            x = tl.load(x_ptr + m * K + cols, mask=col_mask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        tl.store(y_ptr + m * N + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


def triton_gemv(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int,
                num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    m, k = x.shape
    n, k_w = w.shape
    assert k == k_w and x.is_contiguous() and w.is_contiguous() and m <= 8
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    extra = {} if not x.is_cuda else {"num_warps": num_warps, "num_stages": num_stages}
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, n, k, M=m, BLOCK_N=block_n, BLOCK_K=block_k, **extra
    )
    return y


def bench_shape(name: str, n: int, k: int, batch: int, bw: float) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = F.linear(x, w)
    weight_bytes = w.numel() * w.element_size()
    cublas_ms = graph_time_ms(lambda: F.linear(x, w), REPS, CALLS)
    best = None
    for bn, bk, warps, stages in itertools.product(BLOCK_N, BLOCK_K, WARPS, STAGES):
        out = triton_gemv(x, w, bn, bk, warps, stages)
        err = (out.float() - ref.float()).abs().max().item()
        if err > 5e-2:  # bf16 output of a K-long fp32 sum: a few bf16 ulps
            raise AssertionError(f"{name} BLOCK_N={bn} BLOCK_K={bk}: differs by {err}")
        ms = graph_time_ms(lambda bn=bn, bk=bk, warps=warps, stages=stages:
                           triton_gemv(x, w, bn, bk, warps, stages), REPS, CALLS)
        if best is None or ms < best["time_ms"]:
            best = {"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages,
                    "time_ms": ms, "max_abs_err": err}
    row = {
        "shape": name, "N": n, "K": k, "batch": batch, "weight_bytes": weight_bytes,
        "cublas_ms": cublas_ms, "cublas_GBps": weight_bytes / cublas_ms / 1e6,
        "triton_best": best, "triton_GBps": weight_bytes / best["time_ms"] / 1e6,
    }
    row["cublas_ratio_to_read_bw"] = row["cublas_GBps"] / bw
    row["triton_ratio_to_read_bw"] = row["triton_GBps"] / bw
    print(f"{name:>8} {n:>6}x{k:<6} cuBLAS {cublas_ms * 1e3:8.1f} us "
          f"({row['cublas_ratio_to_read_bw']:.0%})  Triton {best['time_ms'] * 1e3:8.1f} us "
          f"({row['triton_ratio_to_read_bw']:.0%}) best {best}", flush=True)
    return row


def check_on_cpu() -> None:
    """Correctness under the interpreter on small shapes (fp32: no bf16 math there)."""
    torch.manual_seed(0)
    for m, n, k, bn, bk in ((1, 37, 300, 8, 128), (3, 64, 256, 16, 256), (8, 5, 129, 4, 128)):
        x, w = torch.randn(m, k), torch.randn(n, k)
        out = triton_gemv(x, w, bn, bk)
        torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)
        print(f"ok M={m} N={n} K={k} BLOCK_N={bn} BLOCK_K={bk}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--check", action="store_true", help="interpreter correctness check only")
    args = p.parse_args()
    if args.check or not torch.cuda.is_available():
        check_on_cpu()
        return 0
    bw = measure_read_bandwidth(torch.device("cuda")) / 1e9
    print(f"GPU {torch.cuda.get_device_name()}: read bandwidth {bw:.0f} GB/s", flush=True)
    rows = [bench_shape(name, n, k, args.batch, bw) for name, n, k in SHAPES]
    report = {"command": "python3 scripts/bench_gemv.py " + " ".join(sys.argv[1:]),
              "gpu": torch.cuda.get_device_name(), "read_bandwidth_GBps": bw, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
