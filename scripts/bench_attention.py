#!/usr/bin/env python
"""Attention micro-benchmarks for the GPU machine (an H200 here).

Measures, with CUDA events (warm-up excluded, median of many repetitions):
1. HBM read bandwidth: a sum over a multi-GB fp32 tensor;
2. TRITON decode attention over a bf16 paged KV cache, Llama-3-8B attention shape
   (32 query heads, 8 KV heads, head_dim 128, block 16, shuffled block ids) at batch
   256 x context 4096 and batch 1 x context 32768: time, KV bytes read / time, and the
   ratio to the measured read bandwidth. Timed inside a CUDA graph (as the runners run
   decode), and eagerly for reference;
3. TRITON prefill attention, 8 requests x 2048 tokens, causal, in TFLOP/s beside
   torch.nn.functional.scaled_dot_product_attention (is_causal, bf16) on the same shapes.
Every case is checked against the TORCH backend or SDPA before it is timed.

    python scripts/bench_attention.py --out attention.json   # H200: docs/results/raw/2a17d2d/h200_attention.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.attention.kv_write_triton import write_kv_triton  # noqa: E402
from shared.attention.metadata import CommonAttentionMetadata  # noqa: E402
from shared.attention.torch_backend import TorchBackend  # noqa: E402
from shared.attention.triton_backend import TritonBackend  # noqa: E402
from shared.harness.measure import cuda_time_ms, graph_time_ms  # noqa: E402
from shared.runtime.kernel_options import KernelOptions, use_kernel_options  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = torch.device("cuda")
DECODE_TARGET = 0.70  # fraction of read bandwidth the batch-256 decode should reach


def hbm_read_bandwidth(gib: float, reps: int) -> dict:
    x = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device=DEVICE).uniform_()
    ms = cuda_time_ms(lambda: x.sum(), reps)
    return {"case": f"hbm_read_sum_{gib:g}GiB", "time_ms": ms, "GBps": x.numel() * 4 / ms / 1e6}


def paged_batch(query_lens: list[int], seq_lens: list[int], num_heads: int = NUM_HEADS,
                table_keys: int = 0):
    """Uniformly laid-out metadata over a freshly allocated, shuffled paged cache; the
    block table at least `table_keys` keys wide (an engine's is max_model_len's)."""
    num_reqs = len(seq_lens)
    blocks = [(s + BLOCK_SIZE - 1) // BLOCK_SIZE for s in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int64).to(torch.int32)
    width = max(max(blocks), -(-table_keys // BLOCK_SIZE))
    table = torch.zeros(num_reqs, width, dtype=torch.int32, device=DEVICE)
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = perm[start: start + n]
        start += n
    qlens = torch.tensor(query_lens, dtype=torch.int32)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlens, 0)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv = torch.randn((2, *shape), device=DEVICE, dtype=DTYPE)
    num_tokens = int(qsl[-1])
    query = torch.randn(num_tokens, num_heads, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    num_decodes = sum(1 for q in query_lens if q == 1)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(DEVICE), seq_lens=torch.tensor(seq_lens, dtype=torch.int32,
                                                              device=DEVICE),
        block_table=table, slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64,
                                                   device=DEVICE),
        num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), num_decodes=num_decodes,
        num_prefills=num_reqs - num_decodes, num_decode_tokens=num_decodes,
        block_size=BLOCK_SIZE, query_start_loc_cpu=qsl,
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
    )
    return common, query, kv[0], kv[1]


def run_attention(backend, common, query, key_cache, value_cache):
    impl = backend.make_impl(query.shape[1], HEAD_DIM, NUM_KV_HEADS, HEAD_DIM**-0.5)
    metadata = backend.make_builder(DEVICE).build(common)
    output = torch.empty_like(query)
    return impl, (query, key_cache, value_cache, metadata, output)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def bench_decode(batch: int, ctx: int, read_gbps: float, reps: int) -> dict:
    common, query, key_cache, value_cache = paged_batch([1] * batch, [ctx] * batch)
    impl, args = run_attention(TritonBackend(), common, query, key_cache, value_cache)
    impl.forward(*args)
    ref_impl, ref_args = run_attention(TorchBackend(), common, query, key_cache, value_cache)
    ref_impl.forward(*ref_args)
    err = max_err(args[-1], ref_args[-1])
    assert err < 3e-2, f"decode b{batch} x {ctx}: TRITON differs from TORCH by {err}"
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * key_cache.element_size()
    graph_ms = graph_time_ms(lambda: impl.forward(*args), reps)
    eager_ms = cuda_time_ms(lambda: impl.forward(*args), reps)
    gbps = kv_bytes / graph_ms / 1e6
    return {
        "case": f"decode_b{batch}_ctx{ctx}", "batch": batch, "context": ctx,
        "num_splits": impl.splits_for(batch, DEVICE), "kv_bytes": kv_bytes,
        "time_ms": graph_ms, "eager_time_ms": eager_ms, "GBps": gbps,
        "ratio_to_read_bw": gbps / read_gbps, "max_abs_err_vs_torch": err,
    }


def bench_ragged_splits(batch: int, read_gbps: float, reps: int) -> list[dict]:
    """Decode over ragged contexts, uniform in [100, 2048] (the throughput workload's
    range), with qwen3-0.6b's heads (16 / 8), at forced split counts and fixed split
    sizes: what the split heuristic leaves on the table when one long context sets the
    tail; and batch-invariant mode's attention."""
    gen = torch.Generator().manual_seed(batch)
    seq_lens = torch.randint(100, 2049, (batch,), generator=gen).tolist()
    # the table as wide as the engine's default max_model_len: fixed-size splits get a
    # grid covering it
    common, query, key_cache, value_cache = paged_batch([1] * batch, seq_lens, num_heads=16,
                                                        table_keys=4096)
    ref_impl, ref_args = run_attention(TorchBackend(), common, query, key_cache, value_cache)
    ref_impl.forward(*ref_args)
    kv_bytes = 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * key_cache.element_size()
    max_keys = common.block_table.shape[1] * key_cache.shape[1]
    # (case suffix, forced split count, kernel options): split counts, then fixed-size
    # splits over a grid covering the table, then batch-invariant mode's fixed splits and
    # its former single split (a split as long as the table)
    variants = [(f"s{n or 'auto'}", n, {}) for n in (None, 1, 2, 4, 8, 16)]
    variants += [(f"tok{n}", None, {"attention_split_tokens": n}) for n in (256, 512, 1024)]
    variants += [(f"bi_tok{n}", None, {"batch_invariant": True, "invariant_split_tokens": n})
                 for n in (64, 128, 256, 512)]
    variants += [("bi_1split", None, {"batch_invariant": True,
                                      "invariant_split_tokens": max_keys})]
    rows = []
    for name, splits, options in variants:
        out, row = _timed_variant(common, query, key_cache, value_cache, splits, options,
                                  kv_bytes, read_gbps, reps)
        err = max_err(out, ref_args[-1])
        assert err < 3e-2, f"ragged b{batch} {name}: TRITON differs by {err}"
        rows.append({"case": f"ragged_b{batch}_{name}", "batch": batch, **row})
    return rows


