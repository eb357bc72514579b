"""`runnerlab serve` over a tiny random Llama (token-id prompts), both runners, through the
real `openai` client and raw HTTP. The oracle of every generated token is LLM.generate on
a separate engine of the same configuration with the same seeds."""

from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import openai
import pytest

from shared import LLM, SamplingParams
from tests.shared.serving.api.live_server import LiveServer

CONFIG = dict(model="tiny-llama", dtype="float32", device="cpu", max_model_len=96,
              max_num_seqs=16, num_gpu_blocks_override=64)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 1, 4, 1, 5, 9, 2, 6]]
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module", params=["v1", "v2"])
def runner(request):
    return request.param


@pytest.fixture(scope="module")
def reference(runner):
    return LLM(**CONFIG, model_runner=runner)


@pytest.fixture(scope="module")
def server(runner):
    llm = LLM(**CONFIG, model_runner=runner)
    with LiveServer(llm.engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _expected(reference, prompt, **params):
    out = reference.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    return [c.token_ids for c in out.outputs]


def _stream_token_ids(chunks) -> dict[int, list[int]]:
    ids: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            ids.setdefault(choice.index, []).extend(choice.model_extra["token_ids"])
    return ids


def test_completion_equals_llm_generate_streamed_or_not(client, reference, server):
    params = dict(max_tokens=7, temperature=0.8, top_p=0.9, seed=11)
    want = _expected(reference, PROMPTS[0], ignore_eos=True, **params)[0]
    whole = client.completions.create(model="test-model", prompt=PROMPTS[0], extra_body=EXTRA,
                                      **params)
    assert whole.choices[0].model_extra["token_ids"] == want
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (5, 7)
    chunks = list(client.completions.create(
        model="test-model", prompt=PROMPTS[0], stream=True, extra_body=EXTRA,
        stream_options={"include_usage": True}, **params))
    assert _stream_token_ids(chunks) == {0: want}
    # a chunk per step that brought tokens (a decode step brings one), or fewer where the
    # reader fell behind and the waiting steps went as one (api/coalesce.py)
    sizes = [len(c.choices[0].model_extra["token_ids"]) for c in chunks[:-1]]
    assert sum(sizes) == 7 and min(sizes) >= 1
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    server.wait_idle()
    assert server.engine.num_free_kv_blocks() == server.engine.num_total_kv_blocks()


def test_batched_prompts_n_and_logprobs(client, reference):
    params = dict(max_tokens=4, temperature=1.0, seed=5, n=2)
    out = client.completions.create(model="test-model", prompt=PROMPTS[1:], logprobs=2,
                                    extra_body=EXTRA, **params)
    got = {c.index: c.model_extra["token_ids"] for c in out.choices}
    for p, prompt in enumerate(PROMPTS[1:]):
        want = _expected(reference, prompt, ignore_eos=True, logprobs=2, **params)
        assert [got[p * 2 + j] for j in range(2)] == want
    want_lp = reference.generate([PROMPTS[1]], SamplingParams(
        ignore_eos=True, logprobs=2, **params), use_tqdm=False)[0].outputs[0].logprobs
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([d[t].logprob for d, t in
                                               zip(want_lp, got[0])], abs=1e-5)
    assert lp.tokens == [f"token_id:{t}" for t in got[0]]  # no tokenizer: vLLM's form
    assert all(len(top) >= 2 for top in lp.top_logprobs)


def test_stop_token_ids_and_greedy_stream(client, reference):
    greedy = _expected(reference, PROMPTS[2], max_tokens=8, temperature=0.0, ignore_eos=True)[0]
    stop = greedy[3]
    chunks = list(client.completions.create(
        model="test-model", prompt=PROMPTS[2], max_tokens=8, temperature=0.0, stream=True,
        extra_body={**EXTRA, "stop_token_ids": [stop]}))
    ids = _stream_token_ids(chunks)[0]
    assert ids == greedy[:greedy.index(stop) + 1]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop


def test_concurrent_requests_each_get_their_own_tokens(server, reference):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x",
                                    max_retries=0)
        jobs = [client.completions.create(model="test-model", prompt=PROMPTS[i % 3],
                                          max_tokens=3 + i % 4, temperature=0.7, seed=i,
                                          stream=i % 2 == 0, extra_body=EXTRA)
                for i in range(12)]
        results = await asyncio.gather(*jobs)
        out = []
        for i, r in enumerate(results):
            out.append(_stream_token_ids([c async for c in r])[0] if i % 2 == 0
                       else r.choices[0].model_extra["token_ids"])
        await client.close()
        return out

    got = asyncio.run(main())
    for i, ids in enumerate(got):
        assert ids == _expected(reference, PROMPTS[i % 3], max_tokens=3 + i % 4,
                                temperature=0.7, seed=i, ignore_eos=True)[0]
    server.wait_idle()
    assert server.engine.num_free_kv_blocks() == server.engine.num_total_kv_blocks()


