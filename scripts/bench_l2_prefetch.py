"""Does pulling the output projection's weight into L2 while the attention chain runs
make the batch-1 layer faster? (shared/model/l2_prefetch.py)

Replays, in one CUDA graph, 32 layers of the llama-3-8b shapes cut down to the part that
matters here: the fused qkv GEMV (50 MB streamed), the decode attention over a 1024-token
paged context (KV write left out) and the fused o_proj GEMV (33.5 MB), each layer with its
own weights so nothing is L2-resident by accident; with and without an L2 prefetch of the
layer's o_proj weight on a side stream forked after its qkv GEMV. Rows with a fixed idle
kernel (torch.cuda._sleep) in place of the attention show the effect without the
attention's own memory traffic.

  python3 scripts/bench_l2_prefetch.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.attention.triton_unified_attention import paged_attention  # noqa: E402
from shared.bench.measure import graph_time_ms  # noqa: E402
from shared.model import gemv  # noqa: E402
from shared.model.l2_prefetch import l2_prefetch  # noqa: E402

SM_CLOCK_MHZ = 1980  # the H200's boost clock: _sleep counts cycles
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK, CTX = 32, 4096, 32, 8, 128, 16, 1024


def build(device: str) -> dict:
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

    blocks = CTX // BLOCK
    return {
        "w_qkv": [randn(6144, HIDDEN, scale=HIDDEN**-0.5) for _ in range(LAYERS)],
        "w_o": [randn(HIDDEN, HIDDEN, scale=HIDDEN**-0.5) for _ in range(LAYERS)],
        "norm": torch.ones(HIDDEN, dtype=torch.bfloat16, device=device),
        "x": randn(1, HIDDEN),
        "key_cache": [randn(blocks, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)],
        "value_cache": [randn(blocks, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)],
        "block_table": torch.randperm(blocks, generator=g, device=device).int()[None],
        "seq_lens": torch.tensor([CTX], dtype=torch.int32, device=device),
        "query_start_loc": torch.tensor([0, 1], dtype=torch.int32, device=device),
        "out": torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device),
    }


def layers_fn(t: dict, middle: str, prefetch: bool, sleep_cycles: int):
    side = torch.cuda.Stream()

    def run():
        main = torch.cuda.current_stream()
        x = t["x"]
        for i in range(LAYERS):
            qkv = gemv.gemv(x, t["w_qkv"][i], norm_weight=t["norm"], eps=1e-5)
            if prefetch:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    l2_prefetch(t["w_o"][i])
            if middle == "attention":
                q = qkv[:, :HEADS * HEAD_DIM].view(1, HEADS, HEAD_DIM)
                paged_attention(q, t["key_cache"][i], t["value_cache"][i], t["out"],
                                t["query_start_loc"], t["seq_lens"], t["block_table"],
                                HEAD_DIM**-0.5, run_single_query=True, run_multi_query=False,
                                num_splits=64)
                attn = t["out"].view(1, HIDDEN)
            else:
                if middle == "sleep":
                    torch.cuda._sleep(sleep_cycles)
                attn = qkv[:, :HIDDEN]
            x = gemv.gemv(attn, t["w_o"][i], epilogue="residual", residual=x)
        if prefetch:
            main.wait_stream(side)
        return x

    return run


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    t = build("cuda")
    rows = []
    for middle, sleep_us in (("none", 0), ("sleep", 4), ("sleep", 8), ("attention", 0)):
        cycles = int(sleep_us * SM_CLOCK_MHZ)
        times = {}
        for prefetch in (False, True, False, True):  # A B A B: drift shows
            ms = graph_time_ms(layers_fn(t, middle, prefetch, cycles), args.reps, calls=1)
            times.setdefault(prefetch, []).append(ms)
        row = {"middle": middle, "sleep_us": sleep_us,
               "per_layer_us": {str(k): [round(v * 1e3 / LAYERS, 2) for v in vs]
                                for k, vs in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    # the o_proj GEMV alone, 32 different weights (cold) vs one weight 32 times (L2-hot)
    for label, pick in (("o_proj cold", lambda i: i), ("o_proj hot", lambda i: 0)):
        def only_o(pick=pick):
            x = t["x"]
            for i in range(LAYERS):
                x = gemv.gemv(x, t["w_o"][pick(i)], epilogue="residual", residual=x)
        us = graph_time_ms(only_o, args.reps, calls=1) * 1e3 / LAYERS
        rows.append({"middle": label, "per_call_us": round(us, 2)})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
