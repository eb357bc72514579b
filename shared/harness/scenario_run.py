"""Playing a scenario (shared/harness/scenarios.py) on an LLMEngine and recording what
happened: per request label the tokens, logprobs and finish reason, and per step a
summary of the SchedulerOutput (taken by wrapping the scheduler's schedule(), so the
engine needs no hook), from which the scenario's expected events are counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.harness.scenarios import EVENTS, Abort, Add, Drain, Scenario, Step, label_of

# ---------------------------------------------------------------- results


@dataclass
class RequestRecord:
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # None: still running (or an HF reference record)


@dataclass(frozen=True)
class StepEvent:
    """One SchedulerOutput, summarised."""

    num_reqs: int
    num_tokens: int
    num_new: int
    finished: tuple[str, ...]
    preempted: tuple[str, ...]
    resumed: int  # new requests whose prefill carries generated tokens
    prefix_hits: int  # new requests starting with num_computed_tokens > 0
    partial_prefills: int  # requests whose chunk ends before their prefill does
    decodes: int  # requests past their prefill
    resubmitted: int  # ids both finished and scheduled new in this step


@dataclass
class ScenarioRun:
    requests: dict[str, RequestRecord]
    steps: list[StepEvent]
    num_free_blocks: int
    num_total_blocks: int

    def events(self) -> dict[str, int]:
        """Counts of EVENTS over the run's steps."""
        counts = dict.fromkeys(EVENTS, 0)
        previous: StepEvent | None = None
        for i, s in enumerate(self.steps):
            counts["preemption"] += bool(s.preempted)
            counts["resume"] += s.resumed
            counts["prefix_hit"] += s.prefix_hits
            counts["chunked_prefill_with_decode"] += bool(s.partial_prefills and s.decodes)
            # Only one followed by real work counts: every drain ends with a zero-token
            # step that hands the last finishes to the runner.
            counts["zero_token_step"] += (
                s.num_tokens == 0 and bool(s.finished)
                and any(later.num_tokens > 0 for later in self.steps[i + 1:])
            )
            counts["resubmit_same_step"] += s.resubmitted
            counts["finish_and_add_same_step"] += bool(s.finished and s.num_new > s.resubmitted)
            # every row past its prefill: one token each, or 1 + k with drafts
            uniform_decode = s.num_tokens > 0 and s.decodes == s.num_reqs
            counts["decode_batch_shrink"] += bool(
                uniform_decode and previous is not None and s.num_reqs < previous.num_reqs
            )
            if s.num_tokens > 0:
                previous = s
        counts["stop_token"] = sum(r.finish_reason == "stop" for r in self.requests.values())
        return counts

    def missing_events(self, expects: tuple[str, ...]) -> list[str]:
        counts = self.events()
        return [e for e in expects if counts[e] == 0]


# ---------------------------------------------------------------- running a script


