"""/metrics: the server's Prometheus metrics, in a registry of its own (no process-wide
default registry, so two servers in one process, as in the tests, never mix counts).

Latencies are observed by the engine thread when a step's outputs are handed to the
streams (shared/serving/api/async_engine.py): TTFT from the request's arrival at the
engine loop to the step that produced its first token, ITL per token between steps.
prometheus_client's metric objects are thread-safe.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

from shared.runtime.step_timing import STAGES

# Seconds; fine below 100 ms where decode steps and ITLs live, coarse above.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                  0.25, 0.5, 1.0, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        decision = engine.decision
        Info("runnerlab_runner", "The runner the policy picked and why", registry=r).info({
            "runner": decision.runner, "source": decision.source,
            "reason": "; ".join(decision.reasons)})
        self.running = Gauge("runnerlab_num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("runnerlab_num_requests_waiting", "Requests waiting (preempted "
                             "ones too)", registry=r)
        self.kv_used = Gauge("runnerlab_kv_cache_blocks_used", "KV-cache blocks in use",
                             registry=r)
        self.kv_total = Gauge("runnerlab_kv_cache_blocks_total", "KV-cache blocks", registry=r)
        self.step = Histogram("runnerlab_step_seconds", "Wall time of one engine step",
                              buckets=_STAGE_BUCKETS, registry=r)
        self.stage = Histogram("runnerlab_step_stage_seconds", "CPU wall time of a runner "
                               "stage in one step", ["stage"], buckets=_STAGE_BUCKETS,
                               registry=r)
        self.ttft = Histogram("runnerlab_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("runnerlab_inter_token_latency_seconds", "Time between a "
                             "request's consecutive tokens", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("runnerlab_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("runnerlab_requests_finished", "Finished requests",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("runnerlab_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("runnerlab_generation_tokens", "Generated tokens of "
                                         "finished requests", registry=r)
        self.kv_total.set(engine.num_total_kv_blocks())

    # ---- observed by the engine thread -------------------------------------------------
    def observe_step(self, seconds: float, step_stats: Any) -> None:
        self.step.observe(seconds)
        for stage in STAGES:
            ms = step_stats.stage_ms.get(stage)
            if ms is not None:
                self.stage.labels(stage).observe(ms / 1e3)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float, num_tokens: int) -> None:
        """A step that brought num_tokens (> 1 with speculative decoding) spreads its gap
        over them, as a client reading the stream sees on average."""
        for _ in range(num_tokens):
            self.itl.observe(seconds / num_tokens)

    def observe_finished(self, prompt_tokens: int, generated_tokens: int,
                         finish_reasons: list[str], seconds: float) -> None:
        """A finished request: its prompt, every token its samples generated and each
        sample's finish reason (counted over its whole life, not read from its last
        output, which for a stream is only the last step's piece)."""
        self.e2e.observe(seconds)
        for reason in finish_reasons or ["unknown"]:
            self.finished.labels(reason).inc()
        self.generation_tokens.inc(generated_tokens)
        self.prompt_tokens.inc(prompt_tokens)

    # ---- read by /metrics ----------------------------------------------------------------
    def render(self, snapshot: Any) -> bytes:
        self.running.set(snapshot.num_running)
        self.waiting.set(snapshot.num_waiting)
        self.kv_used.set(snapshot.kv_blocks_used)
        self.kv_total.set(snapshot.kv_blocks_total)
        return generate_latest(self.registry)
