"""The load generator of `runnerlab bench serve`: Poisson arrivals of streamed requests
against an OpenAI-compatible server, each timed chunk by chunk.

One asyncio task per request sleeps until its arrival time, waits for a slot under the
optional concurrency cap, sends, and records with time.perf_counter(): the send time, the
time of every SSE chunk that carries at least one new token id, and the end time. A
request that fails (an HTTP status, a broken stream, a timeout, any exception) becomes a
record with its error; it never stops the run.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
NANO_VLLM_MAX_TOKEN_ID = 10000
# the chat workload's user turns (cycled in a seeded order), for a model with a tokenizer
CHAT_PROMPTS = (
    "What is the capital of France?", "Explain photosynthesis in one paragraph.",
    "Write a haiku about autumn leaves.", "How do I boil an egg?",
    "Give me three tips for learning a new language.", "What is a prime number?",
    "Summarise the plot of Romeo and Juliet.", "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.", "What causes rain?",
    "List five fruits that are red.", "How does a bicycle stay upright?",
    "Write a short poem about the sea.", "What is the difference between weather and climate?",
    "Tell me a fun fact about octopuses.", "How many legs does a spider have?",
    "What is gravity?", "Suggest a name for a pet goldfish.",
    "Explain what a computer program is to a child.", "What do bees make?",
    "Why do we have seasons?", "Write a sentence using the word 'serendipity'.",
    "What is the tallest mountain in the world?", "How do plants drink water?",
)


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: token ids (completions) or a user message (chat)."""

    index: int
    prompt: tuple[int, ...] | str
    max_tokens: int
    ignore_eos: bool = True
    temperature: float = 0.6

    @property
    def prompt_len(self) -> int | None:
        """Prompt tokens when the client knows them (token ids); chat: the server's usage."""
        return None if isinstance(self.prompt, str) else len(self.prompt)


@dataclass(frozen=True)
class RequestRecord:
    """What one request did. Times are seconds since the run's start (perf_counter)."""

    index: int
    max_tokens: int
    prompt_tokens: int | None
    arrival_s: float  # the scheduled Poisson arrival
    send_s: float  # after any wait for a concurrency slot
    chunk_s: tuple[float, ...]  # arrival of every chunk with >= 1 new token id
    end_s: float
    output_tokens: int
    finish_reason: str | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict:
        return {"index": self.index, "max_tokens": self.max_tokens,
                "prompt_tokens": self.prompt_tokens, "arrival_s": self.arrival_s,
                "send_s": self.send_s, "chunk_s": list(self.chunk_s), "end_s": self.end_s,
                "output_tokens": self.output_tokens, "finish_reason": self.finish_reason,
                "error": self.error}


@dataclass(frozen=True)
class LoadSettings:
    """How requests are sent: the endpoint, the served model name and the limits."""

    base_url: str
    model_name: str
    endpoint: str = COMPLETIONS
    max_concurrency: int | None = None
    timeout_s: float = 300.0


def unit_exponential_gaps(n: int, seed: int) -> list[float]:
    """n inter-arrival gaps of a rate-1 Poisson process. Divided by a rate they are that
    rate's gaps, so every rate (and every runner at one rate) gets the same schedule shape
    from one seed. The stream is not the workload's random.Random(seed): drawn from that,
    the gaps would follow the prompt lengths (a long prompt, then a long pause)."""
    rng = random.Random(f"bench-serve-arrivals-{seed}")  # str seeds hash stably (SHA-512)
    return [rng.expovariate(1.0) for _ in range(n)]


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival time of each of n requests, seconds after the start. The first arrives at 0,
    the next after an exponential gap of mean 1/rate; rate inf: all at 0."""
    if not rate > 0:
        raise ValueError(f"request rate {rate} is not valid; expected > 0 or inf")
    if math.isinf(rate):
        return [0.0] * n
    offsets = [0.0] if n else []
    for gap in unit_exponential_gaps(max(n - 1, 0), seed):
        offsets.append(offsets[-1] + gap / rate)
    return offsets


def nano_vllm_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int],
                       seed: int, vocab_size: int | None) -> list[RequestSpec]:
    """nano-vllm's draws, in its order (every prompt, then every output length) from
    random.Random(seed): with seed 0 and equal ranges they are those of
    workloads.nano_vllm_workload. Token ids beyond a small vocabulary are folded into it."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, NANO_VLLM_MAX_TOKEN_ID) for _ in range(rng.randint(*input_len))]
               for _ in range(num)]
    max_tokens = [rng.randint(*output_len) for _ in range(num)]
    if vocab_size is not None and vocab_size <= NANO_VLLM_MAX_TOKEN_ID:
        prompts = [[t % vocab_size for t in p] for p in prompts]
    return [RequestSpec(index=i, prompt=tuple(p), max_tokens=n)
            for i, (p, n) in enumerate(zip(prompts, max_tokens))]


def chat_requests(num: int, output_len: tuple[int, int], seed: int) -> list[RequestSpec]:
    """User turns of CHAT_PROMPTS in a seeded order; they stop at EOS (no ignore_eos)."""
    rng = random.Random(seed)
    texts = [rng.choice(CHAT_PROMPTS) for _ in range(num)]
    max_tokens = [rng.randint(*output_len) for _ in range(num)]
    return [RequestSpec(index=i, prompt=t, max_tokens=n, ignore_eos=False)
            for i, (t, n) in enumerate(zip(texts, max_tokens))]