class _ScheduleRecorder:
    """Wraps one scheduler's schedule() to summarise every SchedulerOutput it issues."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.steps: list[StepEvent] = []
        self._prefill_len: dict[str, int] = {}
        self._schedule = scheduler.schedule
        scheduler.schedule = self._record  # instance attribute shadows the method

    def detach(self) -> None:
        del self.scheduler.schedule

    def _record(self):
        so = self._schedule()
        new_ids = set()
        computed_before: dict[str, int] = {}
        resumed = hits = 0
        for new in so.scheduled_new_reqs:
            self._prefill_len[new.req_id] = new.prefill_len
            computed_before[new.req_id] = new.num_computed_tokens
            new_ids.add(new.req_id)
            resumed += new.prefill_len > new.prompt_len
            hits += new.num_computed_tokens > 0
        cached = so.scheduled_cached_reqs
        computed_before.update(zip(cached.req_ids, cached.num_computed_tokens))
        partial = decodes = 0
        for req_id, n in so.num_scheduled_tokens.items():
            prefill_len = self._prefill_len[req_id]
            partial += computed_before[req_id] + n < prefill_len
            decodes += computed_before[req_id] >= prefill_len
        self.steps.append(StepEvent(
            num_reqs=so.num_reqs, num_tokens=so.total_num_scheduled_tokens,
            num_new=len(new_ids), finished=tuple(sorted(so.finished_req_ids)),
            preempted=tuple(sorted(so.preempted_req_ids)), resumed=resumed, prefix_hits=hits,
            partial_prefills=partial, decodes=decodes,
            resubmitted=len(new_ids & so.finished_req_ids),
        ))
        return so


class _OutputTracker:
    """Routes cumulative RequestOutputs to labels. An abort is reported one step later,
    possibly beside the output of a resubmitted request with the same id: an output
    with finish_reason "abort" goes to the submission that was aborted."""

    def __init__(self) -> None:
        self.records: dict[str, RequestRecord] = {}
        self._submissions: dict[str, int] = {}
        self._current: dict[str, str] = {}
        self._aborting: dict[str, list[str]] = {}

    def added(self, request_id: str) -> None:
        self._submissions[request_id] = self._submissions.get(request_id, 0) + 1
        label = label_of(request_id, self._submissions[request_id])
        self._current[request_id] = label
        self.records[label] = RequestRecord([], None, None)

    def aborted(self, request_ids: tuple[str, ...]) -> None:
        for req_id in request_ids:
            label = self._current.get(req_id)
            if label is not None and self.records[label].finish_reason is None:
                self._aborting.setdefault(req_id, []).append(label)

    def consume(self, outputs: list) -> None:
        for out in outputs:
            c = out.outputs[0]
            pending = self._aborting.get(out.request_id)
            if c.finish_reason == "abort" and pending:
                label = pending.pop(0)
            else:
                label = self._current[out.request_id]
            logprobs = None if c.logprobs is None else [
                {t: lp.logprob for t, lp in d.items()} for d in c.logprobs]
            self.records[label] = RequestRecord(list(c.token_ids), logprobs, c.finish_reason)


def _has_work(engine: Any) -> bool:
    return engine.has_unfinished_requests() or engine.scheduler.has_finished_requests()


def run_scenario(engine: Any, scenario: Scenario) -> ScenarioRun:
    """Play the scenario's actions on `engine` (built with scenario.engine_kwargs()),
    then drain it. The engine should be fresh: request ids must not be live."""
    tracker = _OutputTracker()
    recorder = _ScheduleRecorder(engine.scheduler)
    try:
        for action in [*scenario.actions, Drain()]:
            if isinstance(action, Add):
                engine.add_request(action.request_id, list(action.prompt_token_ids), action.params)
                tracker.added(action.request_id)
            elif isinstance(action, Abort):
                engine.abort_request(list(action.request_ids))
                tracker.aborted(action.request_ids)
            elif isinstance(action, Step):
                for _ in range(action.count):
                    tracker.consume(engine.step())
            else:
                _drain(engine, tracker, action.max_steps, scenario.name)
    finally:
        recorder.detach()
    return ScenarioRun(tracker.records, recorder.steps, engine.num_free_kv_blocks(),
                       engine.num_total_kv_blocks())


def _drain(engine: Any, tracker: _OutputTracker, max_steps: int, name: str) -> None:
    for _ in range(max_steps):
        if not _has_work(engine):
            return
        tracker.consume(engine.step())
    raise RuntimeError(f"scenario {name!r}: the engine still has work after {max_steps} steps")


def run_solo(engine: Any, scenario: Scenario) -> ScenarioRun:
    """Each submission alone, one after another, on `engine` (scenario.solo_engine_kwargs()),
    to its natural end (an aborted one runs to its max_tokens: compare the prefix)."""
    tracker = _OutputTracker()
    recorder = _ScheduleRecorder(engine.scheduler)
    try:
        for label, add in scenario.labelled_adds().items():
            engine.add_request(label, list(add.prompt_token_ids), add.params)
            tracker.added(label)
            _drain(engine, tracker, Drain().max_steps, scenario.name)
    finally:
        recorder.detach()
    return ScenarioRun(tracker.records, recorder.steps, engine.num_free_kv_blocks(),
                       engine.num_total_kv_blocks())

