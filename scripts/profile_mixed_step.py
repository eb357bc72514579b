"""Where a mixed step's time goes: `live` requests decode while, every measured step, one
new short prompt is prefilled beside them (it asks for one token, so the live count
stays put). That is the shape of an ngram verify whose rows carry different draft
counts, or of churn: a mixed batch, which both runners serve with PIECEWISE graphs.
The same engine's uniform decode steps (FULL graphs) are measured next to it.

    python scripts/profile_mixed_step.py [--model qwen3-0.6b] [--runners v1,v2]
        [--live 8] [--new-prompt-len 3] [--steps 40] [--cprofile 30]
        [--device cuda] [--dtype bfloat16] [--kernel-options JSON] [--out FILE]

Per runner and graph mode: step wall time, stage host times, forward and step GPU
time (CUDA events; a step whose GPU time is close to its wall time is host-bound),
and with --cprofile the functions that took the most host time in the mixed steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch


def build(args, runner: str):
    from policy import EngineArgs
    from shared.serving.engine import LLMEngine

    kw = dict(model=args.model, load_format="dummy", dtype=args.dtype, device=args.device,
              model_runner=runner, max_model_len=2048, max_num_seqs=max(64, 2 * args.live),
              enable_prefix_caching=False)
    if args.kernel_options:
        kw["kernel_options"] = json.loads(args.kernel_options)
    return LLMEngine.from_engine_args(EngineArgs(**kw))


def measure(engine, args, mixed: bool, profiler: cProfile.Profile | None):
    from shared.contract.sampling_params import SamplingParams
    from shared.harness.measure import StepSamples

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                         output_kind="final_only")
    samples: dict[str, StepSamples] = {}
    for i in range(args.steps):
        if mixed:
            engine.add_request(f"new-{i}", [7 + (i + j) % 50 for j in range(args.new_prompt_len)],
                               one)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        engine.step()
        if profiler is not None:
            profiler.disable()
        wall = (time.perf_counter() - t) * 1e3
        samples.setdefault(engine.step_stats.cudagraph_mode, StepSamples()).add(engine, wall)
    # the mixed steps' new requests finished after their prefill (one token each)
    return {mode: {"steps": len(s.wall_ms), **s.summary()} for mode, s in samples.items()}


def profile_runner(args, runner: str) -> dict:
    from shared.contract.sampling_params import SamplingParams

    engine = build(args, runner)
    long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True,
                          output_kind="final_only")
    for i in range(args.live):
        engine.add_request(f"live-{i}", [11 + (i * 7 + j) % 90 for j in range(16)], long)
    for _ in range(8):  # prefills done, every live request decoding; warm-up
        engine.step()
    measure(engine, args, mixed=True, profiler=None)  # warm-up of the mixed path
    out = {"decode": measure(engine, args, mixed=False, profiler=None)}
    profiler = cProfile.Profile() if args.cprofile else None
    out["mixed"] = measure(engine, args, mixed=True, profiler=profiler)
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        out["cprofile_mixed"] = text.getvalue()
    from shared.harness.ab_engines import free_engines

    engines = {runner: engine}
    del engine  # free_engines must hold the only reference (its KV cache fills the GPU)
    free_engines(engines)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--runners", default="v1,v2")
    ap.add_argument("--live", type=int, default=8)
    ap.add_argument("--new-prompt-len", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cprofile", type=int, default=0, help="top N functions by own time")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernel-options", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = {}
    for runner in args.runners.split(","):
        res = profile_runner(args, runner)
        results[runner] = res
        for kind in ("decode", "mixed"):
            for mode, m in sorted(res[kind].items()):
                print(f"{runner} {kind:<6} {mode:<10} steps {m['steps']:>3}  wall "
                      f"{m['wall_ms'].get('median', 0):.2f} ms  "
                      + "  ".join(f"{s} {v.get('median', 0):.2f}" for s, v in m["stages_ms"].items())
                      + (f"  fwd GPU {m['forward_gpu_ms']['median']:.2f}" if "forward_gpu_ms" in m else "")
                      + (f"  step GPU {m['step_gpu_ms']['median']:.2f}" if "step_gpu_ms" in m else ""))
        if "cprofile_mixed" in res:
            print(res["cprofile_mixed"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
