"""The A/B workloads: each runs one engine through one workload and returns samples.

decode      N requests with short prompts decoding together (a batch ladder)
prefill     batches of long prompts, chunked by the token budget
churn       requests arriving and finishing every few steps (V1 holes, V2 free list)
throughput  nano-vllm's offline workload: 256 requests, prompt and output lengths
            uniform in [100, 1024], random token ids in [0, 10000], temperature 0.6
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np

from shared.contract.sampling_params import RequestOutputKind, SamplingParams
from shared.harness.measure import StepSamples, run_decode, sync_engine
from shared.runtime.step_timing import STAGES
from shared.serving.engine import LLMEngine


@dataclass
class RunResult:
    samples: StepSamples | None
    tokens: dict[str, list[int]]
    extra: dict


def summarise(results: list[RunResult]) -> dict:
    """One engine's runs of one workload: the per-step samples merged (medians and p90
    over every step of every run), and median/min/max/n over the runs of each numeric
    `extra`."""
    merged = StepSamples()
    for r in results:
        if r.samples is not None:
            merged.wall_ms += r.samples.wall_ms
            merged.forward_gpu_ms.extend(r.samples.forward_gpu_ms)
            merged.step_gpu_ms.extend(r.samples.step_gpu_ms)
            merged.modes += r.samples.modes
            for s in STAGES:
                merged.stage_ms[s] += r.samples.stage_ms[s]
    out = merged.summary() if merged.wall_ms else {}
    extras = [r.extra for r in results]
    for key in extras[0]:
        values = [e[key] for e in extras if isinstance(e.get(key), (int, float))]
        if values:
            out[key] = {"median": float(np.median(values)), "min": float(np.min(values)),
                        "max": float(np.max(values)), "n": len(values)}
    return out


def decode(engine: LLMEngine, batch: int, prompt_len: int, warmup: int, steps: int, tag: str) -> RunResult:
    samples, steady_ms, tokens = run_decode(engine, batch, prompt_len, warmup, steps, tag=tag)
    return RunResult(samples, tokens, {"steady_ms": steady_ms})


def _drain(engine: LLMEngine, samples: StepSamples | None, tokens: dict[str, list[int]]) -> int:
    steps = 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        if samples is not None:
            samples.add(engine, (time.perf_counter() - t0) * 1e3)
        for out in outs:
            tokens[out.request_id] = out.outputs[0].token_ids
        steps += 1
    return steps


def prefill(engine: LLMEngine, num_prompts: int, prompt_len: int, tag: str) -> RunResult:
    """Long prompts, one output token each: every step is (chunked) prefill."""
    rng = np.random.default_rng(1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(num_prompts):
        prompt = rng.integers(1, min(engine.vocab_size, 10000), prompt_len).tolist()
        engine.add_request(f"{tag}{i}", prompt, params)
    samples, tokens = StepSamples(), {}
    t0 = time.perf_counter()
    _drain(engine, samples, tokens)
    elapsed = time.perf_counter() - t0
    return RunResult(samples, tokens, {"prefill_tokens_per_s": num_prompts * prompt_len / elapsed})


# churn's requests: prompt and output lengths drawn uniformly from these ranges
CHURN_PROMPT_LEN = (4, 24)
CHURN_MAX_TOKENS = (2, 12)
# the throughput workload's longest request: prompt and output up to 1024 tokens each
THROUGHPUT_MAX_LEN = 2048


class ChurnArrivals:
    """churn's arrivals: `top_up()` adds greedy requests (prompt and output lengths drawn
    from CHURN_PROMPT_LEN / CHURN_MAX_TOKENS, seeded) until about `live` are unfinished.
    The profiling scripts drive the same arrivals (scripts/profile_host_waits.py,
    scripts/profile_sample_host.py)."""

    def __init__(self, engine: LLMEngine, live: int, tag: str, seed: int = 2) -> None:
        self.engine, self.live, self.tag = engine, live, tag
        self.rng = random.Random(seed)
        self.added = 0

    def _add(self) -> None:
        rng, engine = self.rng, self.engine
        prompt = [rng.randint(1, min(engine.vocab_size, 10000) - 1)
                  for _ in range(rng.randint(*CHURN_PROMPT_LEN))]
        params = SamplingParams(max_tokens=rng.randint(*CHURN_MAX_TOKENS), temperature=0.0,
                                ignore_eos=True)
        engine.add_request(f"{self.tag}{self.added}", prompt, params)
        self.added += 1

    def top_up(self) -> None:
        while self.engine.get_num_unfinished_requests() < self.live:
            self._add()


def churn(engine: LLMEngine, live: int, steps: int, tag: str) -> RunResult:
    """Keep about `live` requests running; each lives 2-12 tokens, so every step some
    finish (holes in V1, freed rows in V2) and new ones arrive. `steps` steps with per-step
    samples, then `steps` more timed as a run (steady_ms, as the decode workload's): under
    async scheduling a step's wall sample is the time between two returns, while the run
    is what a user sees (StepSamples reads the GPU times after the run, so neither waits
    on the GPU step by step)."""
    samples, tokens = StepSamples(), {}
    arrivals = ChurnArrivals(engine, live, tag)
    top_up = arrivals.top_up

    top_up()
    for _ in range(steps):
        top_up()
        t0 = time.perf_counter()
        outs = engine.step()
        samples.add(engine, (time.perf_counter() - t0) * 1e3)
        for out in outs:
            tokens[out.request_id] = out.outputs[0].token_ids
    sync_engine(engine)
    t0 = time.perf_counter()
    for _ in range(steps):  # the arrivals between the steps are part of the run
        top_up()
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    sync_engine(engine)
    steady_ms = (time.perf_counter() - t0) * 1e3 / steps
    _drain(engine, None, tokens)
    return RunResult(samples, tokens, {"requests": arrivals.added, "steady_ms": steady_ms})


def nano_vllm_workload(num_requests: int = 256, min_len: int = 100, max_len: int = 1024):
    """nano-vllm's bench.py workload, drawn in its order: all prompts, then all output
    lengths. With the defaults the output-token total is 133,966 (prompt: 142,827)."""
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(min_len, max_len))]
        for _ in range(num_requests)
    ]
    max_tokens = [random.randint(min_len, max_len) for _ in range(num_requests)]
    return prompts, max_tokens


def throughput(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int], tag: str) -> RunResult:
    """Every request at once, prefill included; output tokens / wall time. Seeds are set
    per request so that both runners must produce the same tokens."""
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        # offline batch: outputs once, at the end
        params = SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True, seed=i,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(f"{tag}{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    steps = _drain(engine, None, tokens)
    elapsed = time.perf_counter() - t0
    total = sum(len(t) for t in tokens.values())
    return RunResult(None, tokens, {
        "seconds": elapsed, "output_tokens": total, "steps": steps,
        "output_tokens_per_s": total / elapsed,
    })
