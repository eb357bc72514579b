"""What the built-in logits processors cost at a large decode batch, both runners side
by side in one run (GPU machine; CPU for smoke): a realistic mix of requests (a quarter
with logit_bias, a quarter with bad words, a few with allowed_token_ids, half sampled
with top-p) against the same requests without built-ins.

Per runner and case it reports, over the timed decode steps (medians):
- step GPU ms (forward + LM head + sampler, CUDA events), forward GPU ms, and their
  difference: the sample stage's GPU time;
- the sample stage's host (wall) ms and the whole step's wall ms.
The built-ins' cost is (mix - none) / mix of the step's GPU time and of its wall time.

    python scripts/bench_builtins.py --model llama-3-8b --batch 256 [--runners v1,v2]
"""

from __future__ import annotations

import argparse
import gc
import json
import random

import torch


def mix_params(batch: int, vocab: int, steps: int, builtins: bool, seed: int = 0):
    from shared.contract.sampling_params import SamplingParams

    rng = random.Random(seed)
    out = []
    for i in range(batch):
        kw = dict(max_tokens=steps, ignore_eos=True, seed=i)
        if i % 2:
            kw.update(temperature=0.8, top_p=0.95)
        else:
            kw.update(temperature=0.0)
        if builtins:
            if i % 4 == 0:
                kw["logit_bias"] = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(32)}
            elif i % 4 == 1:
                kw["bad_words_token_ids"] = [
                    [rng.randrange(vocab) for _ in range(rng.randint(1, 3))] for _ in range(16)]
            if i % 64 == 2:
                kw["allowed_token_ids"] = rng.sample(range(vocab), min(1000, vocab // 2))
        out.append(SamplingParams(**kw))
    return out


def run(engine, params, prompt_len: int, warmup: int, steps: int) -> dict:
    from shared.harness.measure import run_decode

    samples, _, _ = run_decode(engine, len(params), prompt_len, warmup, steps, params=params)
    s = samples.summary()
    med = lambda key: s.get(key, {}).get("median")  # noqa: E731
    step_gpu, fwd_gpu = med("step_gpu_ms"), med("forward_gpu_ms")
    return {
        "step_gpu_ms": step_gpu, "forward_gpu_ms": fwd_gpu,
        "sample_gpu_ms": None if step_gpu is None else step_gpu - fwd_gpu,
        "sample_host_ms": s["stages_ms"]["sample"]["median"],
        "wall_ms": s["wall_ms"]["median"], "modes": s["cudagraph_modes"],
    }


def print_table(report: dict) -> None:
    fmt = lambda v: "-" if v is None else f"{v:8.3f}"  # noqa: E731
    keys = ("step_gpu_ms", "sample_gpu_ms", "sample_host_ms", "wall_ms")
    print(f"{'runner':6} {'case':10} " + " ".join(f"{k:>15}" for k in keys))
    for runner, r in report["runners"].items():
        for case, c in r["cases"].items():
            print(f"{runner:6} {case:10} " + " ".join(f"{fmt(c[k]):>15}" for k in keys))
        print(f"{runner:6} cost       " + " ".join(
            f"{'-' if k not in r['builtins_cost_fraction'] else format(r['builtins_cost_fraction'][k], '.1%'):>15}"
            for k in keys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--runners", default="v1,v2")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args()

    from policy import EngineArgs
    from shared.harness.measure import decode_max_tokens
    from shared.serving.engine import LLMEngine

    report = {"args": vars(args), "device": torch.cuda.get_device_name()
              if args.device == "cuda" else "cpu", "runners": {}}
    for runner in args.runners.split(","):
        kw = dict(model=args.model, load_format=args.load_format, dtype=args.dtype,
                  device=args.device, model_runner=runner, max_num_seqs=args.batch,
                  max_model_len=args.prompt_len + 2 * (args.warmup + args.steps) + 16,
                  max_num_batched_tokens=max(8192, args.batch), enable_prefix_caching=False)
        if args.device == "cuda":
            kw["gpu_memory_utilization"] = 0.4  # one engine at a time, but freed lazily
        engine = LLMEngine.from_engine_args(EngineArgs(**kw))
        cases = {}
        for name, builtins in (("none", False), ("mix", True), ("none_again", False)):
            params = mix_params(args.batch, engine.vocab_size,
                                decode_max_tokens(args.warmup, args.steps), builtins)
            cases[name] = run(engine, params, args.prompt_len, args.warmup, args.steps)
        none, mix = cases["none"], cases["mix"]
        cost = {}
        for key in ("step_gpu_ms", "wall_ms"):
            if none[key] is not None:
                cost[key] = (mix[key] - none[key]) / mix[key]
        report["runners"][runner] = {"cases": cases, "builtins_cost_fraction": cost}
        print(runner, json.dumps(report["runners"][runner]), flush=True)
        del engine
        gc.collect()  # the runner's graphs and buffers hold reference cycles
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print_table(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
