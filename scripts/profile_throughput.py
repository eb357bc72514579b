"""Where the throughput workload's wall time goes, per runner.

Runs nano-vllm's offline workload (shared.harness.workloads.nano_vllm_workload) once
untimed-instrumented for tokens/s, then once with light per-phase timers (scheduler
schedule / update, runner execute / sample, output wait), split by step kind (pure
decode vs steps with prefill), and optionally once under cProfile.

  python3 scripts/profile_throughput.py --model qwen3-0.6b --runners v1,v2 [--cprofile] [--out F]

--runners v1a,v1a-bi,v2a,v2a-bi prices the batch-invariant mode side by side (issue 26).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import time
from collections import defaultdict

import torch

from shared.harness import workloads as wl
from shared.serving.engine import LLMEngine


def _build(model: str, runner: str, async_scheduling: bool,
           batch_invariant: bool = False) -> LLMEngine:
    from policy import EngineArgs

    extra = {"async_scheduling": True} if async_scheduling else {}
    if batch_invariant:
        extra["batch_invariant"] = True
    return LLMEngine.from_engine_args(EngineArgs(
        model=model, load_format="dummy", dtype="bfloat16", device="cuda", seed=0,
        model_runner=runner, max_num_seqs=256, max_num_batched_tokens=8192,
        enable_prefix_caching=False, gpu_memory_utilization=0.8, **extra,
    ))


class PhaseTimer:
    """Wraps bound methods with perf_counter accumulators, keyed by step kind."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.ms: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.steps: dict[str, int] = defaultdict(int)
        self.kind = "decode"
        for obj, name, label in (
            (engine.scheduler, "schedule", "schedule"),
            (engine.scheduler, "update_from_output", "update"),
            (engine.runner, "execute_model", "execute_model"),
            (engine.runner, "sample_tokens", "sample_tokens"),
        ):
            setattr(obj, name, self._wrap(getattr(obj, name), label))

    def _wrap(self, fn, label):
        def inner(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if label == "schedule":
                so = out
                self.kind = "decode" if so.total_num_scheduled_tokens == so.num_reqs else "mixed"
            self.ms[self.kind][label] += (time.perf_counter() - t0) * 1e3
            return out
        return inner

    def step(self) -> list:
        t0 = time.perf_counter()
        outs = self.engine.step()
        self.ms[self.kind]["step_total"] += (time.perf_counter() - t0) * 1e3
        self.steps[self.kind] += 1
        return outs


def _run(engine: LLMEngine, prompts, max_tokens, tag: str, step_fn=None) -> dict:
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        from shared.contract.sampling_params import SamplingParams

        engine.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=n, temperature=0.6,
                                                         ignore_eos=True, seed=i,
                                                         output_kind="final_only"))
    step = step_fn or engine.step
    total, steps = 0, 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in step():
            total += len(out.outputs[0].token_ids)
        steps += 1
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    return {"seconds": secs, "output_tokens": total, "steps": steps, "tok_per_s": total / secs}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--runners", default="v1,v2",
                   help="comma list; 'v2a' = v2 with async scheduling, a '-bi' suffix = "
                        "batch-invariant mode (e.g. v2a-bi)")
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    prompts, max_tokens = wl.nano_vllm_workload()
    report = {"gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "runners": {}}
    for name in args.runners.split(","):
        base, _, mode = name.partition("-")
        if mode not in ("", "bi"):
            p.error(f"--runners: unknown mode {mode!r} in {name!r} (accepted: '-bi')")
        engine = _build(args.model, base.rstrip("a"), base.endswith("a"), mode == "bi")
        # warm-up: enough prompt lengths and batch sizes that the timed run compiles no
        # Triton specialisation of its own
        _run(engine, prompts[:64], [32] * 64, "warm")
        plain = _run(engine, prompts, max_tokens, "plain")
        timer = PhaseTimer(engine)
        phased = _run(engine, prompts, max_tokens, "phase", timer.step)
        entry = {"plain": plain, "phased": phased, "steps_by_kind": dict(timer.steps),
                 "phase_ms_by_kind": {k: dict(v) for k, v in timer.ms.items()}}
        print(f"== {name}: {plain['tok_per_s']:.0f} tok/s ({plain['seconds']:.2f} s, "
              f"{plain['steps']} steps); instrumented {phased['tok_per_s']:.0f} tok/s")
        for kind, phases in timer.ms.items():
            n = timer.steps[kind]
            line = ", ".join(f"{k} {v / n:.3f}" for k, v in phases.items())
            print(f"   {kind}: {n} steps, ms/step: {line}")
        if args.cprofile:
            prof = cProfile.Profile()
            prof.enable()
            _run(engine, prompts, max_tokens, "prof")
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(50)
            print(s.getvalue())
            entry["cprofile_top"] = s.getvalue()
        report["runners"][name] = entry
        del engine, timer
        gc.collect()
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
