"""OpenAI response bodies from RequestOutputs: whole responses and streamed chunks.

A stream sends, per step, what the step added to each choice (`ChoiceDelta`). The
engine's text is the decode of every output token so far, so a step's text is the new
suffix; two kinds of suffix are held back until a later step settles them: an
incomplete UTF-8 character at the end (decoded as U+FFFD until its last byte arrives)
and, with stop strings excluded from the output, the last len(stop) - 1 characters
(a stop string may be starting there, and the finished text is cut before it). The
streamed pieces therefore concatenate to the non-streamed text.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from shared.contract.outputs import CompletionOutput, PositionLogprobs, RequestOutput

logger = logging.getLogger("runnerlab")

_REPLACEMENT = "\ufffd"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def token_text(token_id: int, decoded: str | None) -> str:
    """A token as the logprobs show it; vLLM's form for a model without a tokenizer."""
    return decoded if decoded is not None else f"token_id:{token_id}"


@dataclass
class ChoiceDelta:
    """What to stream next for one choice: tracks what has been sent."""

    holdback: int = 0  # characters held while unfinished (max stop length - 1)
    sent_text: str = ""
    sent_tokens: int = 0

    def advance(self, completion: CompletionOutput, finished: bool) -> tuple[str, int, int]:
        """-> (new text, first new token index, end token index)."""
        first, end = self.sent_tokens, len(completion.token_ids)
        self.sent_tokens = end
        text = completion.text
        ready = text
        if not finished:
            # the partial character first: the held tail is counted in settled text
            ready = ready.rstrip(_REPLACEMENT)
            if self.holdback:
                ready = ready[:max(len(ready) - self.holdback, 0)]
        if not ready.startswith(self.sent_text):
            if not finished:
                return "", first, end  # not settled yet: the next step's text decides
            logger.warning("A request's final text does not extend its streamed text; the "
                           "stream sends the final text's remainder")
            common = _common_prefix_len(ready, self.sent_text)
            self.sent_text = ready
            return ready[common:], first, end
        delta = ready[len(self.sent_text):]
        if delta:
            self.sent_text = ready
        return delta, first, end


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def holdback_for(params: Any) -> int:
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


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
