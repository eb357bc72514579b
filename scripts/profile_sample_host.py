"""Where the sample stage's host time goes, per runner: cProfile over `sample_tokens`
only, after warm-up, at one batch size (issue 21: V2's sample-stage host time against
V1's at batch 1 and 256).

  python3 scripts/profile_sample_host.py --model qwen3-0.6b --batch 256 [--runners v1,v2]
      [--steps 30] [--async-scheduling] [--device cuda] [--out FILE.json]

Prints, per runner, the median "sample" stage host time of the StageTimer and the top
functions by own time inside sample_tokens; --out writes both as JSON.
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
from shared.serving.engine import LLMEngine


def profile_runner(args: argparse.Namespace, runner: str) -> dict:
    from policy import EngineArgs

    prompts = [[(i * 7 + j) % 1000 + 1 for j in range(32)] for i in range(args.batch)]
    cuda = args.device == "cuda"
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, load_format="dummy", dtype="bfloat16" if cuda else "float32",
        device=args.device, seed=0, model_runner=runner, max_num_seqs=max(8, args.batch),
        max_model_len=512, enable_prefix_caching=False, async_scheduling=args.async_scheduling,
        num_gpu_blocks_override=max(args.batch * 8, 32) + 16, max_num_batched_tokens=8192,
    ))
    params = SamplingParams(max_tokens=10_000, temperature=0.6, seed=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    for _ in range(6):  # the prefill, then warm decode steps
        engine.step()
    profiler = cProfile.Profile()
    inner = engine.runner.sample_tokens

    def sample_tokens(*a, **k):
        profiler.enable()
        try:
            return inner(*a, **k)
        finally:
            profiler.disable()

    engine.runner.sample_tokens = sample_tokens
    host_ms = []
    for _ in range(args.steps):
        engine.step()
        host_ms.append(engine.runner.step_stats.stage_ms.get("sample", float("nan")))
    if cuda:
        torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    calls = sum(v[0] for v in stats.stats.values())
    return {"sample_host_ms_median": statistics.median(host_ms),
            "calls_per_step": calls / args.steps, "top": text.getvalue()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--runners", default="v1,v2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = {}
    for runner in args.runners.split(","):
        results[runner] = profile_runner(args, runner)
        r = results[runner]
        print(f"== {runner}: sample host median {r['sample_host_ms_median']:.3f} ms, "
              f"{r['calls_per_step']:.0f} Python calls per step\n{r['top']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