def request_payload(spec: RequestSpec, settings: LoadSettings) -> dict:
    """The JSON body: streamed, usage in the last chunk, new token ids in every chunk."""
    body: dict = {"model": settings.model_name, "max_tokens": spec.max_tokens,
                  "temperature": spec.temperature, "seed": spec.index,
                  "ignore_eos": spec.ignore_eos, "stream": True,
                  "stream_options": {"include_usage": True}, "return_token_ids": True}
    if settings.endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt if isinstance(spec.prompt, str) else list(spec.prompt)
    return body


@dataclass
class StreamTally:
    """The mutable tally of one response while it streams (local to one task)."""

    chunk_s: list[float]
    tokens: int = 0
    finish_reason: str | None = None
    usage: dict | None = None
    done: bool = False


def _http_error(status: int, body: bytes) -> str:
    """`HTTP 400: message` from the OpenAI error body, or the raw body's start."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:300].decode("utf-8", "replace")
    return f"HTTP {status}: {' '.join(str(message).split())}"


def take_line(line: str, now_s: float, tally: StreamTally) -> str | None:
    """Fold one SSE line, received at now_s, into the tally; -> an error text for a line
    that reports one."""
    if not line.startswith("data:"):
        return None  # blank separators, comments, event names
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        tally.done = True
        return None
    obj = json.loads(data)
    if "error" in obj:
        return f"error in stream: {obj['error'].get('message', obj['error'])}"
    if obj.get("usage"):
        tally.usage = obj["usage"]
    choices = obj.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    if "token_ids" not in choice:  # fine for chat's role-only first chunk, not with text
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return "a chunk with text but no token_ids: the server ignores return_token_ids"
    ids = choice.get("token_ids") or []
    if ids:
        tally.chunk_s.append(now_s)
        tally.tokens += len(ids)
    if choice.get("finish_reason"):
        tally.finish_reason = choice["finish_reason"]
    return None


def _stream_error(tally: StreamTally) -> str | None:
    """What makes a finished stream a failed request."""
    if not tally.done:
        return "the stream ended before data: [DONE]"
    if tally.finish_reason == "abort":
        return "finish_reason=abort"
    if tally.usage is not None and tally.usage.get("completion_tokens") != tally.tokens:
        return (f"the chunks carried {tally.tokens} token ids but usage.completion_tokens is "
                f"{tally.usage.get('completion_tokens')}")
    return None


async def _stream_one(client: httpx.AsyncClient, spec: RequestSpec, settings: LoadSettings,
                      t0: float, tally: StreamTally) -> str | None:
    url = settings.base_url.rstrip("/") + settings.endpoint
    async with client.stream("POST", url, json=request_payload(spec, settings)) as resp:
        if resp.status_code != 200:
            return _http_error(resp.status_code, await resp.aread())
        async for line in resp.aiter_lines():
            # timed as it is handed over: lines that came in one read share one time
            error = take_line(line, time.perf_counter() - t0, tally)
            if error:
                return error
    return _stream_error(tally)


async def _one_request(client: httpx.AsyncClient, spec: RequestSpec, arrival_s: float,
                       settings: LoadSettings, t0: float,
                       slots: asyncio.Semaphore | None) -> RequestRecord:
    await asyncio.sleep(max(0.0, t0 + arrival_s - time.perf_counter()))
    if slots is not None:
        await slots.acquire()
    tally = StreamTally(chunk_s=[])
    send_s = time.perf_counter() - t0
    try:
        error = await asyncio.wait_for(_stream_one(client, spec, settings, t0, tally),
                                       settings.timeout_s)
    except TimeoutError:
        error = f"timed out after {settings.timeout_s:g} s (--timeout-s)"
    except Exception as exc:  # noqa: BLE001 - any failure is this request's, not the run's
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        if slots is not None:
            slots.release()
    prompt_tokens = (tally.usage or {}).get("prompt_tokens", spec.prompt_len)
    return RequestRecord(
        index=spec.index, max_tokens=spec.max_tokens, prompt_tokens=prompt_tokens,
        arrival_s=arrival_s, send_s=send_s, chunk_s=tuple(tally.chunk_s),
        end_s=time.perf_counter() - t0, output_tokens=tally.tokens,
        finish_reason=tally.finish_reason, error=error)


async def run_load_async(specs: Sequence[RequestSpec], arrivals: Sequence[float],
                         settings: LoadSettings) -> list[RequestRecord]:
    """Send every request at its arrival time; -> the records in request order."""
    # httpx's pool would otherwise hold requests beyond 100 connections in its own queue,
    # which the records would count as server latency
    limits = httpx.Limits(max_connections=settings.max_concurrency,
                          max_keepalive_connections=settings.max_concurrency)
    slots = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    # trust_env=False: a proxy from the environment would be measured with the server
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(settings.timeout_s),
                                 trust_env=False) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(_one_request(client, s, a, settings, t0, slots))
                 for s, a in zip(specs, arrivals)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # Ctrl-C or a cancelled caller: no task outlives the client
            for task in tasks:
                task.cancel()


def run_load(specs: Sequence[RequestSpec], arrivals: Sequence[float],
             settings: LoadSettings) -> list[RequestRecord]:
    """run_load_async in a fresh event loop."""
    if len(specs) != len(arrivals):
        raise ValueError(f"{len(specs)} requests but {len(arrivals)} arrival times")
    return asyncio.run(run_load_async(specs, arrivals, settings))


def served_model_name(base_url: str, timeout_s: float = 30.0) -> str:
    """The model id a server answers to (the first of GET /v1/models)."""
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        resp = client.get(base_url.rstrip("/") + "/v1/models")
        if resp.status_code != 200:
            raise RuntimeError(f"GET /v1/models: {_http_error(resp.status_code, resp.content)}")
        data = resp.json().get("data") or []
        if not data:
            raise RuntimeError("GET /v1/models listed no model")
        return str(data[0]["id"])
