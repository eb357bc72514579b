"""The OpenAI-compatible server over a null engine: the serving layer's own ceiling.

The server (FastAPI app, AsyncEngine thread, SSE streams, metrics) runs as `runnerlab
serve` does, over an engine whose step costs nothing but an optional sleep (--step-ms, a
GPU step during which the host waits and the GIL is free) and produces one token per
running request per step (--host-ms before it: host work that holds the GIL, as a
runner's stages do, and contends with the event loop). `runnerlab bench serve
--base-url` against it measures how many output tokens a second the serving layer itself
can deliver, with no model in the way; --cprofile writes a profile of the event loop's thread (the uvicorn main thread) at exit.

    python scripts/serve_null_engine.py --port 8765 [--step-ms 0] [--host-ms 0]
        [--max-num-seqs 256] [--http auto] [--loop auto] [--cprofile FILE]
    runnerlab bench serve --base-url http://127.0.0.1:8765 --model tiny-llama \\
        --num-prompts 256 --request-rate inf
"""

from __future__ import annotations

import argparse
import cProfile
import time
from dataclasses import dataclass, field

from shared.contract.outputs import CompletionOutput, RequestOutput
from shared.contract.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    num_tokens: int = 0
    aborted: bool = False


@dataclass
class _Scheduler:  # what AsyncEngine's snapshot reads
    running: list = field(default_factory=list)
    waiting: list = field(default_factory=list)


@dataclass
class _StepStats:
    stage_ms: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Decision:  # the runner line of /metrics
    runner: str = "null"
    source: str = "scripts/serve_null_engine.py"
    reasons: tuple = ("no model: the serving layer's own cost",)


class NullEngine:
    """LLMEngine's interface as the server uses it; a token costs a dict entry."""

    tokenizer = None  # prompts arrive as token ids (the bench's nano-vllm workload)
    runner_name = "null"

    def __init__(self, max_model_len: int, max_num_seqs: int, step_ms: float,
                 host_ms: float = 0.0):
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_s = step_ms / 1e3
        self.host_s = host_ms / 1e3
        self.requests: dict[str, _Request] = {}
        self.scheduler = _Scheduler()
        self.step_stats = _StepStats()
        self.decision = _Decision()

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        self.requests[request_id] = _Request(list(prompt_token_ids), params)

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if rid in self.requests:
                self.requests[rid].aborted = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        if self.host_s:  # Python work that holds the GIL, as a runner's host stages do
            end = time.perf_counter() + self.host_s
            while time.perf_counter() < end:
                pass
        if self.step_s:
            time.sleep(self.step_s)
        outputs = []
        for rid in list(self.requests)[:self.max_num_seqs]:
            req = self.requests[rid]
            delta = req.params.output_kind is RequestOutputKind.DELTA
            if req.aborted:  # as the engine reports an abort: nothing new
                reason, new = "abort", 0
            else:
                req.num_tokens += 1
                reason = "length" if req.num_tokens >= req.params.max_tokens else None
                new = 1
            ids = [42] * (new if delta else req.num_tokens)
            text = " x" * (new if delta else req.num_tokens)
            outputs.append(RequestOutput(rid, req.prompt, [CompletionOutput(
                0, ids, text, finish_reason=reason)], finished=reason is not None))
            if reason is not None:
                del self.requests[rid]
        live = list(self.requests)
        self.scheduler.running = live[:self.max_num_seqs]
        self.scheduler.waiting = live[self.max_num_seqs:]
        return outputs

    def num_total_kv_blocks(self) -> int:
        return 1

    def num_free_kv_blocks(self) -> int:
        return 1

    def shutdown(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--step-ms", type=float, default=0.0, help="a step's GPU wait (sleep)")
    ap.add_argument("--host-ms", type=float, default=0.0,
                    help="a step's host work before it (a busy loop holding the GIL)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--model-name", default="tiny-llama")
    ap.add_argument("--cprofile", default=None, metavar="FILE")
    ap.add_argument("--http", default="auto", help="uvicorn's HTTP implementation")
    ap.add_argument("--loop", default="auto", help="uvicorn's event loop")
    args = ap.parse_args()
    import uvicorn

    from shared.serving.api.app import build_app

    engine = NullEngine(args.max_model_len, args.max_num_seqs, args.step_ms, args.host_ms)
    app = build_app(engine, args.model_name)  # type: ignore[arg-type]
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning",
                            http=args.http, loop=args.loop)
    profiler = cProfile.Profile() if args.cprofile else None
    if profiler is not None:
        profiler.enable()
    try:
        uvicorn.Server(config).run()
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.cprofile)


if __name__ == "__main__":
    main()
