"""A step's RequestUpdate as what LLMEngine.step() returns: which requests report this
step (SamplingParams.output_kind) and the RequestOutput (or PoolingRequestOutput) each
gets. Parallel samples (n > 1) are gathered into their parent's afterwards
(shared/serving/parallel_sampling.py)."""

from __future__ import annotations

from typing import Any

from shared.contract.outputs import CompletionOutput, RequestOutput
from shared.contract.pooling import PoolingOutput, PoolingRequestOutput
from shared.contract.sampling_params import RequestOutputKind
from shared.serving.detokenizer import IncrementalDetokenizer
from shared.serving.output_delta import OutputDelta, holdback_for
from shared.serving.prompt_logprobs import prompt_logprobs_output
from shared.serving.request import Request


def reports(update: Any) -> bool:
    """Whether this step's outputs include the request, by its SamplingParams.output_kind:
    CUMULATIVE and DELTA after every step that advanced it, FINAL_ONLY once it finishes.
    A pooling request reports once, finished: its one result is the pooled output."""
    if update.finished:
        return True
    req = update.request
    if req.pooling_params is not None:
        return False
    return req.sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY


def request_output(update: Any, tokenizer: Any,
                   with_spec_stats: bool) -> RequestOutput | PoolingRequestOutput:
    """The request's output after `update`: its whole output so far, or for DELTA what it
    gained since its last output (tokens and logprobs exactly, text as far as it has
    settled; the prompt logprobs with the first output only)."""
    req: Request = update.request
    if req.pooling_params is not None:
        return PoolingRequestOutput(req.request_id, list(req.prompt_token_ids),
                                    PoolingOutput(req.pooler_output), update.finished)
    params = req.sampling_params
    text = ""
    if req.detokenizer is not None:
        # grown token by token (stop strings, or an output kind that reports every step);
        # a finished request's held tail (an incomplete character) is decoded as it is
        detok = req.detokenizer
        text = detok.final_text() if update.finished else detok.output_text
    elif tokenizer is not None:
        # FINAL_ONLY without stop strings: nothing needs the text before it is returned,
        # so it is decoded once here (in the prompt's context, as the incremental text
        # is) rather than token by token inside the engine loop.
        text = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, params).decode_whole(
            req.output_token_ids)
    wants_logprobs = params.logprobs is not None
    first, end = 0, len(req.output_token_ids)
    prompt_logprobs = prompt_logprobs_output(req, tokenizer)
    if params.output_kind is RequestOutputKind.DELTA:
        if req.output_delta is None:
            req.output_delta = OutputDelta(holdback_for(params))
        else:
            prompt_logprobs = None  # sent with the first output
        text, first, end = req.output_delta.advance(text, end, update.finished)
    completion = CompletionOutput(
        index=0,
        # slices: copies, so a returned output never changes under the caller
        token_ids=req.output_token_ids[first:end],
        text=text,
        logprobs=req.logprobs[first:end] if wants_logprobs else None,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        cumulative_logprob=req.cumulative_logprob if wants_logprobs else None,
    )
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        outputs=[completion],
        finished=update.finished,
        prompt_logprobs=prompt_logprobs,
        spec_decode_stats=req.spec_decode_stats if with_spec_stats else None,
        metrics=req.times.as_dict(),
    )
