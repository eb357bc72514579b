"""Continuous-batching scheduler: waiting / running queues, token budget, chunked prefill,
prefix caching, preemption by recompute, stop conditions and aborts (DESIGN.md §3-§4).

One step is `schedule()` -> runner -> `update_from_output()`. Call update_from_output for
EVERY SchedulerOutput, a zero-token one included (with EMPTY_MODEL_RUNNER_OUTPUT): that is
where aborted requests are reported.

Async scheduling (async_scheduling=True): the engine calls schedule() for step N+1
before update_from_output() of step N. A request whose step-N chunk samples carries a
placeholder for that token until its output lands; the next step schedules the
placeholder's position (the runner takes its value from the device). A request that will
certainly stop once its placeholders land (max_tokens, max_model_len) is not scheduled;
one that stops on EOS or a stop id is discovered a step late, and the step it was
scheduled in is ignored for it (its late output finds it finished). A request preempted
while its output is in flight still takes that output: the token was sampled from a
complete, correct state, and the resume (never in the step that preempted) comes after it.

Finish reporting:
- a request that stops or hits a length limit is reported (RequestUpdate, finished=True)
  by the update_from_output that appended its last token; its id goes to the NEXT
  SchedulerOutput's finished_req_ids so the runner drops its state;
- an aborted request is reported by the update_from_output of the step whose
  SchedulerOutput first carries its id in finished_req_ids (the step after the abort).

Speculative decoding (num_speculative_tokens > 0): a decode's drafts, proposed by the
runner with the previous step's output (ModelRunnerOutput.draft_token_ids), are scheduled
as extra query tokens after its last token (SchedulerOutput.scheduled_spec_decode_tokens,
counted in num_scheduled_tokens), trimmed so that no draft lies past max_model_len,
max_tokens or the token budget. KV slots are allocated for the drafts plus
num_lookahead_tokens more (a draft model writes its KV that far ahead before the next
schedule). After verification num_computed_tokens drops by the rejected drafts (their KV
slots are simply overwritten later); the accepted tokens are appended one by one with the
stop check after each, so a stop inside an accepted run ends the request there. Prefix
caching hashes only appended tokens, so a draft never enters a block hash.

A failed step (any exception between schedule() and the end of update_from_output(),
KeyboardInterrupt included): the engine calls `recover_from_failed_step()`, which rolls
every live request back to what the scheduler had confirmed (the tokens appended by
updates that completed) and requeues it for a recompute, like a preemption of
everything; the runner forgets all request state at the same time. Finishes that a
half-done update applied are reported by the next update, so nothing is lost.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from shared.contract.outputs import make_position_logprobs
from shared.contract.step import ModelRunnerOutput, SchedulerOutput
from shared.serving.block_manager import KVCacheManager
from shared.serving.prompt_logprobs import record_prompt_logprobs
from shared.serving.request import Request, RequestStatus, RequestUpdate
from shared.serving.step_builder import InFlightStep, StepBuilder
from shared.serving.stop_checks import append_until_stop, drafts_within_limits, stops_when_landed

__all__ = ["Scheduler", "RequestUpdate"]


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        enable_chunked_prefill: bool = True,
        async_scheduling: bool = False,
        num_speculative_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        drafts_on_device: bool = False,
    ) -> None:
        if min(max_num_seqs, max_num_batched_tokens, max_model_len) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            # Without chunking a whole (resumed) prefill must fit one step's budget.
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} < max_model_len={max_model_len} "
                "needs enable_chunked_prefill=True"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.async_scheduling = async_scheduling
        if async_scheduling and num_speculative_tokens and not drafts_on_device:
            raise ValueError(
                "async_scheduling=True with speculative decoding needs a runner that keeps "
                "the drafts on the device (V2's draft_model); set async_scheduling=False, "
                "RUNNERLAB_USE_V2_MODEL_RUNNER=1 or speculative_config=None"
            )
        # Under async scheduling the next step is planned before this one's drafts reach
        # the host: a runner that proposes k drafts for every row that samples (V2, whose
        # values stay on the device anyway) gets k placeholder drafts scheduled at once.
        self.assume_drafts = async_scheduling and num_speculative_tokens > 0
        self.num_speculative_tokens = num_speculative_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)

        self.requests: dict[str, Request] = {}  # live (waiting or running) requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finishes since the last schedule(), handed to the runner by the next one.
        self.finished_req_ids: set[str] = set()
        self._unreported: list[Request] = []  # finishes the next update reports
        self._in_flight: dict[int, InFlightStep] = {}  # id(SchedulerOutput) -> record
        # token id -> text for the logprobs entries (set by the engine when it has a
        # tokenizer; None: decoded_token stays None)
        self.decode_token: Callable[[int], str] | None = None

    # ---- queries -----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_cache_manager.num_total_blocks

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """Finishes the runner has not been told about yet (or aborts not yet reported):
        one more step (possibly of zero tokens) is due even with no unfinished request."""
        return bool(self.finished_req_ids or self._unreported)

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already live")
        assert request.status == RequestStatus.WAITING and not request.block_ids
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort live requests by id (unknown ids are ignored); returns those aborted.

        Their blocks are freed now; the RequestUpdate comes with the next step.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        aborted = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self._unreported.append(request)
            aborted.append(request)
        return aborted

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.times.finished_time = time.time()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    # ---- schedule ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Running requests first, in running order; then waiting ones, FCFS."""
        step = StepBuilder(self.max_num_batched_tokens)
        self._schedule_running(step)
        # After a preemption the pool is short: admitting new work would only thrash.
        if not step.preempted_req_ids:
            self._schedule_waiting(step)
        out = step.build(self.finished_req_ids)
        self.finished_req_ids = set()
        self._in_flight[id(out)] = InFlightStep(out, step.scheduled, self._unreported, step.sampling)
        self._unreported = []
        return out

    def _num_new_tokens(self, request: Request, num_computed: int, token_budget: int) -> int:
        # Everything not yet computed: the rest of a (chunked) prefill, or the one token
        # sampled last step (or, under async scheduling, still in flight: a placeholder).
        # Never a position at or past max_model_len.
        num_new = request.num_tokens + request.num_output_placeholders - num_computed
        num_new = min(num_new, self.max_model_len - num_computed)
        if self.enable_chunked_prefill:
            num_new = min(num_new, token_budget)
        return num_new

    def _schedule_running(self, step: StepBuilder) -> None:
        i = 0
        while i < len(self.running) and step.token_budget > 0:
            request = self.running[i]
            if request.num_output_placeholders and stops_when_landed(request, self.max_model_len):
                i += 1  # its in-flight token is its last: nothing more to compute
                continue
            num_new = self._num_new_tokens(request, request.num_computed_tokens, step.token_budget)
            if num_new <= 0 or num_new > step.token_budget:
                i += 1
                continue
            # a draft is proposed for one step only: consumed whether it runs or not
            drafts, request.spec_token_ids = drafts_within_limits(
                request, num_new, step.token_budget, self.max_model_len), []
            num_new += len(drafts)
            # never past max_model_len: the block table has no column there
            lookahead = min(self.num_lookahead_tokens,
                            self.max_model_len - request.num_computed_tokens - num_new)
            new_block_ids = self._allocate_or_preempt(request, num_new + lookahead, step)
            if new_block_ids is None:
                break  # the request preempted itself: everything after it is gone too
            step.add_cached(request, num_new, new_block_ids, drafts)
            self._assume_drafts(request, step)
            i += 1

    def _assume_drafts(self, request: Request, step: StepBuilder) -> None:
        if self.assume_drafts and request in step.sampling:
            request.spec_token_ids = [-1] * self.num_speculative_tokens

    def _allocate_or_preempt(
        self, request: Request, num_new: int, step: StepBuilder
    ) -> list[int] | None:
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            # Victims come from the tail, which this loop has not scheduled yet.
            victim = self.running.pop()
            if victim is request and not self.running:
                self.running.append(victim)
                raise RuntimeError(
                    f"request {request.request_id!r} alone does not fit the KV cache "
                    f"({self.num_total_blocks} blocks of {self.kv_cache_manager.block_size}); "
                    "the engine must reject it at admission"
                )
            self._preempt(victim, step)
            if victim is request:
                return None

    def _preempt(self, request: Request, step: StepBuilder) -> None:
        self.kv_cache_manager.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        step.preempted_req_ids.add(request.request_id)

    def _schedule_waiting(self, step: StepBuilder) -> None:
        kv = self.kv_cache_manager
        while self.waiting and step.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: resume once it has landed
            # The hit is not in request.num_computed_tokens until the allocation succeeds.
            computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = self._num_new_tokens(request, num_hit_tokens, step.token_budget)
            if num_new > step.token_budget:  # chunking off: the whole prefill must fit
                break
            # a draft model writes its KV from the prefill's sampled token on: lookahead
            lookahead = min(self.num_lookahead_tokens,
                            self.max_model_len - num_hit_tokens - num_new)
            new_block_ids = kv.allocate_slots(request, num_new + lookahead, computed_blocks)
            if new_block_ids is None:
                if not self.running:
                    raise RuntimeError(
                        f"request {request.request_id!r} alone does not fit the KV cache; "
                        "the engine must reject it at admission"
                    )
                break  # FCFS: no overtaking, and waiting requests never preempt
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            request.times.mark_scheduled()
            self.running.append(request)
            step.add_new(request, num_new)
            self._assume_drafts(request, step)

    # ---- recovery ----------------------------------------------------------------------

    def recover_from_failed_step(self) -> int:
        """After an exception anywhere in a step (or in a step still in flight under async
        scheduling): drop every in-flight step, preempt every running request (blocks
        freed, recomputed from its confirmed tokens when next scheduled, ahead of the
        requests that were waiting) and empty the prefix cache, whose blocks this step
        registered before its forward wrote them. The runner must forget every request
        too (its reset_request_states()). Returns the number of requests requeued."""
        for record in self._in_flight.values():
            self._unreported.extend(record.unreported)
            self._unreported.extend(record.finished)
            for request in record.sampling:  # finished ones too: nothing is in flight now
                request.num_output_placeholders = 0
        self._in_flight.clear()
        requeued = len(self.running)
        for request in reversed(self.running):
            self.kv_cache_manager.free(request)
            request.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(request)
        self.running = []
        for request in self.waiting:
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0  # in-flight tokens are dropped, not awaited
            request.spec_token_ids = []
        self.kv_cache_manager.reset_prefix_cache()
        # The runner forgets every request, so there is nothing left to tell it.
        self.finished_req_ids = set()
        return requeued

    # ---- update ----------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        record = self._in_flight.get(id(scheduler_output))
        if record is None or record.scheduler_output is not scheduler_output:
            raise ValueError("update_from_output got a SchedulerOutput this scheduler did not issue")
        updates = [RequestUpdate(r, [], None, True) for r in record.unreported]
        for request, n in record.sampling.items():
            request.num_output_placeholders -= n
        record_prompt_logprobs(record.scheduled, runner_output.prompt_logprobs)
        for req_id, request in record.scheduled.items():
            # Identity, not id: the id may belong to a resubmitted request by now. A
            # request finished or aborted since schedule() ignores its late output; one
            # preempted since (async scheduling only) keeps it, see the module doc.
            if request.status not in (RequestStatus.RUNNING, RequestStatus.PREEMPTED):
                continue
            index = runner_output.req_id_to_index.get(req_id)
            if index is None:
                continue
            update = self._apply_sampled(request, runner_output, index, record)
            if update is not None:
                updates.append(update)
        # Popped only now: a record still in flight when a step fails tells the recovery
        # which finishes it must report again.
        del self._in_flight[id(scheduler_output)]
        return updates

    def _apply_sampled(
        self, request: Request, runner_output: ModelRunnerOutput, index: int,
        record: InFlightStep,
    ) -> RequestUpdate | None:
        if request.pooling_params is not None:
            return self._apply_pooled(request, runner_output, index, record)
        sampled = runner_output.sampled_token_ids[index]
        if not sampled:  # a partial prefill chunk: nothing to sample from yet
            return None
        drafts = record.scheduler_output.scheduled_spec_decode_tokens.get(request.request_id)
        if drafts:
            num_accepted = len(sampled) - 1
            # The rejected drafts' KV is garbage: recompute from the first of them (the
            # slots stay allocated and are overwritten). A request preempted since (async)
            # recomputes everything anyway.
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens -= len(drafts) - num_accepted
            request.spec_decode_stats.record(len(drafts), num_accepted)
        request.times.mark_token()
        new_token_ids, status = append_until_stop(request, sampled, self.max_model_len)
        if status is not None:
            self._finish_on_update(request, status, record)
        if (runner_output.draft_token_ids is not None and not request.is_finished
                and not self.assume_drafts):
            request.spec_token_ids = list(runner_output.draft_token_ids[index])
        logprobs = runner_output.logprobs[index] if runner_output.logprobs else None
        new_logprobs = None
        if logprobs is not None:
            new_logprobs = [make_position_logprobs(
                logprobs.token_ids, logprobs.logprobs, logprobs.rank, self.decode_token)]
            request.logprobs.extend(new_logprobs)
            request.cumulative_logprob += logprobs.logprobs[0]
        return RequestUpdate(request, new_token_ids, new_logprobs, request.is_finished)

    def _apply_pooled(self, request: Request, runner_output: ModelRunnerOutput, index: int,
                      record: InFlightStep) -> RequestUpdate | None:
        """A pooling request finishes with the step that pooled its last prompt chunk."""
        pooled = runner_output.pooler_output[index] if runner_output.pooler_output else None
        if pooled is None:  # a partial chunk
            return None
        request.pooler_output = pooled
        self._finish_on_update(request, RequestStatus.FINISHED_STOPPED, record)
        return RequestUpdate(request, [], None, True)

    def _finish_on_update(self, request: Request, status: RequestStatus,
                          record: InFlightStep) -> None:
        """A request that its step's output finished: out of its queue (a request
        preempted while the output was in flight waits in `waiting`), then finished."""
        if request.status == RequestStatus.PREEMPTED:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        self._finish(request, status)
        record.finished.append(request)
