"""A response's outputs -> OpenAI bodies: the whole response, or its event stream.

Both read a ResponseStream (one engine request per prompt; request i is prompt i) and
number choices as OpenAI does: prompt i's sample j is choice i * n + j.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from shared.contract.outputs import CompletionOutput, RequestOutput
from shared.contract.sampling_params import RequestOutputKind, SamplingParams
from shared.serving.api.async_engine import EngineStepError, ResponseStream
from shared.serving.api.protocol import ChatCompletionRequest
from shared.serving.api.responses import (
    ResponseHeader,
    chat_logprobs,
    choice_extras,
    completion_logprobs,
    output_choices,
    sse,
    usage,
)


def _is_chat(req: Any) -> bool:
    return isinstance(req, ChatCompletionRequest)


def response_header(req: Any, model: str) -> ResponseHeader:
    """The response's id, object and creation time; its engine requests are named after
    the id. A streamed chat response's chunks are "chat.completion.chunk"s."""
    if _is_chat(req):
        return ResponseHeader.new("chatcmpl", "chat.completion.chunk" if req.stream
                                  else "chat.completion", model)
    return ResponseHeader.new("cmpl", "text_completion", model)


def _logprobs(req: Any, c: CompletionOutput, first: int, end: int, offset: int) -> Any:
    if c.logprobs is None:
        return None
    ids, entries = c.token_ids[first:end], c.logprobs[first:end]
    if _is_chat(req):
        return chat_logprobs(entries, ids, req.top_logprobs or 0)
    return completion_logprobs(entries, ids, offset)


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    return usage(sum(len(o.prompt_token_ids) for o in outputs),
                 sum(len(c.token_ids) for o in outputs for c in o.outputs))


async def final_outputs(stream: ResponseStream, order: list[str], req: Any,
                        header: ResponseHeader) -> dict[str, Any]:
    """The non-streamed body, once every request has finished."""
    latest: dict[str, RequestOutput] = {}
    async for out in stream:
        latest[out.request_id] = out
    outputs = [latest[r] for r in order]
    choices = []
    for index, c in output_choices(outputs, req.n):
        ids = c.token_ids if req.return_token_ids else None
        choice: dict[str, Any] = {"index": index}
        if _is_chat(req):
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        choice["logprobs"] = _logprobs(req, c, 0, len(c.token_ids), 0)
        choice.update(choice_extras(c, True, ids))
        choices.append(choice)
    return header.body(choices, usage=_usage(outputs))


class _Choice:
    """One streamed choice: whether it is done, and where its logprob offsets are."""

    def __init__(self) -> None:
        self.text_offset = 0  # completions logprobs: characters of the tokens sent
        self.done = False
        self.started = False  # chat: the role has been sent


def _chunk_choice(req: Any, state: _Choice, index: int, c: CompletionOutput,
                  finished: bool) -> dict[str, Any] | None:
    """This step's chunk for one choice from its DELTA output (the engine has held back
    an incomplete character and a possible stop-string start already), or None when it
    has nothing to send. A piece with tokens but no settled text is sent too (vLLM's rule):
    its logprobs are its tokens', and skipping it lost them and shifted the text offsets
    of the logprobs after it."""
    if not (c.text or finished or c.token_ids):
        return None
    logprobs = _logprobs(req, c, 0, len(c.token_ids), state.text_offset)
    if logprobs is not None and not _is_chat(req):
        state.text_offset += sum(len(t) for t in logprobs["tokens"])
    choice: dict[str, Any] = {"index": index}
    if _is_chat(req):
        choice["delta"] = {"content": c.text} if c.text or not finished else {}
    else:
        choice["text"] = c.text
    choice["logprobs"] = logprobs
    choice.update(choice_extras(c, finished, c.token_ids if req.return_token_ids else None))
    return choice


def stream_params(params: list[SamplingParams]) -> list[SamplingParams]:
    """A streamed response's engine requests report DELTA outputs: each step only what
    it added, so neither the engine nor the stream copies a whole output per step."""
    return [dataclasses.replace(p, output_kind=RequestOutputKind.DELTA) for p in params]


async def response_events(stream: ResponseStream, order: list[str], req: Any,
                          header: ResponseHeader) -> AsyncIterator[str]:
    """The event stream of requests added with stream_params' DELTA outputs."""
    prompt_of = {rid: i for i, rid in enumerate(order)}
    choices: dict[int, _Choice] = {}
    prompt_tokens: dict[str, int] = {}
    completion_tokens = 0
    try:
        async for out in stream:
            p = prompt_of[out.request_id]
            prompt_tokens[out.request_id] = len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                index = p * req.n + c.index
                state = choices.setdefault(index, _Choice())
                if state.done:  # nothing follows a finished sample's last piece
                    continue
                if _is_chat(req) and not state.started:
                    state.started = True
                    yield sse(header.body([{"index": index, "delta": {"role": "assistant",
                                                                      "content": ""},
                                            "logprobs": None, "finish_reason": None}]))
                finished = c.finish_reason is not None
                state.done = finished
                choice = _chunk_choice(req, state, index, c, finished)
                if choice is not None:
                    yield sse(header.body([choice]))
    except EngineStepError as exc:
        yield sse({"error": {"message": str(exc), "type": "InternalServerError",
                             "param": None, "code": 500}})
        yield sse("[DONE]")
        return
    if req.include_usage:
        yield sse(header.body([], usage=usage(sum(prompt_tokens.values()), completion_tokens)))
    yield sse("[DONE]")
