"""OpenAI response bodies from RequestOutputs: whole responses and streamed chunks.

A stream sends, per step, what the step added to each choice: the engine's DELTA
outputs, whose text shared/serving/output_delta.py settles (an incomplete character and
a possible stop-string start held back), so the streamed pieces concatenate to the
non-streamed text.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from shared.contract.outputs import CompletionOutput, PositionLogprobs, RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def token_text(token_id: int, decoded: str | None) -> str:
    """A token as the logprobs show it; vLLM's form for a model without a tokenizer."""
    return decoded if decoded is not None else f"token_id:{token_id}"


# ---- logprobs ----------------------------------------------------------------------------
def completion_logprobs(entries: list[PositionLogprobs], token_ids: list[int],
                        text_offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs and
    each token's offset in the text (counted from text_offset)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        sampled = entry[token_id]
        text = token_text(token_id, sampled.decoded_token)
        tokens.append(text)
        token_logprobs.append(sampled.logprob)
        tops.append({token_text(t, lp.decoded_token): lp.logprob for t, lp in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(entries: list[PositionLogprobs], token_ids: list[int],
                  top_n: int) -> dict[str, Any]:
    """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and top_n
    alternatives (most likely first)."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        sampled = entry[token_id]
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None
                      and lp.rank <= top_n), key=lambda item: item[1].rank)
        content.append({**_chat_token(token_id, sampled),
                        "top_logprobs": [_chat_token(t, lp) for t, lp in top[:top_n]]})
    return {"content": content}


def _chat_token(token_id: int, lp: Any) -> dict[str, Any]:
    text = token_text(token_id, lp.decoded_token)
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


# ---- bodies ------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


@dataclass(frozen=True)
class ResponseHeader:
    """What every body or chunk of one response repeats."""

    id: str
    object: str
    model: str
    created: int

    @classmethod
    def new(cls, prefix: str, obj: str, model: str) -> ResponseHeader:
        return cls(new_id(prefix), obj, model, int(time.time()))

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}


def choice_extras(completion: CompletionOutput, finished: bool, token_ids: list[int] | None
                  ) -> dict[str, Any]:
    """finish_reason (and vLLM's stop_reason) and, with return_token_ids, the token ids."""
    out: dict[str, Any] = {"finish_reason": completion.finish_reason if finished else None}
    if finished:
        out["stop_reason"] = completion.stop_reason
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def output_choices(outputs: list[RequestOutput], n: int) -> list[tuple[int, CompletionOutput]]:
    """(OpenAI choice index, completion) over a response's prompts: prompt i's sample j
    is choice i * n + j."""
    return [(i * n + c.index, c) for i, out in enumerate(outputs) for c in out.outputs]