BAD_REQUESTS = [
    ("malformed JSON", b"{not json", 400, None),
    ("a JSON list", b"[1, 2]", 400, None),
    ("unknown model", {"model": "other", "prompt": [1, 2]}, 404, "model"),
    ("unsupported field", {"prompt": [1, 2], "suffix": "x"}, 400, "suffix"),
    ("unknown field", {"prompt": [1, 2], "tools": []}, 400, "tools"),
    ("text without a tokenizer", {"prompt": "hello"}, 400, "prompt"),
    ("prompt over max_model_len", {"prompt": [1] * 200}, 400, "prompt"),
    ("token id outside the vocabulary", {"prompt": [10**6]}, 400, "prompt"),
    ("logit_bias id outside the vocabulary", {"prompt": [1], "logit_bias": {"100000": 1.0}},
     400, "logit_bias"),
    ("negative temperature", {"prompt": [1], "temperature": -1}, 400, "temperature"),
    ("top_p above 1", {"prompt": [1], "top_p": 1.5}, 400, "top_p"),
    ("max_tokens 0", {"prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ("a string for a number", {"prompt": [1], "temperature": "hot"}, 400, "temperature"),
    ("n = 0", {"prompt": [1], "n": 0}, 400, "n"),
    ("echo", {"prompt": [1], "echo": True}, 400, "echo"),
    ("best_of over n", {"prompt": [1], "best_of": 3}, 400, "best_of"),
    ("empty prompt list", {"prompt": []}, 400, "prompt"),
]


@pytest.mark.parametrize("name,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_refused_and_the_server_keeps_serving(server, name, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.base_url + "/v1/completions", content=data,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["param"] == param
    ok = httpx.post(server.base_url + "/v1/completions", timeout=30,
                    json={"prompt": [1, 2], "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_chat_needs_a_tokenizer(server):
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def _read_some_then_disconnect(server, body, chunks_to_read: int) -> int:
    read = 0
    with httpx.Client(timeout=30) as http, http.stream(
            "POST", server.base_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                read += 1
                if read == chunks_to_read:
                    break  # leaving the block closes the connection mid-stream
    return read


def test_disconnect_mid_stream_aborts_and_frees_every_block(server):
    aborted = _finished_count(server, "abort")
    body = {"prompt": PROMPTS[0], "max_tokens": 80, "stream": True, **EXTRA}
    assert _read_some_then_disconnect(server, body, 3) == 3
    server.wait_idle()
    engine = server.engine
    assert engine.num_free_kv_blocks() == engine.num_total_kv_blocks()
    assert _finished_count(server, "abort") == aborted + 1  # aborted, not run to the end


def test_disconnect_before_a_non_streamed_answer_aborts(server):
    engine = server.engine
    aborted = _finished_count(server, "abort")

    async def main():
        async with httpx.AsyncClient(timeout=30) as http:
            task = asyncio.ensure_future(http.post(
                server.base_url + "/v1/completions",
                json={"prompt": PROMPTS[0], "max_tokens": 85, "ignore_eos": True}))
            while engine.get_num_unfinished_requests() == 0:
                await asyncio.sleep(0.01)
            task.cancel()  # closes the connection before the answer
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    server.wait_idle()
    assert engine.num_free_kv_blocks() == engine.num_total_kv_blocks()
    assert _finished_count(server, "abort") == aborted + 1


def test_models_health_and_metrics(server, runner):
    models = httpx.get(server.base_url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["test-model"]
    assert models["data"][0]["runner"] == runner
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    before = _finished_count(server)
    for _ in range(3):
        httpx.post(server.base_url + "/v1/completions", timeout=30,
                   json={"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True})
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert _finished_count(server) == before + 3
    assert f'runner="{runner}"' in text
    for name in ("runnerlab_time_to_first_token_seconds_count",
                 "runnerlab_inter_token_latency_seconds_count",
                 'runnerlab_step_stage_seconds_count{stage="forward"}',
                 "runnerlab_num_requests_running", "runnerlab_kv_cache_blocks_used"):
        assert name in text, name


def _finished_count(server, reason: str = "length") -> float:
    return _metric(server, f'runnerlab_requests_finished_total{{finish_reason="{reason}"}}')


def _metric(server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    line = next((x for x in text.splitlines() if x.startswith(name + " ")), None)
    return 0.0 if line is None else float(line.split()[-1])


def test_metrics_count_a_streamed_requests_whole_output(client, server):
    """A streamed request's outputs are DELTA pieces: its last one carries only the last
    step's tokens, of the samples that step advanced; the counters take its whole life."""
    server.wait_idle()
    tokens = _metric(server, "runnerlab_generation_tokens_total")
    finished = _finished_count(server)
    chunks = list(client.completions.create(
        model="test-model", prompt=PROMPTS[1], stream=True, n=2, max_tokens=5,
        temperature=0.9, seed=3, extra_body=EXTRA))
    assert {i: len(ids) for i, ids in _stream_token_ids(chunks).items()} == {0: 5, 1: 5}
    server.wait_idle()
    assert _metric(server, "runnerlab_generation_tokens_total") == tokens + 10
    assert _finished_count(server) == finished + 2


def test_bounded_load_nothing_lost_or_duplicated(server, runner):
    """200 requests, at most 32 in flight, each with its own length: every request gets
    exactly its tokens back (ignore_eos), and every KV block is free at the end. (V2's
    Triton kernels run interpreted on the CPU: it gets one wave of 32, the server being
    the same code for both runners.)"""
    num, limit = (200, 32) if runner == "v1" else (32, 32)

    async def one(http, sem, i):
        async with sem:
            r = await http.post(server.base_url + "/v1/completions", json={
                "prompt": PROMPTS[i % 3] + [i % 50], "max_tokens": 1 + i % 5,
                "ignore_eos": True, "return_token_ids": True, "seed": i, "temperature": 0.9})
            return i, r.status_code, r.json()

    async def main():
        sem = asyncio.Semaphore(limit)
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, sem, i) for i in range(num)))

    results = asyncio.run(main())
    assert sorted(i for i, _, _ in results) == list(range(num))
    ids = set()
    for i, status, body in results:
        assert status == 200, body
        assert len(body["choices"][0]["token_ids"]) == 1 + i % 5
        ids.add(body["id"])
    assert len(ids) == num  # one response per request, none repeated
    server.wait_idle()
    assert server.engine.num_free_kv_blocks() == server.engine.num_total_kv_blocks()
