"""The stop conditions the scheduler checks after each appended token (a sampled run is
appended token by token, so a stop inside an accepted draft run ends it there), and the
length limits it checks before scheduling a request whose tokens are still in flight."""

from __future__ import annotations

from shared.serving.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Stop check after the request's last token was appended; sets stop_reason.

    min_tokens: the k-th output (0-based) may stop the request only when k >= min_tokens,
    the same rule by which the samplers mask EOS / stop ids (fewer than min_tokens outputs
    existed when it was sampled), so an EOS the sampler would have masked never stops it.
    """
    params = request.sampling_params
    token_id = request.output_token_ids[-1]
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    may_stop = request.num_output_tokens - 1 >= params.min_tokens
    if may_stop and not params.ignore_eos and token_id == request.eos_token_id:
        return RequestStatus.FINISHED_STOPPED
    if may_stop and token_id in params.stop_token_ids:
        request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


def stops_when_landed(request: Request, max_model_len: int) -> bool:
    """Whether the request reaches a length limit once its in-flight tokens land."""
    pending = request.num_output_placeholders
    return (
        request.num_output_tokens + pending >= request.sampling_params.max_tokens
        or request.num_tokens + pending >= max_model_len
    )


def append_until_stop(
    request: Request, sampled: list[int], max_model_len: int
) -> tuple[list[int], RequestStatus | None]:
    """Append a step's sampled tokens one at a time, checking every stop condition after
    each (stop strings on the detokenised text too); the tokens past a stop are dropped.
    Returns the appended tokens and the finishing status (None: still running)."""
    appended: list[int] = []
    for token_id in sampled:
        request.append_output_token_id(token_id)
        appended.append(token_id)
        status = check_stop(request, max_model_len)
        if request.detokenizer is not None:
            stop_str = request.detokenizer.append(token_id)
            if stop_str is not None:
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        if status is not None:
            return appended, status
    return appended, None


def drafts_within_limits(
    request: Request, num_new: int, token_budget: int, max_model_len: int
) -> list[int]:
    """The request's drafts that may run this step: only after the last token of a
    decode (num_new == 1), and none whose accepted run would pass the token budget,
    max_model_len or max_tokens (tokens still in flight counted as if every draft of
    theirs is accepted)."""
    drafts = request.spec_token_ids
    if not drafts or num_new != 1:
        return []
    limit = min(
        token_budget - 1,
        # the run's last token (the target's own) still within max_model_len
        max_model_len - request.num_computed_tokens - 2,
        # the target's own token counts too
        request.sampling_params.max_tokens - request.num_output_tokens
        - request.num_output_placeholders - 1,
    )
    return drafts[: max(0, limit)]
