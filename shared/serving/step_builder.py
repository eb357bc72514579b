"""One step as the scheduler builds it (StepBuilder) and keeps it until its output lands
(InFlightStep). Split from the scheduler so that its policy (who runs, who is preempted)
reads apart from the bookkeeping of what one step hands the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.contract.step import CachedRequestData, NewRequestData, SchedulerOutput
from shared.serving.request import Request


@dataclass
class InFlightStep:
    """What schedule() handed out, kept until update_from_output() consumes it.

    Holding the Request objects (not ids) is what lets a late runner output of an aborted
    request be ignored even after its id was resubmitted.
    """

    scheduler_output: SchedulerOutput
    scheduled: dict[str, Request]
    # Finished (aborted, or stopped by a failed step's update) but not yet reported.
    unreported: list[Request] = field(default_factory=list)
    # Requests this step samples for, with the placeholders each holds until the update
    # (1, or 1 + its drafts under speculative decoding: the optimistic count).
    sampling: dict[Request, int] = field(default_factory=dict)
    # Requests this step's update finished, kept until the update returns: if it
    # raises, the recovery reports them with the next step.
    finished: list[Request] = field(default_factory=list)


class StepBuilder:
    """Accumulates one step's SchedulerOutput while the budget is spent."""

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.new_reqs: list[NewRequestData] = []
        self.cached_reqs = CachedRequestData()
        self.num_scheduled_tokens: dict[str, int] = {}
        self.scheduled: dict[str, Request] = {}
        self.preempted_req_ids: set[str] = set()
        self.sampling: dict[Request, int] = {}
        self.spec_decode_tokens: dict[str, list[int]] = {}

    def _take(self, request: Request, num_new: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_new
        self.scheduled[request.request_id] = request
        self.token_budget -= num_new
        request.num_computed_tokens += num_new  # vLLM's convention: advanced at schedule
        # A chunk that reaches the last known (or in-flight) token samples the next one;
        # a verify of d drafts may yield up to 1 + d tokens: counted optimistically (all
        # accepted) until the output lands and says how many.
        if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
            n = 1 + len(self.spec_decode_tokens.get(request.request_id, ()))
            request.num_output_placeholders += n
            self.sampling[request] = n

    def add_cached(
        self, request: Request, num_new: int, new_block_ids: list[int], drafts: list[int]
    ) -> None:
        if drafts:
            self.spec_decode_tokens[request.request_id] = drafts
        self.cached_reqs.req_ids.append(request.request_id)
        self.cached_reqs.new_block_ids.append(new_block_ids)
        self.cached_reqs.num_computed_tokens.append(request.num_computed_tokens)
        self._take(request, num_new)

    def add_new(self, request: Request, num_new: int) -> None:
        # A resumed request's prefill is all its tokens; prompt_len stays the user prompt.
        self.new_reqs.append(
            NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=list(request.all_token_ids),
                sampling_params=request.sampling_params,
                block_ids=list(request.block_ids),
                num_computed_tokens=request.num_computed_tokens,
                prompt_len=request.num_prompt_tokens,
                eos_token_id=request.eos_token_id,
                pooling_params=request.pooling_params,
            )
        )
        self._take(request, num_new)

    def build(self, finished_req_ids: set[str]) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=self.cached_reqs,
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
            scheduled_spec_decode_tokens=self.spec_decode_tokens,
        )
