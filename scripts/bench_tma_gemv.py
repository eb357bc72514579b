"""Batch-1 layer GEMVs through a TMA ring (shared/model/gemv_tma.py) against the PDL chain of gemv() kernels.

The stack: 32 layers of llama-3-8b's four layer GEMVs (qkv with its input norm, o_proj +
residual, gate_up + SiLU with its input norm, down + residual; no attention and no RoPE,
like bench_decode's `noattn` row) with dummy bf16 weights. Each chain is timed from one
CUDA graph in the same process, against the floor of its bytes at the read bandwidth
measured in the same run. First, every TMA config's result is compared with the gemv()
chain's.

  python3 scripts/bench_tma_gemv.py --out tma.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.bench.measure import graph_time_ms, measure_read_bandwidth  # noqa: E402
from shared.model import gemv, gemv_tma  # noqa: E402

HIDDEN, QKV, INTER = 4096, 6144, 14336
# (block_n, block_k, stages, num_warps[, programs]) per GEMV kind, or one for all four;
# programs: at least that many programs, each streaming consecutive row tiles through one
# ring (as few per program as divide the tiles); absent: one row tile per program
CONFIGS = {
    "p128 n16 s8": (16, 256, 8, 4, 128),
    "p128 n16 s4": (16, 256, 4, 4, 128),
    "p128 n8 s16": (8, 256, 16, 4, 128),
    "p128 n8 s8": (8, 256, 8, 4, 128),
    "p256 n8 s8": (8, 256, 8, 4, 256),
    "p256 n8 s4": (8, 256, 4, 4, 256),
    "p264 n8 s4": (8, 256, 4, 4, 264),
    "p512 n8 s4": (8, 256, 4, 4, 512),
    "n16 s4": (16, 256, 4, 4),
    "n16 s6": (16, 256, 6, 4),
    "n8 s8": (8, 256, 8, 4),
    "n8 s4": (8, 256, 4, 4),
    "n4 s8": (4, 256, 8, 4),
    "n32 s3 w8": (32, 256, 3, 8),
    "n8 s2": (8, 256, 2, 4),
    "n8 s3": (8, 256, 3, 4),
    "n16 s2": (16, 256, 2, 4),
    "n16 s3": (16, 256, 3, 4),
    "n8 s4 w8": (8, 256, 4, 8),
}


class Stack:
    def __init__(self, layers: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)

        def w(*shape, scale=0.02):
            return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

        self.layers = layers
        self.w_qkv = w(layers, QKV, HIDDEN)
        self.w_o = w(layers, HIDDEN, HIDDEN, scale=0.01)
        self.w_gu = w(layers, 2 * INTER, HIDDEN)
        self.w_d = w(layers, HIDDEN, INTER, scale=0.005)
        self.norm1 = 1 + w(layers, HIDDEN, scale=0.1)
        self.norm2 = 1 + w(layers, HIDDEN, scale=0.1)
        self.eps = 1e-5

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w_qkv, self.w_o, self.w_gu, self.w_d))


def gemv_chain(s: Stack, x: torch.Tensor):
    qkv_cfg = gemv._config_for(x, gemv.config_key("rope", True, QKV, HIDDEN, 1, x.dtype), None)

    def run() -> torch.Tensor:
        h = x
        for i in range(s.layers):
            qkv = gemv.gemv(h, s.w_qkv[i], norm_weight=s.norm1[i], eps=s.eps, config=qkv_cfg)
            h_mid = gemv.gemv(qkv[:, :HIDDEN], s.w_o[i], epilogue="residual", residual=h)
            g = gemv.gemv(h_mid, s.w_gu[i], norm_weight=s.norm2[i], eps=s.eps, epilogue="silu")
            h = gemv.gemv(g, s.w_d[i], epilogue="residual", residual=h_mid)
        return h
    return run


def tma_chain(s: Stack, x: torch.Tensor, configs: dict, **flags):
    """configs: kind (qkv, o, gu, d) -> (block_n, block_k, stages, num_warps), or None for
    that kind's gemv() kernel with the launch table's config (a hybrid chain)."""
    weights = {"qkv": s.w_qkv, "o": s.w_o, "gu": s.w_gu, "d": s.w_d}
    descs = {kind: [gemv_tma.descriptor(weights[kind][i], *cfg[:2]) for i in range(s.layers)]
             for kind, cfg in configs.items() if cfg is not None}
    qkv_cfg = gemv._config_for(x, gemv.config_key("rope", True, QKV, HIDDEN, 1, x.dtype), None)
    bufs = {"qkv": torch.empty(1, QKV, device="cuda", dtype=x.dtype),
            "gu": torch.empty(1, INTER, device="cuda", dtype=x.dtype),
            "o": torch.empty(s.layers, 1, HIDDEN, device="cuda", dtype=x.dtype),
            "d": torch.empty(s.layers, 1, HIDDEN, device="cuda", dtype=x.dtype)}

    tiles = {}
    for kind, cfg in configs.items():
        if cfg is not None:
            n = (weights[kind].shape[1] // 2 if kind == "gu" else weights[kind].shape[1]) // cfg[0]
            programs = cfg[4] if len(cfg) > 4 else n
            tiles[kind] = max(t for t in range(1, n + 1) if n % t == 0 and n // t >= programs)

    def one(kind, i, x_in, **kwargs):
        cfg = configs[kind]
        if cfg is None:
            if kind == "qkv":
                kwargs["config"] = qkv_cfg
            return gemv.gemv(x_in, weights[kind][i], **kwargs)
        bn, bk, st, nw = cfg[:4]
        out = bufs[kind][i] if kind in ("o", "d") else bufs[kind]
        return gemv_tma.tma_gemv(x_in, weights[kind][i], descs[kind][i], out=out, block_n=bn,
                                 block_k=bk, stages=st, num_warps=nw,
                                 tiles_per_program=tiles[kind], **kwargs, **flags)

    def run() -> torch.Tensor:
        h = x
        for i in range(s.layers):
            qkv = one("qkv", i, h, norm_weight=s.norm1[i], eps=s.eps)
            h_mid = one("o", i, qkv[:, :HIDDEN], epilogue="residual", residual=h)
            g = one("gu", i, h_mid, norm_weight=s.norm2[i], eps=s.eps, epilogue="silu")
            h = one("d", i, g, epilogue="residual", residual=h_mid)
        return h
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--more", default="n8 s4",
                   help="configs also run with the ring filled after the wait, and unwaited")
    p.add_argument("--hybrid", default="n8 s4",
                   help="configs run for some kinds only, gemv() kernels for the rest")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    gpu = torch.cuda.get_device_name()
    bw = measure_read_bandwidth(torch.device("cuda"))
    s = Stack(args.layers)
    floor_ms = s.weight_bytes() / bw * 1e3
    x = torch.randn(1, HIDDEN, device="cuda").to(torch.bfloat16)
    chain = gemv_chain(s, x)
    want = chain()[0].float()
    report = {"command": "python3 scripts/bench_tma_gemv.py " + " ".join(sys.argv[1:]),
              "gpu": gpu, "read_bandwidth_GBps": bw / 1e9, "layers": args.layers,
              "weight_bytes": s.weight_bytes(), "floor_ms": floor_ms, "rows": []}
    print(f"GPU {gpu}: read bandwidth {bw / 1e9:.0f} GB/s; {args.layers} layers, "
          f"{s.weight_bytes() / 1e9:.2f} GB, floor {floor_ms:.3f} ms", flush=True)

    def record(label, fn, check=True, **extra):
        if check:
            got = fn()[0].float()
            torch.cuda.synchronize()
            err = ((got - want).abs().max() / want.abs().max()).item()
            extra["rel_err_vs_gemv_chain"] = round(err, 5)
            if err > 0.05:
                print(f"{label:>40}: WRONG (relative error {err:.3g})", flush=True)
                report["rows"].append({"label": label, "wrong": True, **extra})
                return
        ms = graph_time_ms(fn, args.reps, calls=1)
        row = {"label": label, "ms": ms, "x_floor": ms / floor_ms,
               "per_layer_us": ms / args.layers * 1e3, **extra}
        report["rows"].append(row)
        print(f"{label:>40}: {ms:.3f} ms ({row['x_floor']:.3f}x floor, "
              f"{row['per_layer_us']:.1f} us per layer) {extra}", flush=True)

    record("gemv chain (PDL)", chain, check=False)

    def attempt(label, configs, check=True, **flags):
        try:
            record(label, tma_chain(s, x, configs, **flags), check=check)
        except Exception as e:  # a config the kernel or the TMA refuses
            print(f"{label:>40}: failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
            report["rows"].append({"label": label, "failed": str(e)[:500]})

    for name in args.configs.split(","):
        configs = dict.fromkeys(("qkv", "o", "gu", "d"), CONFIGS[name])
        attempt(f"tma {name}", configs)
        attempt(f"tma {name} early release", configs, early_release=True)
        if name in args.more.split(","):
            attempt(f"tma {name}, ring filled after the wait", configs, prefetch=False)
            attempt(f"tma {name}, no wait (wrong)", configs, check=False, skip_wait=True)
    for name in args.hybrid.split(",") if args.hybrid else ():
        for kinds in (("gu", "d"), ("qkv", "o"), ("d",), ("gu",), ("qkv",), ("o",)):
            configs = {k: (CONFIGS[name] if k in kinds else None)
                       for k in ("qkv", "o", "gu", "d")}
            attempt(f"hybrid: tma {name} for {'+'.join(kinds)}", configs)
    record("gemv chain (PDL), again", chain, check=False)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
