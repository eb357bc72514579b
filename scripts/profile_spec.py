"""Where a speculative step's time goes, per runner: the verify forward's GPU time, the
draft model's forwards (how many ran through piecewise graphs) and the step's wall time,
against the same engine without speculation (GPU machine; CPU runs for smoke).

    python scripts/profile_spec.py --model llama-3-8b --draft llama-3.2-1b --k 3 \
        --rates 0.9,0.8,0.7 [--runners v1,v2] [--prompt-len 1024] [--steps 32]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def build(args, runner: str, spec: dict | None):
    from policy import EngineArgs
    from shared.serving.engine import LLMEngine

    kw = dict(model=args.model, load_format=args.load_format, dtype=args.dtype,
              device=args.device, model_runner=runner, max_model_len=args.prompt_len + args.steps * 4 + 64,
              max_num_seqs=4, max_num_batched_tokens=2048, enable_prefix_caching=False,
              gpu_memory_utilization=0.3, cudagraph_capture_sizes=[1, 2, 4, 8, 16])
    if args.device == "cpu":
        kw.pop("gpu_memory_utilization")
        kw.pop("cudagraph_capture_sizes")
    if spec is not None:
        kw["speculative_config"] = spec
    return LLMEngine.from_engine_args(EngineArgs(**kw))


def count_draft_forwards(engine) -> dict:
    """Wrap the draft's DraftForward to count piecewise vs eager forwards."""
    runner = engine.runner
    spec = runner.speculator
    if spec is None:
        return {}
    fwd = spec.draft.draft_forward if hasattr(spec, "draft") else spec.proposer.draft_forward
    counts = {"piecewise": 0, "eager": 0, "captured": fwd.piecewise is not None,
              "capture_sizes": fwd.capture_sizes}
    original = fwd.executor.forward

    def forward(*a, **kw):
        counts["piecewise" if kw.get("cudagraph_mode") == "PIECEWISE" else "eager"] += 1
        return original(*a, **kw)

    fwd.executor.forward = forward
    return counts


def run(engine, args) -> dict:
    from shared.contract.sampling_params import SamplingParams

    prompt = [(7 * i) % 1000 + 10 for i in range(args.prompt_len)]
    engine.add_request("r", prompt, SamplingParams(max_tokens=args.steps * 4 + 8, temperature=0.0,
                                                   ignore_eos=True, seed=0))
    engine.step()  # prefill
    counts = count_draft_forwards(engine)
    walls, gpus, tokens = [], [], 0
    for _ in range(args.steps):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        g = engine.runner.step_stats.forward_gpu_ms()
        if g is not None:
            gpus.append(g)
        if not engine.has_unfinished_requests():
            break
    tokens = len(outs[0].outputs[0].token_ids) if outs else 0
    engine.abort_request("r")
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.runner.step_stats
    walls.sort()
    gpus.sort()
    return {"step_wall_ms_median": walls[len(walls) // 2],
            "forward_gpu_ms_median": gpus[len(gpus) // 2] if gpus else None,
            "last_stage_ms": stats.stage_ms, "last_mode": stats.cudagraph_mode,
            "draft_forwards": counts, "tokens_after": tokens,
            "spec": engine.spec_decode_stats.as_dict() if engine.num_speculative_tokens else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--draft", default="llama-3.2-1b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--runners", default="v1,v2")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--rates", default="0.9,0.8,0.7")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")][: args.k]
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": rates}
    results = {}
    for runner in args.runners.split(","):
        for name, s in (("plain", None), ("spec", spec)):
            engine = build(args, runner, s)
            run(engine, args)  # warm-up
            results[f"{runner}-{name}"] = res = run(engine, args)
            print(runner, name, json.dumps(res, default=str))
            del engine
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
