"""Failures inside the engine: a refused request fails alone while others stream on; a
step that fails once is recovered (the tokens are the ones it would have produced); a
step that keeps failing fails the requests in flight (500 / an error event) and the
server serves the next request."""

from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import pytest

from shared import LLM, SamplingParams
from tests.shared.serving.api.live_server import LiveServer

CONFIG = dict(model="tiny-llama", dtype="float32", device="cpu", max_model_len=64,
              model_runner="v1", num_gpu_blocks_override=32)
BODY = {"prompt": [4, 5, 6], "max_tokens": 20, "ignore_eos": True, "return_token_ids": True,
        "temperature": 0.9, "seed": 1}


@pytest.fixture(scope="module")
def llm():
    return LLM(**CONFIG)


@pytest.fixture(scope="module")
def expected(llm):
    out = llm.generate([BODY["prompt"]], SamplingParams(max_tokens=20, ignore_eos=True,
                                                         temperature=0.9, seed=1),
                       use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.fixture
def server(llm, expected):
    with LiveServer(llm.engine) as srv:
        yield srv


@pytest.fixture
def failing_steps(server, monkeypatch):
    """failing_steps(k): the next k forwards raise."""
    runner = server.engine.runner
    real = runner.execute_model
    left = [0]

    def execute_model(scheduler_output):
        if left[0] > 0 and scheduler_output.total_num_scheduled_tokens:
            left[0] -= 1
            raise RuntimeError("injected step failure")
        return real(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", execute_model)
    return lambda k: left.__setitem__(0, k)


async def _stream_ids(http, url, body):
    ids, errors = [], []
    async with http.stream("POST", url, json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                for choice in event.get("choices", []):
                    ids.extend(choice["token_ids"])
    return ids, errors


def test_a_refused_request_fails_alone(server, expected):
    url = server.base_url + "/v1/completions"

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            streaming = asyncio.ensure_future(_stream_ids(http, url, BODY))
            while server.engine.get_num_unfinished_requests() == 0:
                await asyncio.sleep(0.005)
            bad = await http.post(url, json={"prompt": [10**6], "max_tokens": 2})
            return bad, await streaming

    bad, (ids, errors) = asyncio.run(main())
    assert bad.status_code == 400 and "vocab" in bad.json()["error"]["message"]
    assert ids == expected and errors == []


def test_one_failed_step_is_recovered(server, failing_steps, expected):
    failing_steps(1)
    r = httpx.post(server.base_url + "/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected


def test_a_step_that_keeps_failing_fails_its_requests_not_the_server(server, failing_steps,
                                                                      expected):
    url = server.base_url + "/v1/completions"
    failing_steps(2)
    r = httpx.post(url, json=BODY, timeout=60)
    assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
    failing_steps(2)

    async def streamed():
        async with httpx.AsyncClient(timeout=60) as http:
            return await _stream_ids(http, url, BODY)

    ids, errors = asyncio.run(streamed())
    assert ids == [] and len(errors) == 1 and errors[0]["code"] == 500
    server.wait_idle()
    assert server.engine.num_free_kv_blocks() == server.engine.num_total_kv_blocks()
    ok = httpx.post(url, json=BODY, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == expected
