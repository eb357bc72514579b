"""Where a stage's host time goes, per runner: cProfile over one runner method only,
after warm-up (issue 21: V2's sample-stage host time against V1's at batch 1 and 256, and
V2's churn steps, longer than V1's on the host).

  python3 scripts/profile_sample_host.py --model qwen3-0.6b --batch 256 [--runners v1,v2]
      [--steps 30] [--async-scheduling] [--device cuda] [--out FILE.json]
      [--workload decode|churn] [--live 64] [--stage sample|execute] [--temperature T]

decode: `batch` requests of 32-token prompts decoding together (seeded, --temperature,
default 0.6; runnerlab ab's decode and churn workloads are greedy, --temperature 0); churn:
about `live` requests arriving and finishing every few steps (runnerlab ab's churn,
shared/harness/workloads.py ChurnArrivals). --stage sample profiles `sample_tokens`
(the StageTimer's "sample" stage), execute profiles `execute_model` (its "preprocess"
stage and the forward's launches). Prints, per runner, the stage's median host time and
the top functions by own time inside the profiled method; --out writes both as JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys

import torch

from shared.contract.sampling_params import SamplingParams
from shared.harness.workloads import ChurnArrivals
from shared.serving.engine import LLMEngine


def _engine(args: argparse.Namespace, runner: str) -> LLMEngine:
    from policy import EngineArgs

    cuda = args.device == "cuda"
    rows = args.batch if args.workload == "decode" else 2 * args.live
    return LLMEngine.from_engine_args(EngineArgs(
        model=args.model, load_format="dummy", dtype="bfloat16" if cuda else "float32",
        device=args.device, seed=0, model_runner=runner, max_num_seqs=max(8, rows),
        max_model_len=512, enable_prefix_caching=False, async_scheduling=args.async_scheduling,
        num_gpu_blocks_override=max(rows * 8, 32) + 16, max_num_batched_tokens=8192,
    ))


def _step_function(engine: LLMEngine, args: argparse.Namespace):
    if args.workload == "churn":
        arrivals = ChurnArrivals(engine, args.live, "r")

        def churn_step() -> None:
            arrivals.top_up()
            engine.step()
        return churn_step
    prompts = [[(i * 7 + j) % 1000 + 1 for j in range(32)] for i in range(args.batch)]
    params = SamplingParams(max_tokens=10_000, temperature=args.temperature, seed=0,
                            ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    return engine.step


def profile_runner(args: argparse.Namespace, runner: str) -> dict:
    engine = _engine(args, runner)
    step = _step_function(engine, args)
    for _ in range(6 if args.workload == "decode" else 30):  # the prefill, then warm steps
        step()
    profiler = cProfile.Profile()
    method = "sample_tokens" if args.stage == "sample" else "execute_model"
    inner = getattr(engine.runner, method)

    def profiled(*a, **k):
        profiler.enable()
        try:
            return inner(*a, **k)
        finally:
            profiler.disable()

    setattr(engine.runner, method, profiled)
    timer_stage = "sample" if args.stage == "sample" else "preprocess"
    host_ms = []
    for _ in range(args.steps):
        step()
        host_ms.append(engine.runner.step_stats.stage_ms.get(timer_stage, float("nan")))
    if args.device == "cuda":
        torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    calls = sum(v[0] for v in stats.stats.values())
    return {f"{timer_stage}_host_ms_median": statistics.median(host_ms),
            "calls_per_step": calls / args.steps, "top": text.getvalue()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--runners", default="v1,v2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--workload", choices=["decode", "churn"], default="decode")
    p.add_argument("--live", type=int, default=64, help="churn: requests kept running")
    p.add_argument("--stage", choices=["sample", "execute"], default="sample")
    p.add_argument("--temperature", type=float, default=0.6, help="decode workload only")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = {}
    for runner in args.runners.split(","):
        results[runner] = profile_runner(args, runner)
        r = results[runner]
        key = next(k for k in r if k.endswith("_host_ms_median"))
        print(f"== {runner} {args.workload}: {key.split('_')[0]} host median {r[key]:.3f} ms, "
              f"{r['calls_per_step']:.0f} Python calls per step\n{r['top']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
