"""Random add / step / abort / resubmit sequences against a plain-Python model.

The model checks, after every rule: ref counts equal live owners (a block held by two
live requests must be a cached full prefix block at the same index in both), free + used
== total, waiting requests hold no blocks, num_computed_tokens <= num_tokens, each step's
token budget and max_num_seqs; the fake runner's KV check proves no block is overwritten
while in use and every prefix hit holds the right tokens. Every request that stops or runs
out of length must produce exactly the oracle's tokens (preempted or not), every abort is
reported once, and when everything has ended every block is free.

AsyncSchedulerMachine plays the same rules with async scheduling: each step schedules
and executes step N+1 before the update of step N, so requests carry in-flight
placeholders; the same oracle must hold.

A failed step (an exception after schedule(), inside the forward after some requests'
K/V were written, or part-way through or after an update) is followed by the engine's
recovery (Scheduler.recover_from_failed_step and the runner's reset); the same oracle and
invariants must hold afterwards, with every finish reported exactly once.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shared.contract.sampling_params import SamplingParams
from shared.serving.request import Request, RequestStatus
from shared.serving.scheduler import Scheduler
from tests.shared.serving.scheduler_fakes import (
    FakeRunner,
    FakeRunnerFault,
    execute_partially,
    expected_output,
    hash_token_fn,
    reset_runner,
)

IDS = ["a", "b", "c", "d", "e"]
VOCAB = 8
EOS = 3
# Shared prefixes so that prefix-cache hits happen often.
PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]

request_specs = st.fixed_dictionaries({
    "prefix": st.sampled_from(PREFIXES + [[]]),
    "prefix_len": st.integers(0, 10),
    "tail": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
    "max_tokens": st.integers(1, 12),
    "min_tokens": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=2),
    "eos": st.sampled_from([EOS, None]),
})


SETUP = dict(
    block_size=st.sampled_from([2, 4]),
    extra_blocks=st.integers(0, 2),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 4),
    prefix_caching=st.booleans(),
    chunked=st.booleans(),
)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(**SETUP)
    def setup(self, block_size, extra_blocks, budget, max_num_seqs, prefix_caching, chunked):
        self._setup(block_size, extra_blocks, budget, max_num_seqs, prefix_caching, chunked)

    def _setup(self, block_size, extra_blocks, budget, max_num_seqs, prefix_caching, chunked,
               async_scheduling=False):
        self.max_model_len = 24
        # Any single request fits the pool alone (the engine's admission rule).
        num_blocks = self.max_model_len // block_size + extra_blocks
        if not chunked:
            budget = max(budget, self.max_model_len)
        self.budget, self.max_num_seqs = budget, max_num_seqs
        self.sched = Scheduler(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
            max_model_len=self.max_model_len, num_blocks=num_blocks, block_size=block_size,
            enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked,
            async_scheduling=async_scheduling,
        )
        self.pending = None  # async scheduling: the step executed but not yet updated
        self.runner = FakeRunner(num_blocks, block_size, self.max_model_len, hash_token_fn(VOCAB))
        self.arrivals = 0
        self.reported: dict[Request, list[int]] = {}  # tokens seen through RequestUpdates
        self.finish_reported: set[Request] = set()
        self.aborted: set[Request] = set()

    # ---- rules -------------------------------------------------------------------------

    def _make_request(self, req_id: str, spec: dict) -> Request:
        prompt = (spec["prefix"][: spec["prefix_len"]] + spec["tail"])[: self.max_model_len - 1]
        params = SamplingParams(
            max_tokens=spec["max_tokens"], min_tokens=min(spec["min_tokens"], spec["max_tokens"]),
            ignore_eos=spec["ignore_eos"], stop_token_ids=spec["stop_token_ids"],
        )
        self.arrivals += 1
        return Request(req_id, prompt, params, spec["eos"], self.arrivals)

    @rule(req_id=st.sampled_from(IDS), spec=request_specs)
    def add(self, req_id, spec):
        request = self._make_request(req_id, spec)
        if req_id in self.sched.requests:
            try:
                self.sched.add_request(request)
            except ValueError as e:
                assert repr(req_id) in str(e)
                return
            raise AssertionError("duplicate live id accepted")
        self.sched.add_request(request)
        self.reported[request] = []

    @rule(req_ids=st.lists(st.sampled_from(IDS + ["zz"]), max_size=2))
    def abort(self, req_ids):
        expected = [self.sched.requests[r] for r in dict.fromkeys(req_ids) if r in self.sched.requests]
        assert self.sched.abort_requests(req_ids) == expected
        for request in expected:
            assert request.finish_reason == "abort" and not request.block_ids
            self.aborted.add(request)

    @rule(req_id=st.sampled_from(IDS), spec=request_specs)
    def abort_and_resubmit(self, req_id, spec):
        self.abort([req_id])
        self.add(req_id, spec)

    @precondition(lambda self: self._has_work())
    @rule()
    def step(self):
        self._step()

    @precondition(lambda self: self.sched.has_unfinished_requests())
    @rule(req_id=st.sampled_from(IDS), resubmit=st.none() | request_specs)
    def step_with_abort_in_flight(self, req_id, resubmit):
        # An abort (and maybe a resubmit of the id) lands between execute and update.
        self._step(lambda: self.abort_and_resubmit(req_id, resubmit) if resubmit
                   else self.abort([req_id]))

    @precondition(lambda self: self._has_work())
    @rule(where=st.sampled_from(["after_schedule", "inside_execute", "inside_update"]),
          k=st.integers(0, 3))
    def failed_step(self, where, k):
        so = self.sched.schedule()
        self._check_step(so)
        try:
            if where == "after_schedule":
                raise FakeRunnerFault(where)
            if where == "inside_execute":
                execute_partially(self.runner, so, k)
            out = self.runner.execute(so)
            # async: the engine updates the step in flight (if any) after launching this one
            target = self.pending if self.sched.async_scheduling and self.pending else (so, out)
            self._update_failing_at(*target, k)
        except FakeRunnerFault:
            event(f"failed step: {where}")
        self.pending = None
        self.sched.recover_from_failed_step()
        reset_runner(self.runner)

    def _update_failing_at(self, so, out, k):
        """The update raises at its k-th request (or, when it has fewer, after returning).
        Tokens an interrupted update appended reach the engine's caller anyway (a
        RequestOutput carries every token so far), so they count as seen; its finishes are
        reported again by the recovery, so they are not marked here."""
        original, applied = self.sched._apply_sampled, []

        def apply(request, runner_output, index, record):
            if len(applied) == k:
                raise FakeRunnerFault("inside update")
            update = original(request, runner_output, index, record)
            applied.append(update)
            return update

        self.sched._apply_sampled = apply
        try:
            updates = self.sched.update_from_output(so, out)
        except FakeRunnerFault:
            for update in applied:
                if update is not None:
                    self.reported[update.request].extend(update.new_token_ids)
            raise
        finally:
            del self.sched._apply_sampled
        for update in updates:  # it completed: delivered as usual, then the step fails
            self._check_update(update)
        raise FakeRunnerFault("after update")

    def _has_work(self) -> bool:
        sched = self.sched
        return (sched.has_unfinished_requests() or sched.has_finished_requests()
                or self.pending is not None)

    def _step(self, between=None):
        so = self.sched.schedule()
        self._check_step(so)
        out = self.runner.execute(so)
        if between is not None:
            between()
        if not self.sched.async_scheduling:
            self._update(so, out)
            return
        # LLMEngine.step's order: step N+1 is out before step N's tokens are read back,
        # and a zero-token step is settled at once rather than kept in flight.
        pending, self.pending = self.pending, None
        if pending is not None:
            self._update(*pending)
        if so.total_num_scheduled_tokens == 0:
            self._update(so, out)
        else:
            self.pending = (so, out)

    def _update(self, so, out):
        for update in self.sched.update_from_output(so, out):
            self._check_update(update)

    # ---- checks ------------------------------------------------------------------------

    def _check_step(self, so):
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= self.budget
        assert so.num_reqs <= self.max_num_seqs
        new_ids = [n.req_id for n in so.scheduled_new_reqs]
        assert not set(new_ids) & set(so.scheduled_cached_reqs.req_ids)
        assert not set(so.num_scheduled_tokens) & so.preempted_req_ids
        for n in so.scheduled_new_reqs:
            request = self.sched.requests[n.req_id]
            assert n.prompt_token_ids == request.all_token_ids
            assert n.prompt_len == request.num_prompt_tokens
            assert n.num_computed_tokens % self.sched.kv_cache_manager.block_size == 0
        for req_id, n in so.num_scheduled_tokens.items():
            # num_computed_tokens was advanced by schedule(); a decode (1 token left) gets 1.
            request = self.sched.requests[req_id]
            before = request.num_computed_tokens - n
            # In flight (async): the runner knows those tokens; the fake runner checks
            # exactly that every scheduled position holds a token it knows.
            known = request.num_tokens + (
                request.num_output_placeholders if self.sched.async_scheduling else 0)
            assert 0 < n <= known - before
            assert request.num_computed_tokens <= self.max_model_len
            if before > 0 and req_id not in new_ids and n < request.num_tokens - before:
                event("partial chunk continued")
            if n < request.num_tokens - before:
                event("partial prefill chunk")
        if so.preempted_req_ids:
            event("preemption")
            if any(self.sched.requests[r].num_output_placeholders for r in so.preempted_req_ids):
                event("preempted with a token in flight")
        # At most one step in flight plus the one just scheduled (0 without async).
        limit = 2 if self.sched.async_scheduling else 1
        assert all(r.num_output_placeholders <= limit for r in self.sched.requests.values())
        if any(n.num_computed_tokens > 0 for n in so.scheduled_new_reqs):
            event("prefix-cache hit")
        if any(n.prompt_len < n.prefill_len for n in so.scheduled_new_reqs):
            event("resumed after preemption")
        if set(new_ids) & so.finished_req_ids:
            event("finished and new in one step")
        if so.total_num_scheduled_tokens == 0:
            event("zero-token step")

    def _check_update(self, update):
        request = update.request
        assert request not in self.finish_reported, "reported after its finish"
        self.reported[request].extend(update.new_token_ids)
        if request in self.aborted:
            assert update.finished and update.new_token_ids == []
        assert update.finished == request.is_finished
        if update.finished:
            self.finish_reported.add(request)
        if request.finish_reason in ("stop", "length"):
            self._check_oracle(request)

    def _check_oracle(self, request):
        outputs, reason, stop_reason = expected_output(
            request.prompt_token_ids, request.sampling_params, request.eos_token_id,
            self.max_model_len, self.runner.token_fn,
        )
        assert request.output_token_ids == outputs
        assert (request.finish_reason, request.stop_reason) == (reason, stop_reason)
        assert self.reported[request] == outputs

    @invariant()
    def blocks_are_consistent(self):
        if not hasattr(self, "sched"):
            return
        kv, sched = self.sched.kv_cache_manager, self.sched
        owners: dict[int, list[tuple[Request, int]]] = {}
        for request in sched.requests.values():
            assert request.num_computed_tokens <= (
                request.num_tokens + request.num_output_placeholders)
            # between steps: only the step in flight (async) holds placeholders
            assert 0 <= request.num_output_placeholders <= (self.pending is not None)
            if request.status != RequestStatus.RUNNING:
                assert request.block_ids == [] and request.num_computed_tokens == 0
            assert len(request.block_ids) * kv.block_size >= request.num_computed_tokens
            assert len(set(request.block_ids)) == len(request.block_ids)
            for i, b in enumerate(request.block_ids):
                owners.setdefault(b, []).append((request, i))
        for block in kv.blocks:
            users = owners.get(block.block_id, [])
            assert block.ref_cnt == len(users)
            assert (block.ref_cnt == 0) == (block.block_id in kv.free_queue)
            if len(users) > 1:  # a shared block is a cached full block of the same prefix
                assert block.block_hash is not None
                for request, i in users:
                    assert request.block_hashes[i] == block.block_hash
        assert kv.num_free_blocks + len(owners) == kv.num_total_blocks
        assert set(sched.requests.values()) == set(sched.waiting) | set(sched.running)
        assert len(sched.running) <= self.max_num_seqs
        if not sched.requests:
            assert kv.num_free_blocks == kv.num_total_blocks

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(1000):
            if not self._has_work():
                break
            self._step()
        else:
            raise AssertionError("requests never finished")
        assert self.sched.num_free_blocks == self.sched.num_total_blocks
        assert not self.runner.states  # the runner was told about every finish
        assert set(self.reported) == self.finish_reported  # every request reported its end
        assert all(r.num_output_placeholders == 0 for r in self.reported)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerMachine = SchedulerMachine.TestCase


class AsyncSchedulerMachine(SchedulerMachine):
    @initialize(**SETUP)
    def setup(self, block_size, extra_blocks, budget, max_num_seqs, prefix_caching, chunked):
        self._setup(block_size, extra_blocks, budget, max_num_seqs, prefix_caching, chunked,
                    async_scheduling=True)


AsyncSchedulerMachine.TestCase.settings = SchedulerMachine.TestCase.settings
TestAsyncSchedulerMachine = AsyncSchedulerMachine.TestCase
