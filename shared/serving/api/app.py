"""The OpenAI-compatible FastAPI app of `runnerlab serve`.

Routes: /v1/completions and /v1/chat/completions (streamed as server-sent events with
stream=true), /v1/models, /health, /metrics. A refused request is a 4xx with OpenAI's
JSON error body and touches no other request; a request whose steps fail in the engine
gets a 500 (or, streaming, an error event) while the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shared.contract.sampling_params import SamplingParams
from shared.serving.api.async_engine import AsyncEngine, EngineStepError, ResponseStream
from shared.serving.api.metrics import CONTENT_TYPE, ServerMetrics
from shared.serving.api.protocol import (
    CHAT_FIELD_NAMES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from shared.serving.api.streaming import (
    final_outputs,
    response_events,
    response_header,
    stream_params,
)
from shared.serving.chat import ChatTemplateError, chat_prompt_token_ids
from shared.serving.engine import EngineInputError, LLMEngine


class ServerState:
    """What the routes share: the engine loop, its metrics and the served name."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = ServerMetrics(engine)
        self.async_engine = AsyncEngine(engine, observer=self.metrics)
        self.created = int(time.time())

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", "model",
                           err_type="NotFoundError", code="model_not_found")

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, f"model {self.model_name!r} has no tokenizer; send the prompt "
                                "as a list of token ids", "prompt")
        return list(tokenizer.encode(prompt))


def build_app(engine: LLMEngine, model_name: str) -> FastAPI:
    """The app over `engine`; its lifespan starts and stops the engine loop."""
    state = ServerState(engine, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.async_engine.start()
        try:
            yield
        finally:
            state.async_engine.stop()

    app = FastAPI(title="runnerlab", lifespan=lifespan)
    app.state.runnerlab = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.async_engine.is_running else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "runnerlab", "max_model_len": state.max_model_len,
            "runner": engine.runner_name}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(state.async_engine.snapshot),
                        media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_body(CompletionRequest, await _json_body(request))
        state.check_model(req.model)
        prompts = [state.tokenize(p) for p in req.prompts()]
        params = [req.sampling_params(len(p), state.max_model_len) for p in prompts]
        return await _respond(request, state, req, prompts, params)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await _json_body(request))
        state.check_model(req.model)
        try:
            prompt = chat_prompt_token_ids(engine.tokenizer, req.conversation(),
                                           req.add_generation_prompt)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), "messages") from exc
        params = [req.sampling_params(len(prompt), state.max_model_len)]
        return await _respond(request, state, req, [prompt], params)

    return app


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc


async def _respond(request: Request, state: ServerState, req: Any, prompts: list[list[int]],
                   params: list[SamplingParams]) -> Response:
    """Admit every prompt (a refusal aborts the ones admitted), then stream or answer."""
    stream = state.async_engine.stream()
    header = response_header(req, state.model_name)
    if req.stream:
        params = stream_params(params)
    order = [f"{header.id}-{i}" for i in range(len(prompts))]  # request i: prompt i
    try:
        for request_id, prompt, sp in zip(order, prompts, params):
            await stream.add(request_id, prompt, sp)
    except EngineInputError as exc:
        stream.abort()
        raise APIError(400, str(exc), _refused_field(str(exc), req)) from exc
    except BaseException:
        stream.abort()
        raise
    if req.stream:
        events = response_events(stream, order, req, header)
        return StreamingResponse(_guarded(events, stream), media_type="text/event-stream")
    work = final_outputs(stream, order, req, header)
    return await _until_done_or_disconnect(request, stream, work)


def _refused_field(message: str, req: Any) -> str:
    """The request field an engine refusal names: a SamplingParams field by its request
    name (chat's top_logprobs is SamplingParams.logprobs), else the prompt (its length,
    an id outside the vocabulary, ...)."""
    found = re.search(r"SamplingParams\.(\w+)", message)
    if found is None:
        return "prompt"
    names = CHAT_FIELD_NAMES if isinstance(req, ChatCompletionRequest) else {}
    return names.get(found.group(1), found.group(1))


async def _guarded(events: AsyncIterator[str], stream: ResponseStream) -> AsyncIterator[str]:
    """The event stream; however it ends (a disconnect cancels it), nothing runs on."""
    try:
        async for event in events:
            yield event
    finally:
        stream.abort()


async def _until_done_or_disconnect(request: Request, stream: ResponseStream,
                                    body: Any) -> Response:
    """The whole response (`body`, a coroutine), or nothing if the client leaves first
    (its requests are aborted then, as a streaming client's are)."""
    work = asyncio.ensure_future(body)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return JSONResponse(work.result())
        return Response(status_code=499)  # nobody reads it
    except EngineStepError as exc:
        raise APIError(500, str(exc), err_type="InternalServerError") from exc
    finally:
        for task in (work, gone):
            task.cancel()
        stream.abort()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read: receive() waits for it)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
