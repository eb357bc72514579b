"""bench serve's load generator: its arrival gaps are exponential (a KS test that also
rejects uniform and constant gaps), and against a scripted SSE server in a thread (known
delays, known token counts, known failures) it times and counts what the server sent."""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import statistics
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from shared.harness.bench_serve_client import (
    CHAT,
    LoadSettings,
    RequestSpec,
    arrival_offsets,
    run_load,
    served_model_name,
)

# ---- arrivals -------------------------------------------------------------------------

KS_CRITICAL_001 = 1.949  # / sqrt(n): the one-sample KS rejection level at alpha = 0.001


def ks_statistic(samples: list[float], cdf) -> float:
    xs = sorted(samples)
    n = len(xs)
    return max(max((i + 1) / n - cdf(x), cdf(x) - i / n) for i, x in enumerate(xs))


def exponential_cdf(rate: float):
    return lambda x: 1.0 - math.exp(-rate * x) if x > 0 else 0.0


def gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in zip(offsets, offsets[1:])]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_arrival_gaps_are_exponential_with_mean_one_over_rate(seed) -> None:
    n, rate = 3001, 8.0
    offsets = arrival_offsets(n, rate, seed)
    assert offsets[0] == 0.0 and len(offsets) == n
    sample = gaps(offsets)
    limit = KS_CRITICAL_001 / math.sqrt(len(sample))
    assert ks_statistic(sample, exponential_cdf(rate)) < limit
    # the same test has the power to see gaps of the right mean but the wrong shape
    uniform = [(i + 0.5) / len(sample) * 2 / rate for i in range(len(sample))]
    assert ks_statistic(uniform, exponential_cdf(rate)) > limit
    assert ks_statistic([1 / rate] * len(sample), exponential_cdf(rate)) > limit
    # and a wrong rate: gaps of mean 1/rate judged against rate * 1.2
    assert ks_statistic(sample, exponential_cdf(rate * 1.2)) > limit
    assert statistics.fmean(sample) == pytest.approx(1 / rate, rel=5 / math.sqrt(len(sample)))


def test_one_seed_gives_one_schedule_shape_and_inf_sends_all_at_once() -> None:
    slow, fast = arrival_offsets(50, 2.0, 3), arrival_offsets(50, 4.0, 3)
    assert fast == pytest.approx([t / 2 for t in slow])
    assert arrival_offsets(50, 2.0, 4) != slow
    # not the workload's stream (random.Random(seed)): gaps must not follow prompt lengths
    workload = random.Random(3)
    assert gaps(slow)[:5] != pytest.approx([workload.expovariate(1.0) / 2.0 for _ in range(5)])
    assert arrival_offsets(5, math.inf, 0) == [0.0] * 5
    with pytest.raises(ValueError, match="request rate 0"):
        arrival_offsets(3, 0.0, 0)


# ---- the scripted server ------------------------------------------------------------

