"""The persistent layer-stream kernel (shared/model/layer_stream.py) against a chain of gemv() kernels under PDL.

The stack: 32 layers of batch-1 GEMVs (qkv, o_proj + residual, gate_up + SiLU, down +
residual; no attention, like bench_decode's `noattn` row) with dummy bf16 weights, at
llama-3-8b's shapes or (--shape small) a llama-like stack a quarter as wide, where the
phase boundaries rather than the bytes set the time. Each is timed from a CUDA graph in
the same process, against the floor of its bytes at the read bandwidth measured in the
same run.

  python3 scripts/bench_layer_stream.py [--shape small] --out stream.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.bench.measure import graph_time_ms, measure_read_bandwidth  # noqa: E402
from shared.model import gemv, gemv_flags, layer_stream  # noqa: E402

# (programs, BLOCK_N, BLOCK_K, num_warps, ahead, sync): programs x BLOCK_N must divide qkv
# (6144), hidden (4096) and intermediate (14336) rows (1024 or 2048), and the programs must
# fit at once (registers; run() refuses otherwise). sync=False rows drop the counters:
# the weight streaming alone, wrong results (not checked).
CONFIGS = {
    # the sweep of docs/results/h200_layer_stream_llama.json (commit df37200) had five
    # more; these are its fastest with and without the counters
    "llama": [(256, 8, 256, 4, 3, True), (512, 4, 256, 4, 3, False)],
    # a stack small enough that the phase boundaries, not the bytes, set the time:
    # programs x BLOCK_N must divide 512
    "small": [(128, 4, 256, 4, 1, True), (256, 2, 256, 4, 1, True), (512, 1, 256, 4, 1, True),
              (128, 4, 128, 4, 3, True), (128, 4, 256, 4, 1, False),
              (512, 1, 256, 4, 1, False)],
}
# (hidden, qkv rows, intermediate): llama-3-8b's, and a small llama-like stack
SHAPES = {"llama": (4096, 6144, 14336), "small": (1024, 1536, 3584)}


def llama_stack(layers: int, shape: str, seed: int = 0) -> layer_stream.LayerStack:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def w(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    H, QKV, INTER = SHAPES[shape]  # noqa: N806
    return layer_stream.LayerStack(
        w(layers, QKV, H), w(layers, H, H, scale=0.01), w(layers, 2 * INTER, H),
        w(layers, H, INTER, scale=0.005), 1 + w(layers, H, scale=0.1),
        1 + w(layers, H, scale=0.1), 1e-5)


def gemv_chain(stack: layer_stream.LayerStack, x: torch.Tensor):
    """The stack as 4 gemv() launches per layer, each with the launch table's config for
    its llama shape (qkv: the RoPE kernel's config, here without the rotation)."""
    qkv_cfg = gemv._config_for(x, gemv.config_key("rope", True, stack.qkv_size, stack.hidden,
                                                  1, x.dtype), None)
    H = stack.hidden  # noqa: N806

    def run() -> torch.Tensor:
        h = x
        for layer in range(stack.layers):
            qkv = gemv.gemv(h, stack.w_qkv[layer], norm_weight=stack.norm1[layer],
                            eps=stack.eps, config=qkv_cfg)
            h_mid = gemv.gemv(qkv[:, :H], stack.w_o[layer], epilogue="residual", residual=h)
            g = gemv.gemv(h_mid, stack.w_gu[layer], norm_weight=stack.norm2[layer],
                          eps=stack.eps, epilogue="silu")
            h = gemv.gemv(g, stack.w_d[layer], epilogue="residual", residual=h_mid)
        return h
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    gpu = torch.cuda.get_device_name()
    bw = measure_read_bandwidth(torch.device("cuda"))
    stack = llama_stack(args.layers, args.shape)
    floor_ms = stack.weight_bytes() / bw * 1e3
    x = (torch.randn(1, stack.hidden, device="cuda")).to(torch.bfloat16)
    chain = gemv_chain(stack, x)
    want = chain()[0].float()
    report = {"command": "python3 scripts/bench_layer_stream.py " + " ".join(sys.argv[1:]),
              "gpu": gpu, "read_bandwidth_GBps": bw / 1e9, "layers": args.layers,
              "shape": dict(zip(("hidden", "qkv", "intermediate"), SHAPES[args.shape])),
              "weight_bytes": stack.weight_bytes(), "floor_ms": floor_ms, "rows": []}
    print(f"GPU {gpu}: read bandwidth {bw / 1e9:.0f} GB/s; {args.layers} layers, "
          f"{stack.weight_bytes() / 1e9:.2f} GB, floor {floor_ms:.3f} ms", flush=True)

    def record(label, ms, extra):
        row = {"label": label, "ms": ms, "x_floor": ms / floor_ms,
               "per_layer_us": ms / args.layers * 1e3, **extra}
        report["rows"].append(row)
        print(f"{label:>34}: {ms:.3f} ms ({row['x_floor']:.3f}x floor, "
              f"{row['per_layer_us']:.1f} us per layer) {extra}", flush=True)

    record("gemv chain (PDL)", graph_time_ms(chain, args.reps, calls=1), {})
    stack.h[0] = x[0]
    for config in CONFIGS[args.shape]:
        programs, block_n, block_k, warps, ahead, sync = config
        label = f"stream P{programs} N{block_n} K{block_k} w{warps} a{ahead}" + (
            "" if sync else " nosync")
        try:
            stack.error.zero_()
            got = stack.run(*config).float()
            torch.cuda.synchronize()
        except ValueError as e:
            print(f"{label:>34}: skipped ({e})", flush=True)
            continue
        err = (got - want).abs().max().item() / want.abs().max().item()
        errors = int(stack.error.item())
        if sync and (errors or err > 0.05):
            print(f"{label:>34}: WRONG (relative error {err:.3g}, {errors} timed-out waits)",
                  flush=True)
            report["rows"].append({"label": label, "wrong": True, "rel_err": err,
                                   "timed_out_waits": errors})
            continue
        ms = graph_time_ms(lambda c=config: stack.run(*c), args.reps, calls=1)
        record(label, ms, {"rel_err_vs_chain": round(err, 5)} if sync else {})
    record("gemv chain (PDL), again", graph_time_ms(chain, args.reps, calls=1), {})
    arena = None

    def flagged():
        with gemv_flags.chain(arena):
            return chain()

    # the flag chain (gemv_flags): each count on its own line (stride 32) or packed;
    # per chunk of 512 or all of x at once; the next kernel launched at the start or after
    # the first chunk; x through L1 (the acquire's order) or L2 only
    variants = [("chunks", 32, "start", False), ("chunks", 1, "start", False),
                ("chunks", 32, "first_chunk", False), ("whole", 32, "start", False),
                ("whole", 32, "first_chunk", False), ("chunks", 32, "start", True)]
    for wait, stride, trigger, l2_only in variants:
        gemv_flags.WAIT, gemv_flags.COUNT_STRIDE = wait, stride
        gemv_flags.TRIGGER, gemv_flags.X_L2_ONLY = trigger, l2_only
        arena = gemv_flags.FlagArena(4 * args.layers, stack.inter, "cuda")
        got = flagged()[0].float()
        torch.cuda.synchronize()
        assert arena.errors() == 0 and torch.equal(got, want), "the flag chain changed x"
        record(f"flags {wait} stride{stride} {trigger}{' L2 only' if l2_only else ''}",
               graph_time_ms(flagged, args.reps, calls=1), {})
        assert arena.errors() == 0
    gemv_flags.WAIT, gemv_flags.COUNT_STRIDE, gemv_flags.TRIGGER = "chunks", 32, "start"
    gemv_flags.X_L2_ONLY = True
    # the upper bound of any finer overlap: no kernel waits for the one before
    gemv.DIAG_NO_PDL_WAIT = True
    record("gemv chain, no PDL wait (wrong)", graph_time_ms(chain, args.reps, calls=1), {})
    gemv.DIAG_NO_PDL_WAIT = False
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
