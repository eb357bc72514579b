"""Where a speculative step's time goes, per runner: the verify forward's GPU time, the
draft model's forwards (how many ran as FULL graphs, piecewise graphs, eagerly), the
draft's host and GPU time, and the step's wall time, against the same engine without
speculation (GPU machine; CPU runs for smoke).

    python scripts/profile_spec.py --model llama-3-8b --draft llama-3.2-1b --k 3 \
        --rates 0.9,0.8,0.7 [--runners v1,v2] [--prompt-len 1024] [--steps 32] \
        [--kernel-options JSON] [--variants JSON] [--cprofile 40] [--kernel-profile 5]
        [--out FILE]

--kernel-options: every engine's KernelOptions (JSON, policy/kernel_options.py).
--variants: one speculative engine per runner and variant, each with the base options
updated by its own, against one plain engine per runner (default {"spec": {}}), e.g.
'{"piecewise": {"draft_full_graphs": false}, "full": {}, "full+gemv4": {"gemv_max_tokens": 4}}'.
Per engine: step_wall_ms_median, output_tok_s (tokens of the measured steps / their wall
time) and speedup (against the runner's plain engine), forward_gpu_ms_median (the
verify), step_gpu_ms_median (verify + LM head + rejection sampler; the draft runs after
it), draft_host_ms_median / draft_gpu_ms_median (the proposer's call: host time, and CUDA-
event time from its first to its last launch), draft_gpu_done_at_host_return (the share
of steps whose draft GPU work had finished when the host returned from the call: near 1
means the draft is host-bound),
and draft_forwards (the draft's mode counters over the measured steps).
--kernel-profile N: after the measured steps, N more under torch.profiler (CUDA), and the
GPU kernels of a step grouped by (name, grid) as scripts/profile_decode.py prints them:
the verify forward's kernels beside the plain decode step's, and the draft's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import tempfile
import time

import torch


def build(args, runner: str, spec: dict | None, options: dict):
    from policy import EngineArgs
    from shared.serving.engine import LLMEngine

    kw = dict(model=args.model, load_format=args.load_format, dtype=args.dtype,
              device=args.device, model_runner=runner, max_model_len=args.prompt_len + args.steps * 4 + 64,
              max_num_seqs=4, max_num_batched_tokens=2048, enable_prefix_caching=False,
              gpu_memory_utilization=0.3, cudagraph_capture_sizes=[1, 2, 4, 8, 16],
              kernel_options=options)
    if args.device == "cpu":
        kw.pop("gpu_memory_utilization")
        kw.pop("cudagraph_capture_sizes")
    if spec is not None:
        kw["speculative_config"] = spec
    return LLMEngine.from_engine_args(EngineArgs(**kw))


def draft_forward_of(engine):
    spec = engine.runner.speculator
    if spec is None:
        return None
    return spec.draft.draft_forward if hasattr(spec, "draft") else spec.proposer.draft_forward


class DraftTimer:
    """Wraps the proposer's call that enqueues the draft (V1's launch, V2's propose): host
    time per call and, on CUDA, events around it."""

    def __init__(self, engine, on_cuda: bool) -> None:
        spec = engine.runner.speculator
        self.target = spec.draft if hasattr(spec, "draft") else spec.proposer
        self.on_cuda = on_cuda
        self.host_ms: list[float] = []
        self.done_at_return: list[bool] = []
        self.events: list[tuple] = []
        self.method = "launch" if hasattr(self.target, "launch") else "propose"
        real = getattr(self.target, self.method)

        def timed(*a, **kw):
            start = end = None
            if on_cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            out = real(*a, **kw)
            if on_cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.done_at_return.append(end.query())
                self.events.append((start, end))
            self.host_ms.append((time.perf_counter() - t0) * 1e3)
            return out

        setattr(self.target, self.method, timed)

    def gpu_ms(self) -> list[float]:
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in self.events]

    def remove(self) -> None:
        delattr(self.target, self.method)  # the instance attribute: the class's method again


def profile_kernels(engine, steps: int) -> None:
    """`steps` engine steps under torch.profiler; prints their kernels per step by grid."""
    from profile_decode import print_kernels_by_grid  # scripts/ is sys.path[0]

    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        print_kernels_by_grid(trace, steps=steps)


def median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def run(engine, args, measure: bool = True) -> dict:
    from shared.contract.sampling_params import SamplingParams

    prompt = [(7 * i) % 1000 + 10 for i in range(args.prompt_len)]
    engine.add_request("r", prompt, SamplingParams(max_tokens=args.steps * 4 + 8, temperature=0.0,
                                                   ignore_eos=True, seed=0))
    engine.step()  # prefill
    fwd = draft_forward_of(engine)
    counts_before = dict(fwd.counts) if fwd is not None else {}
    on_cuda = args.device == "cuda"
    timer = DraftTimer(engine, on_cuda) if fwd is not None else None
    profiler = cProfile.Profile() if measure and args.cprofile else None
    walls, gpus, step_gpus, tokens, outs = [], [], [], 0, []
    tokens_before = 1  # the prefill's token
    for _ in range(args.steps):
        if on_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        outs = engine.step()
        if profiler is not None:
            profiler.disable()
        if on_cuda:
            torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        stats = engine.runner.step_stats
        for values, read in ((gpus, stats.forward_gpu_ms), (step_gpus, stats.step_gpu_ms)):
            g = read()
            if g is not None:
                values.append(g)
        if not engine.has_unfinished_requests():
            break
    tokens = len(outs[0].outputs[0].token_ids) if outs else 0
    stats = engine.runner.step_stats  # the last measured step's
    result = {"step_wall_ms_median": median(walls),
              "output_tok_s": (tokens - tokens_before) / (sum(walls) / 1e3) if walls else None,
              "forward_gpu_ms_median": median(gpus), "step_gpu_ms_median": median(step_gpus),
              "last_stage_ms": stats.stage_ms, "last_mode": stats.cudagraph_mode,
              "tokens_after": tokens,
              "spec": engine.spec_decode_stats.as_dict() if engine.num_speculative_tokens else None}
    if fwd is not None:
        result["draft_forwards"] = {
            **{m: fwd.counts[m] - counts_before[m] for m in fwd.counts},
            "captured": fwd.captured, "capture_sizes": fwd.capture_sizes,
            "full_sizes": {} if fwd.full is None else fwd.full.full_sizes}
        result["draft_host_ms_median"] = median(timer.host_ms)
        if on_cuda:
            result["draft_gpu_ms_median"] = median(timer.gpu_ms())
            done = timer.done_at_return
            result["draft_gpu_done_at_host_return"] = sum(done) / len(done) if done else None
        timer.remove()
    # after every figure above is read: the profiled steps are slowed by the profiler
    if measure and args.kernel_profile and on_cuda and engine.has_unfinished_requests():
        profile_kernels(engine, args.kernel_profile)
    engine.abort_request("r")
    while engine.has_unfinished_requests():
        engine.step()
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        result["cprofile_tottime"] = text.getvalue()
    return result


def main() -> None:
    from shared.harness.ab_engines import free_engines

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
    ap.add_argument("--kernel-options", type=json.loads, default={}, metavar="JSON",
                    help="every engine's KernelOptions")
    ap.add_argument("--variants", type=json.loads, default={"spec": {}}, metavar="JSON",
                    help="name -> KernelOptions changes of one speculative engine per runner")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="cProfile the measured steps; the N functions of most own time")
    ap.add_argument("--kernel-profile", type=int, default=0, metavar="N",
                    help="N more steps per engine under torch.profiler: kernels by grid")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")][: args.k]
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": rates}
    engines = [("plain", None, {})] + [(name, spec, changes) for name, changes in args.variants.items()]
    results = {}
    for runner in args.runners.split(","):
        for name, s, changes in engines:
            engine = build(args, runner, s, {**args.kernel_options, **changes})
            run(engine, args, measure=False)  # warm-up
            results[f"{runner}-{name}"] = res = run(engine, args)
            plain = results[f"{runner}-plain"]["output_tok_s"]
            res["speedup"] = res["output_tok_s"] / plain if plain and res["output_tok_s"] else None
            profile = res.pop("cprofile_tottime", None)
            print(runner, name, json.dumps(res, default=str))
            if profile:
                print(profile)
                res["cprofile_tottime"] = profile
            # shutdown, collect and empty the cache: an engine is a web of reference
            # cycles, so `del` alone left it beside the next one's KV cache
            done = {"done": engine}
            del engine  # no name of ours may keep it alive through the collection
            free_engines(done)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
