"""Host cost of the attention that runs eagerly between two piecewise graphs, piece by
piece (GPU machine): the KV write, each paged-attention mapping, the split reduction,
the torch ops around them, a graph replay and a bare Triton launch, in microseconds of
host time per call; and a later layer's launches from the step's plan, through Triton's
dispatch and through kept compiled kernels (RepeatLaunch). The shapes are a small mixed
batch (qwen3-0.6b's heads by default), whose GPU work is far shorter than its launches,
so a loop of N calls measures the host.

    python scripts/bench_attention_host.py [--heads 16] [--kv-heads 8] [--head-dim 128]
        [--tokens 16] [--reqs 8] [--context 512] [--iters 2000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from shared.harness.measure import host_us_per_call


@triton.jit
def _noop_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def main() -> None:
    from policy.kernel_options import KernelOptions
    from shared.attention.kv_write_triton import write_kv_triton
    from shared.attention.triton_unified_attention import PagedAttentionPlan, paged_attention
    from shared.runtime.kernel_options import use_kernel_options
    from shared.runtime.triton_launch import RepeatLaunch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reqs", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    T, R, H, Hkv, D = args.tokens, args.reqs, args.heads, args.kv_heads, args.head_dim
    blocks_per_req = (args.context + T) // args.block_size + 1
    num_blocks = R * blocks_per_req + 1
    cache = torch.zeros(2, num_blocks, args.block_size, Hkv, D, dtype=dt, device=dev)
    q = torch.randn(T, H, D, dtype=dt, device=dev)
    k = torch.randn(T, Hkv, D, dtype=dt, device=dev)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    # R - 1 decode rows of one token, then one row with the rest (a verify / a prefill)
    lens = [1] * (R - 1) + [T - (R - 1)]
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    seq_lens = torch.full((R,), args.context, dtype=torch.int32, device=dev) + torch.tensor(
        lens, dtype=torch.int32, device=dev)
    table = torch.arange(R * blocks_per_req, dtype=torch.int32, device=dev).view(R, -1) + 1
    slots = torch.arange(T, dtype=torch.int64, device=dev)
    results: dict[str, float] = {}

    def attn(single: bool, multi: bool, splits: int):
        return lambda: paged_attention(q, cache[0], cache[1], out, qsl, seq_lens, table,
                                       0.1, run_single_query=single, run_multi_query=multi,
                                       num_splits=splits)

    def plan_launch(splits: int, repeat: bool):
        """A later layer's share of a step: the plan is built once, by the first layer."""
        with use_kernel_options(KernelOptions(repeat_launches=repeat)):
            plan = PagedAttentionPlan.build(q, cache[0], cache[1], out, qsl, seq_lens, table,
                                            0.1, True, True, splits)
        return lambda: plan.launch(q, cache[0], cache[1], out)

    noop = RepeatLaunch(_noop_kernel, (1,), BLOCK=16)
    cases = {
        "write_kv_triton": lambda: write_kv_triton(k, v, cache[0], cache[1], slots),
        "attention single-query, 1 split": attn(True, False, 1),
        "attention single-query, 8 splits (+ reduce)": attn(True, False, 8),
        "attention multi-query only": attn(False, True, 1),
        "attention both mappings, 1 split": attn(True, True, 1),
        "attention both mappings, 8 splits": attn(True, True, 8),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "out.copy_(q)": lambda: out.copy_(q),
        "3 x new_empty (split partials)": lambda: [q.new_empty((R, H, 8, D), dtype=torch.float32)
                                                   for _ in range(3)],
        "bare triton launch (2 args)": lambda: _noop_kernel[(1,)](out, 16, BLOCK=16),
        "bare triton launch, kept kernel (RepeatLaunch)": lambda: noop(out, 16),
        "plan.launch both mappings, 1 split, JIT": plan_launch(1, False),
        "plan.launch both mappings, 1 split, kept": plan_launch(1, True),
        "plan.launch both mappings, 8 splits, JIT": plan_launch(8, False),
        "plan.launch both mappings, 8 splits, kept": plan_launch(8, True),
    }
    for name, fn in cases.items():
        results[name] = host_us_per_call(fn, args.iters)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.mul_(1.0)
    results["CUDAGraph.replay (1 kernel)"] = host_us_per_call(graph.replay, args.iters)
    for name, us in results.items():
        print(f"{name:<48} {us:8.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "host_us_per_call": results}, f, indent=1)


if __name__ == "__main__":
    main()