def _timed_variant(common, query, key_cache, value_cache, splits, options: dict,
                   kv_bytes: int, read_gbps: float, reps: int):
    """One decode-attention variant (forced split count, kernel options) in a CUDA graph:
    (its output, its row's timing fields)."""
    batch = common.num_reqs
    max_keys = common.block_table.shape[1] * key_cache.shape[1]
    with use_kernel_options(KernelOptions(**options)):
        impl, args = run_attention(TritonBackend(num_splits=splits), common, query,
                                   key_cache, value_cache)
        impl.forward(*args)
        ms = graph_time_ms(lambda: impl.forward(*args), reps)
        num_splits = impl.splits_for(batch, DEVICE, max_keys=max_keys)
    return args[-1], {"num_splits": num_splits, "kv_bytes": kv_bytes, "time_ms": ms,
                      "GBps": kv_bytes / ms / 1e6,
                      "ratio_to_read_bw": kv_bytes / ms / 1e6 / read_gbps}


def bench_invariant_b1(ctx: int, read_gbps: float, reps: int) -> list[dict]:
    """Batch-invariant mode's decode attention where it costs most: one llama-3-8b row
    (32 / 8 heads, so 8 programs per split) at `ctx` keys over an engine-wide table,
    beside the mode off, at each invariant split size."""
    common, query, key_cache, value_cache = paged_batch([1], [ctx], table_keys=4096)
    kv_bytes = 2 * ctx * NUM_KV_HEADS * HEAD_DIM * key_cache.element_size()
    variants = [("off", {})]
    variants += [(f"bi_tok{n}", {"batch_invariant": True, "invariant_split_tokens": n})
                 for n in (64, 128, 256, 512)]
    rows = []
    for name, options in variants:
        _, row = _timed_variant(common, query, key_cache, value_cache, None, options,
                                kv_bytes, read_gbps, reps)
        rows.append({"case": f"llama_b1_ctx{ctx}_{name}", "batch": 1, "context": ctx, **row})
    return rows


