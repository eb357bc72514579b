"""The scheduler's view of one request: its tokens, progress, blocks and fate.

A `Request` object is one submission. An id resubmitted after an abort or a finish is a
new object, so everything keyed by object identity (the scheduler's in-flight records,
the block manager's bookkeeping) can never confuse the two.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from shared.contract.outputs import PositionLogprobs, SpecDecodeStats
from shared.contract.sampling_params import SamplingParams
from shared.serving.prompt_logprobs import PromptLogprobsStore


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue, blocks freed, will recompute
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_index: int,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_index = arrival_index  # FCFS rank; kept for logs and tie-breaks

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        # prompt + outputs kept as one list so that hashing blocks and building a
        # resumed request's prefill never concatenate.
        self._all_token_ids = list(self.prompt_token_ids)
        # Tokens whose KV is (or is being, this step) written to the cache. Advanced by
        # the scheduler when it schedules them (vLLM's convention), reset on preemption.
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled whose values have not reached the host yet:
        # nonzero only between schedule() and update_from_output(), so under async
        # scheduling (where the next schedule() comes first) the scheduler counts them
        # as tokens to compute. The runner reads their values on the device.
        self.num_output_placeholders = 0
        self.block_ids: list[int] = []  # owned by the KV cache manager
        # Chained hashes of this request's FULL blocks, filled lazily by the KV cache
        # manager. Tokens are append-only, so a hash, once computed, stays valid.
        self.block_hashes: list[bytes] = []
        # One dict (token id -> logprob) per output token, when logprobs were requested;
        # kept across preemption like the output tokens themselves.
        self.logprobs: list[PositionLogprobs] = []
        self.cumulative_logprob = 0.0  # of the sampled tokens, when logprobs were requested
        # Set by the engine for requests with stop strings (shared/serving/detokenizer.py):
        # the scheduler feeds it every output token and stops on a match.
        self.detokenizer: Any = None
        # output_kind DELTA: what the outputs returned so far have carried (the engine's)
        self.output_delta: Any = None
        # With SamplingParams.prompt_logprobs: one slot per prompt position.
        self.prompt_logprobs = (None if sampling_params.prompt_logprobs is None
                                else PromptLogprobsStore(len(self.prompt_token_ids)))
        self.stop_reason: int | None = None
        # Speculative decoding: the drafts the runner proposed for the next step (-1
        # entries: values on the device), consumed when scheduled; and the counters.
        self.spec_token_ids: list[int] = []
        # Pooling (a pooling engine): the request runs its prompt and finishes with the
        # pooler's output; sampling_params is then a placeholder the runners carry along.
        self.pooling_params: Any = None
        self.pooler_output: Any = None
        self.spec_decode_stats = SpecDecodeStats()
        self.times = RequestTimes(arrival_time=time.time())

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs. The live list: read it, never mutate it."""
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)


@dataclass
class RequestTimes:
    """When a request reached each point of its life (time.time() seconds, vLLM's
    RequestOutput.metrics): set once each, by the engine (arrival) and the scheduler."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def mark_scheduled(self) -> None:
        if self.first_scheduled_time is None:  # a preempted request keeps its first
            self.first_scheduled_time = time.time()

    def mark_token(self) -> None:
        self.last_token_time = time.time()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time

    def as_dict(self) -> dict[str, float]:
        """The times set so far. Built for every output of every step when streaming, so
        spelled out rather than walked with vars()."""
        out = {"arrival_time": self.arrival_time}
        if self.first_scheduled_time is not None:
            out["first_scheduled_time"] = self.first_scheduled_time
            out["time_in_queue"] = self.first_scheduled_time - self.arrival_time
        if self.first_token_time is not None:
            out["first_token_time"] = self.first_token_time
            out["last_token_time"] = self.last_token_time  # type: ignore[assignment]
        if self.finished_time is not None:
            out["finished_time"] = self.finished_time
        return out


@dataclass
class RequestUpdate:
    """What one step did to one request, for the engine to turn into a RequestOutput."""

    request: Request
    new_token_ids: list[int]
    # one dict (token id -> Logprob) per new token, when logprobs were requested
    new_logprobs: list[PositionLogprobs] | None
    finished: bool
