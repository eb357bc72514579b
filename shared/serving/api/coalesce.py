"""Outputs a response has not read yet, merged: one per request, as if one step had
brought them all (vLLM's output collector does the same).

The engine thread queues every request's output after every step. A response that falls
behind (a server at saturation: the event loop encodes and sends a chunk per request per
step) finds several outputs of a request waiting; sending each as its own event costs a
JSON encoding, an HTTP chunk and a socket write apiece, which is what keeps it behind.
Merged, a request's waiting outputs cost one of each, and a stream's events stay as
their concatenation: a DELTA output's pieces (token ids, text, logprobs) are appended in
order, a CUMULATIVE output is superseded by the later one.
"""

from __future__ import annotations

import dataclasses

from shared.contract.outputs import CompletionOutput, RequestOutput


def coalesce(items: list, delta: set[str]) -> list:
    """Queue items in arrival order (outputs, or an exception that ends the stream) ->
    the same, each request's outputs before an exception merged into its first one's
    place. delta: the request ids whose outputs are DELTA."""
    out: list = []
    merged: dict[str, int] = {}  # request id -> its index in `out`, since the last exception
    for item in items:
        if not isinstance(item, RequestOutput):
            out.append(item)
            merged.clear()  # nothing after an exception merges into what came before
            continue
        at = merged.get(item.request_id)
        if at is None:
            merged[item.request_id] = len(out)
            out.append(item)
        elif item.request_id in delta:
            out[at] = merge_delta(out[at], item)
        else:
            out[at] = item
    return out


def merge_delta(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive DELTA outputs of one request as one."""
    samples = {c.index: c for c in earlier.outputs}
    for c in later.outputs:
        first = samples.get(c.index)
        samples[c.index] = c if first is None else _merge_sample(first, c)
    return dataclasses.replace(
        later, outputs=[samples[i] for i in sorted(samples)],
        prompt=earlier.prompt if earlier.prompt is not None else later.prompt,
        # sent with a request's first output only
        prompt_logprobs=(earlier.prompt_logprobs if earlier.prompt_logprobs is not None
                         else later.prompt_logprobs))


def _merge_sample(first: CompletionOutput, then: CompletionOutput) -> CompletionOutput:
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = (first.logprobs or []) + (then.logprobs or [])
    # the rest (finish and stop reasons, cumulative logprob) is the state after `then`
    return dataclasses.replace(then, token_ids=first.token_ids + then.token_ids,
                               text=first.text + then.text, logprobs=logprobs)