def bench_prefill(batch: int, seq: int, reps: int) -> list[dict]:
    common, query, key_cache, value_cache = paged_batch([seq] * batch, [seq] * batch)
    key = torch.randn(batch * seq, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    value = torch.randn_like(key)
    pos = torch.arange(seq, device=DEVICE)
    slots = (common.block_table.long().gather(1, (pos // BLOCK_SIZE).expand(batch, -1))
             * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    write_kv_triton(key, value, key_cache, value_cache, slots)
    impl, args = run_attention(TritonBackend(), common, query, key_cache, value_cache)

    group = NUM_HEADS // NUM_KV_HEADS
    q = query.view(batch, seq, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    k = key.view(batch, seq, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = value.view(batch, seq, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    k, v = (t.repeat_interleave(group, dim=1).contiguous() for t in (k, v))
    q = q.contiguous()
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    impl.forward(*args)
    ref = sdpa().transpose(1, 2).reshape(batch * seq, NUM_HEADS, HEAD_DIM)
    err = max_err(args[-1], ref)
    assert err < 3e-2, f"prefill {batch} x {seq}: TRITON differs from SDPA by {err}"

    flops = 2 * batch * NUM_HEADS * seq * seq * HEAD_DIM  # causal: half of 4*B*H*S^2*D
    rows = []
    for name, fn in (("triton", lambda: impl.forward(*args)), ("sdpa", sdpa)):
        ms = cuda_time_ms(fn, reps)
        rows.append({"case": f"prefill_{name}_{batch}x{seq}", "time_ms": ms,
                     "TFLOPs": flops / ms / 1e9, "max_abs_err_triton_vs_sdpa": err})
    return rows


def print_table(results: list[dict]) -> None:
    print(f"{'case':<28}{'time_ms':>10}{'GB/s':>10}{'TFLOP/s':>10}{'ratio':>8}{'splits':>8}")
    for r in results:
        gb = f"{r['GBps']:.0f}" if "GBps" in r else ""
        tf = f"{r['TFLOPs']:.1f}" if "TFLOPs" in r else ""
        ratio = f"{r['ratio_to_read_bw']:.2f}" if "ratio_to_read_bw" in r else ""
        splits = str(r.get("num_splits", ""))
        print(f"{r['case']:<28}{r['time_ms']:>10.4f}{gb:>10}{tf:>10}{ratio:>8}{splits:>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--read-gib", type=float, default=4.0)
    parser.add_argument("--ragged-only", action="store_true",
                        help="only the ragged-context split sweep")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "bench_attention.py needs a CUDA GPU"
    torch.manual_seed(0)

    read = hbm_read_bandwidth(args.read_gib, args.reps)
    torch.cuda.empty_cache()
    results = [read]
    if args.ragged_only:
        for ctx in (1024, 4096):
            results += bench_invariant_b1(ctx, read["GBps"], args.reps)
        for batch in (8, 32, 64, 128, 256):
            results += bench_ragged_splits(batch, read["GBps"], args.reps)
        print_table(results)
    else:
        for batch, ctx in ((256, 4096), (1, 32768)):
            results.append(bench_decode(batch, ctx, read["GBps"], args.reps))
            torch.cuda.empty_cache()
        results += bench_prefill(8, 2048, args.reps)
        print_table(results)
        b256 = results[1]
        verdict = "meets" if b256["ratio_to_read_bw"] >= DECODE_TARGET else "MISSES"
        print(f"decode b256 x 4096 reaches {b256['ratio_to_read_bw']:.0%} of read bandwidth: "
              f"{verdict} the {DECODE_TARGET:.0%} target")

    report = {
        "command": shlex.join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "block_size": BLOCK_SIZE, "dtype": str(DTYPE)},
        "decode_target_ratio": DECODE_TARGET,
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
