"""Batch-1 weight GEMVs: the model's fused Triton GEMVs (shared.model.kernels.gemv) against cuBLAS
(F.linear) and against the unfused chain they replace, on the llama-3-8b and qwen3-0.6b
decoder shapes; tunes the launch config per shape and writes the table the model reads.

Each configuration is checked against float32 math before it is timed. Times are per
call from a CUDA graph of back-to-back calls, as the runners replay decode, over enough
distinct weight copies (like distinct layers) that nothing is served from L2.

  python3 scripts/bench_gemv.py --out gemv.json [--configs-out gemv_configs.json] [--token-rows]
      [--ms 1,4] [--shapes llama,qwen3,llama1b]

On a machine without a GPU, `--check` runs the kernel under the Triton interpreter on a
small shape against F.linear (correctness only; tests/shared/model/kernels/test_gemv.py is thorough).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy.kernel_options import KernelOptions  # noqa: E402
from shared.harness.measure import graph_time_ms, measure_read_bandwidth  # noqa: E402
from shared.model.kernels import fused_ops, gemv  # noqa: E402
from shared.model.layers import RotaryEmbedding  # noqa: E402
from shared.runtime.kernel_options import use_kernel_options  # noqa: E402

# (name, weight rows, K, epilogue, input norm, head_dim, rope heads)
SHAPES = [
    ("llama qkv", 6144, 4096, "rope", True, 128, 40),
    ("llama o_proj", 4096, 4096, "residual", False, 0, 0),
    ("llama gate_up", 28672, 4096, "silu", True, 0, 0),
    ("llama down", 4096, 14336, "residual", False, 0, 0),
    ("llama lm_head", 128256, 4096, "none", False, 0, 0),
    ("qwen3 qkv", 4096, 1024, "none", True, 0, 0),
    ("qwen3 o_proj", 1024, 2048, "residual", False, 0, 0),
    ("qwen3 gate_up", 6144, 1024, "silu", True, 0, 0),
    ("qwen3 down", 1024, 3072, "residual", False, 0, 0),
    ("qwen3 lm_head", 151936, 1024, "none", False, 0, 0),
    # llama-3.2-1b: the draft model of the speculative-decoding runs (issue 22)
    ("llama1b qkv", 3072, 2048, "rope", True, 64, 40),
    ("llama1b o_proj", 2048, 2048, "residual", False, 0, 0),
    ("llama1b gate_up", 16384, 2048, "silu", True, 0, 0),
    ("llama1b down", 2048, 8192, "residual", False, 0, 0),
    ("llama1b lm_head", 128256, 2048, "none", False, 0, 0),
]
# (BLOCK_N, BLOCK_K, warps, stages, kernel): the FMA kernel (kernel 0; stages do not
# apply), the double-buffered FMA kernel (2) and the tensor-core one (1).
SWEEP = [*itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (2, 4), (0,)),
         *itertools.product((4, 8, 16, 32), (128, 256, 512), (4, 8), (1,), (2,)),
         *itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 5), (1,))]
# More than one token row (a speculative verify, a draft's catch-up): the tensor-core
# kernel, which reads the weights once for all rows (the FMA kernels read them per row).
SWEEP_ROWS = list(itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 5), (1,)))
REPS = 20
COPY_BYTES = 1 << 30  # distinct weight copies per shape: ~1 GiB, >> the 50 MB L2


def timed(fns: list, reps: int = REPS) -> float:
    """Per-call ms of the calls in `fns` (each on its own weight copy) replayed in a graph."""
    cycle = itertools.cycle(fns)
    rounds = max(1, math.ceil(16 / len(fns)))
    return graph_time_ms(lambda: next(cycle)(), reps, calls=len(fns) * rounds)


class Case:
    """Weights (several copies), inputs and the float32 reference of one shape."""

    def __init__(self, rows, k, epilogue, has_norm, head_dim, rope_heads, m, dtype):
        dev = "cuda"
        gen = torch.Generator(device=dev).manual_seed(0)
        bytes_per = rows * k * torch.empty((), dtype=dtype).element_size()
        copies = max(2, min(64, COPY_BYTES // bytes_per))
        self.weights = [torch.randn(rows, k, device=dev, dtype=dtype, generator=gen) * k**-0.5
                        for _ in range(copies)]
        self.weight_bytes = bytes_per
        self.x = torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
        self.kw = {"epilogue": epilogue}
        if has_norm:
            self.kw.update(norm_weight=1 + 0.1 * torch.randn(k, device=dev, generator=gen).to(dtype),
                           eps=1e-5)
        if epilogue == "residual":
            self.kw["residual"] = torch.randn(m, rows, device=dev, dtype=dtype, generator=gen)
        if epilogue == "rope":
            rope = RotaryEmbedding(head_dim, head_dim, 4096, {"rope_type": "default",
                                                              "rope_theta": 5e5}).to(dev)
            self.kw.update(positions=torch.full((m,), 1000, device=dev),
                           cos_sin_cache=rope.cos_sin_cache, head_dim=head_dim,
                           num_rope_heads=rope_heads)
        self.unfused = self._unfused_chain(self.kw, self.x, epilogue, has_norm, head_dim)
        # The oracle: the unfused chain (norm kernel, cuBLAS, the op after) in float32.
        kw32 = {k_: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                for k_, v in self.kw.items()}
        chain32 = self._unfused_chain(kw32, self.x.float(), epilogue, has_norm, head_dim)
        self.ref = chain32(self.weights[0].float()).float()

    @staticmethod
    def _unfused_chain(kw, x, epilogue, has_norm, head_dim):
        """What the model runs without the GEMV path: norm kernel, cuBLAS, the op after."""

        def chain(w):
            h = fused_ops.rms_norm(x, kw["norm_weight"], kw["eps"]) if has_norm else x
            y = F.linear(h, w)
            if epilogue == "silu":
                return fused_ops.silu_and_mul(y)
            if epilogue == "rope":  # in place in y
                fused_ops.qk_norm_rope(y, kw["positions"], kw["cos_sin_cache"], 32, 8,
                                       head_dim, head_dim, None, None, 0.0)
            if epilogue == "residual":
                return y + kw["residual"]
            return y
        return chain

    def fused(self, config):
        return [lambda w=w: gemv.gemv(self.x, w, **self.kw, config=config) for w in self.weights]


def bench_shape(name, rows, k, epilogue, has_norm, head_dim, rope_heads, m, bw, sweep=True,
                config=None) -> dict:
    case = Case(rows, k, epilogue, has_norm, head_dim, rope_heads, m, torch.bfloat16)
    cublas_ms = timed([lambda w=w: F.linear(case.x, w) for w in case.weights])
    unfused_ms = timed([lambda w=w: case.unfused(w) for w in case.weights])
    best, by_kernel, failed = None, {}, 0
    for cfg in (SWEEP if m == 1 else SWEEP_ROWS) if sweep else [config]:
        try:
            out = gemv.gemv(case.x, case.weights[0], **case.kw, config=cfg).float()
        except Exception as e:  # e.g. a dot tile that exceeds shared memory: not a candidate
            failed += 1
            print(f"  {name} config {cfg} does not run: {type(e).__name__}", flush=True)
            continue
        err = (out - case.ref).abs().max().item()
        if err > 0.05 * max(1.0, case.ref.abs().max().item()):
            raise AssertionError(f"{name} config {cfg}: differs from float32 by {err}")
        ms = timed(case.fused(cfg))
        result = {"config": list(cfg), "time_ms": ms, "max_abs_err": err}
        kind = ("fma", "dot", "fma2")[cfg[4]]
        if kind not in by_kernel or ms < by_kernel[kind]["time_ms"]:
            by_kernel[kind] = result
        if best is None or ms < best["time_ms"]:
            best = result
    # The winner once more without programmatic dependent launch.
    with use_kernel_options(KernelOptions(pdl=False)):
        best["time_ms_without_pdl"] = timed(case.fused(best["config"]))
    gbps = lambda ms: case.weight_bytes / ms / 1e6  # noqa: E731
    row = {"shape": name, "rows": rows, "K": k, "m": m, "epilogue": epilogue, "norm": has_norm,
           "weight_bytes": case.weight_bytes, "cublas_ms": cublas_ms, "unfused_ms": unfused_ms,
           "fused": best, "best_by_kernel": by_kernel, "configs_that_failed_to_run": failed, "cublas_of_read_bw": gbps(cublas_ms) / bw,
           "fused_of_read_bw": gbps(best["time_ms"]) / bw,
           "key": gemv.config_key(epilogue, has_norm, rows, k, m, torch.bfloat16)}
    print(f"{name:>14} m={m} {rows:>6}x{k:<6} cuBLAS {cublas_ms * 1e3:6.1f} us "
          f"({row['cublas_of_read_bw']:.0%}) unfused chain {unfused_ms * 1e3:6.1f} us | fused "
          f"{epilogue}{'+norm' if has_norm else ''} {best['time_ms'] * 1e3:6.1f} us "
          f"({row['fused_of_read_bw']:.0%}) config {best['config']} "
          f"(without PDL {best['time_ms_without_pdl'] * 1e3:.1f} us)"
          + "".join(f" | best {k} {v['time_ms'] * 1e3:.1f} us" for k, v in by_kernel.items()),
          flush=True)
    return row


def merge_configs(path: Path, gpu: str, configs: dict[str, list]) -> None:
    """Write `configs` (config_key -> config) into the launch table at `path` under `gpu`,
    keeping every other entry and device."""
    tables = json.loads(path.read_text()) if path.exists() else {}
    tables.setdefault(gpu, {}).update(configs)
    path.write_text(json.dumps(tables, indent=1, sort_keys=True) + "\n")


def check_on_cpu() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(1, 300), torch.randn(37, 300)
    torch.testing.assert_close(gemv.gemv(x, w, config=(8, 128, 4, 2)), F.linear(x, w),
                               rtol=1e-5, atol=1e-4)
    print("ok: interpreter GEMV matches F.linear")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--configs-out", type=Path, default=None,
                   help="write the best config per shape (gemv_configs.json's format)")
    p.add_argument("--check", action="store_true", help="interpreter correctness check only")
    p.add_argument("--token-rows", action="store_true",
                   help="also time 2-16 token rows on the llama shapes (where MAX_TOKENS comes from)")
    p.add_argument("--ms", default="1",
                   help="token rows to tune, comma-separated (1: batch-1 decode; 4: a k=3 "
                        "verify); each (shape, rows) gets its own table entry")
    p.add_argument("--shapes", default="llama,qwen3",
                   help="model families of SHAPES to run: llama, qwen3, llama1b")
    args = p.parse_args()
    families = set(args.shapes.split(","))
    shapes = [shape for shape in SHAPES if shape[0].split()[0] in families]
    if args.check or not torch.cuda.is_available():
        check_on_cpu()
        return 0
    bw = measure_read_bandwidth(torch.device("cuda")) / 1e9
    gpu = torch.cuda.get_device_name()
    print(f"GPU {gpu}: read bandwidth {bw:.0f} GB/s", flush=True)
    rows = []
    for m in (int(m) for m in args.ms.split(",")):
        for shape in shapes:
            rows.append(bench_shape(*shape, m, bw))
            torch.cuda.empty_cache()  # the last shape's weight copies
            if args.configs_out:  # after each shape: a run cut short keeps what it tuned
                row = rows[-1]
                merge_configs(args.configs_out, gpu, {row["key"]: row["fused"]["config"]})
    if args.token_rows:
        # More token rows, tensor-core kernel with the best M=1 dot config: where the GEMV
        # path stops paying against cuBLAS (MAX_TOKENS).
        best_dot = {r["shape"]: r["best_by_kernel"]["dot"]["config"] for r in rows
                    if r["m"] == 1}
        for shape in [s_ for s_ in shapes if s_[0] in best_dot][:4]:
            for m in (2, 4, 8, 16):
                rows.append(bench_shape(*shape, m, bw, sweep=False, config=best_dot[shape[0]]))
    report = {"command": "python3 scripts/bench_gemv.py " + " ".join(sys.argv[1:]),
              "gpu": gpu, "read_bandwidth_GBps": bw, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
