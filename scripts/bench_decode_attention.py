"""The fused decode attention kernel (KV write + attention + split reduce) alone, batch 1,
llama-3-8b heads (32 q / 8 kv, head_dim 128), bf16, over contexts, per launch config.

The step measured the kernel's warps / pipeline stages at context 1024 only (bench_decode
modes attnwarpsN / attnstagesN); this times them where a split holds several KV tiles.
Each call replayed from a CUDA graph of back-to-back calls (graph_time_ms).

  python3 scripts/bench_decode_attention.py --out attn.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy.kernel_options import KernelOptions  # noqa: E402
from shared.attention import decode_attention as fused  # noqa: E402
from shared.harness.measure import graph_time_ms  # noqa: E402
from shared.runtime.kernel_options import use_kernel_options  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
CONFIGS = [(4, 3), (8, 1), (8, 3), (4, 1), (8, 2)]  # (warps, stages)


def time_us(ctx: int, splits: int, reps: int) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    blocks = -(-ctx // BLOCK)
    k_cache = torch.randn(blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(1, HEADS, HEAD_DIM, device=dev, dtype=dt)
    key, value = (torch.randn(1, KV_HEADS, HEAD_DIM, device=dev, dtype=dt) for _ in range(2))
    output = torch.empty_like(query)
    block_table = torch.randperm(blocks, device=dev, dtype=torch.int32)[None, :]
    seq_lens = torch.tensor([ctx], device=dev, dtype=torch.int32)
    qsl = torch.tensor([0, 1], device=dev, dtype=torch.int32)
    last = ctx - 1
    slot = block_table[0, last // BLOCK].to(torch.int64) * BLOCK + last % BLOCK
    row = {}
    for warps, stages in CONFIGS:
        options = KernelOptions(attention_num_warps=warps, decode_attention_num_stages=stages)

        def call(options=options):
            fused.decode_attention(query, key, value, k_cache, v_cache, output, qsl, seq_lens,
                             block_table, slot.view(1), HEAD_DIM**-0.5, num_splits=splits)

        with use_kernel_options(options):  # the graph captures the launches with them
            row[f"w{warps}_s{stages}"] = graph_time_ms(call, reps) * 1e3
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    report = {"gpu": torch.cuda.get_device_name(), "us_per_call": {}}
    for ctx in (1024, 4096, 16384, 32768, 131072):
        row = time_us(ctx, splits=64, reps=args.reps)  # 64: batch 1's split count
        report["us_per_call"][ctx] = row
        print(f"ctx {ctx:6d}: " + "  ".join(f"{k} {v:6.2f}" for k, v in row.items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
