"""The stop conditions the scheduler checks after each appended token, and the length
limits it checks before scheduling a request whose tokens are still in flight."""

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