TTFT_S, ITL_S = 0.06, 0.03
MODEL = "scripted"
# a prompt that starts with MARKER picks a script by its second token: 0 normal; 1 HTTP 400;
# 2 the stream stops before [DONE]; 3 slow (for --timeout-s); 4 two token ids per chunk;
# 5 usage disagrees; 6 text without token ids. Any other prompt is normal.
NORMAL, BAD_REQUEST, CUT, SLOW, PAIRS, WRONG_USAGE, NO_IDS = range(7)
MARKER = 99999


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def chunk(ids: list[int], finish: str | None = None, chat: bool = False,
          with_ids: bool = True) -> bytes:
    choice = {"index": 0, "logprobs": None, "finish_reason": finish}
    if with_ids:
        choice["token_ids"] = ids
    choice.update({"delta": {"content": "x" * len(ids)}} if chat else {"text": "x" * len(ids)})
    return sse({"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 0, "model": MODEL, "choices": [choice]})


def build_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def stream(body: dict, script: int, chat: bool):
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            n, step = body["max_tokens"], 2 if script == PAIRS else 1
            if chat:  # a role-only first chunk without token_ids, as vLLM's: no token time
                yield sse({"id": "c", "object": "chat.completion.chunk", "created": 0,
                           "model": MODEL, "choices": [{"index": 0, "delta": {
                               "role": "assistant", "content": ""}, "finish_reason": None}]})
            await asyncio.sleep(5.0 if script == SLOW else TTFT_S)
            for k in range(0, n, step):
                ids = list(range(k, min(k + step, n)))
                yield chunk(ids, "length" if k + step >= n else None, chat, script != NO_IDS)
                if script == CUT:
                    return
                if k + step < n:
                    await asyncio.sleep(ITL_S)
            reported = n + (1 if script == WRONG_USAGE else 0)
            yield sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": reported,
                                                "total_tokens": 7 + reported}})
            yield b"data: [DONE]\n\n"
        finally:
            state["in_flight"] -= 1

    async def route(request: Request, chat: bool):
        body = await request.json()
        state["bodies"].append(body)
        prompt = body.get("prompt") or []
        script = prompt[1] if not chat and prompt[:1] == [MARKER] else NORMAL
        if script == BAD_REQUEST:
            return JSONResponse({"error": {"message": "prompt too long", "type": "BadRequest",
                                           "param": "prompt", "code": 400}}, status_code=400)
        return StreamingResponse(stream(body, script, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await route(request, chat=True)

    return app


@pytest.fixture(scope="module")
def scripted():
    state = {"in_flight": 0, "max_in_flight": 0, "bodies": []}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning",
                                          timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the scripted server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def settings(url: str, **kw) -> LoadSettings:
    return LoadSettings(base_url=url, model_name=served_model_name(url), **kw)


def spec(i: int, script: int, max_tokens: int) -> RequestSpec:
    return RequestSpec(index=i, prompt=(MARKER, script, 6), max_tokens=max_tokens)


def test_timings_and_counts_match_the_script(scripted) -> None:
    url, state = scripted
    specs = [spec(i, NORMAL, 5) for i in range(6)] + [spec(6, PAIRS, 5)]
    records = run_load(specs, [0.0] * 7, settings(url))
    assert [r.index for r in records] == list(range(7)) and all(r.ok for r in records)
    for r in records:
        assert r.output_tokens == 5 and r.prompt_tokens == 7 and r.finish_reason == "length"
        assert r.send_s <= r.chunk_s[0] <= r.end_s
    normal = records[:6]
    assert all(len(r.chunk_s) == 5 for r in normal)
    assert len(records[6].chunk_s) == 3  # ids (0, 1), (2, 3), (4,): three token-bearing chunks
    ttft = statistics.median(r.chunk_s[0] - r.send_s for r in normal)
    itl = statistics.median(b - a for r in normal for a, b in zip(r.chunk_s, r.chunk_s[1:]))
    # the server's sleeps are floors; a loaded CI machine adds, never removes, time
    assert TTFT_S - 0.002 <= ttft < TTFT_S + 0.05
    assert ITL_S - 0.002 <= itl < ITL_S + 0.05
    body = state["bodies"][-1]
    assert body["model"] == MODEL and body["stream"] and body["return_token_ids"]
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    assert body["temperature"] == 0.6 and {b["seed"] for b in state["bodies"][-7:]} == set(range(7))


def test_failures_are_recorded_and_the_run_goes_on(scripted) -> None:
    url, _ = scripted
    specs = [spec(0, BAD_REQUEST, 3), spec(1, CUT, 3), spec(2, SLOW, 3),
             spec(3, WRONG_USAGE, 3), spec(4, NORMAL, 3), spec(5, NO_IDS, 3)]
    records = run_load(specs, [0.0] * 6, settings(url, timeout_s=1.0))
    errors = [r.error for r in records]
    assert errors[0] == "HTTP 400: prompt too long"
    assert errors[1] == "the stream ended before data: [DONE]"
    assert errors[2] == "timed out after 1 s (--timeout-s)" and records[2].end_s < 3.0
    assert "usage.completion_tokens is 4" in errors[3]
    assert errors[4] is None and records[4].output_tokens == 3
    assert errors[5] == "a chunk with text but no token_ids: the server ignores return_token_ids"


def test_a_refused_connection_is_a_failed_request(scripted) -> None:
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = LoadSettings(base_url=f"http://127.0.0.1:{port}", model_name=MODEL)
    (record,) = run_load([spec(0, NORMAL, 2)], [0.0], dead)
    assert record.error.startswith("ConnectError") and record.output_tokens == 0


def test_arrivals_are_kept_and_the_concurrency_cap_holds(scripted) -> None:
    url, state = scripted
    offsets = arrival_offsets(8, 25.0, 0)
    records = run_load([spec(i, NORMAL, 2) for i in range(8)], offsets, settings(url))
    for r, t in zip(records, offsets):
        assert r.arrival_s == t and t <= r.send_s < t + 0.05
    state["max_in_flight"] = 0
    capped = run_load([spec(i, NORMAL, 3) for i in range(6)], [0.0] * 6,
                      settings(url, max_concurrency=2))
    assert all(r.ok for r in capped) and state["max_in_flight"] == 2
    # capped requests wait for a slot before they are sent, so their latency excludes it
    assert sorted(r.send_s for r in capped)[-1] > 2 * TTFT_S
    state["max_in_flight"] = 0
    run_load([spec(i, NORMAL, 3) for i in range(6)], [0.0] * 6, settings(url))
    assert state["max_in_flight"] == 6


def test_chat_streams_count_token_ids_not_role_chunks(scripted) -> None:
    url, state = scripted
    chat = RequestSpec(index=0, prompt="Why is the sky blue?", max_tokens=4, ignore_eos=False)
    (record,) = run_load([chat], [0.0], settings(url, endpoint=CHAT))
    assert record.ok and record.output_tokens == 4 and len(record.chunk_s) == 4
    assert record.chunk_s[0] - record.send_s >= TTFT_S - 0.002  # the role chunk is not a token
    body = state["bodies"][-1]
    assert body["messages"] == [{"role": "user", "content": "Why is the sky blue?"}]
    assert "prompt" not in body and body["ignore_eos"] is False
