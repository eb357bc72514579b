"""Test doubles for the scheduler: a fake model runner and a plain-Python output oracle.

The fake runner keeps what a real runner keeps per request (tokens, num_computed_tokens,
block table), checks the step contract against it, and "writes" a fake KV cache that stores
the token id held at each slot. Before a request's tokens are "attended", every slot of its
context must hold the right token: that catches a wrong prefix-cache hit, a block shared by
two requests that write different tokens, and a block reused while still in use.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from shared.contract.sampling_params import SamplingParams
from shared.contract.step import ModelRunnerOutput, SchedulerOutput
from shared.serving.scheduler import Scheduler

TokenFn = Callable[[list[int], int], int]  # (all tokens so far, prompt_len) -> next token


def hash_token_fn(vocab_size: int = 8) -> TokenFn:
    """Next token as a pure function of the sequence: identical with or without preemption."""

    def token_fn(tokens: list[int], prompt_len: int) -> int:
        digest = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=4).digest()
        return int.from_bytes(digest, "little") % vocab_size

    return token_fn


def script_token_fn(script: list[int]) -> TokenFn:
    """The k-th output is script[k] (the last entry repeats)."""

    def token_fn(tokens: list[int], prompt_len: int) -> int:
        k = len(tokens) - prompt_len
        return script[min(k, len(script) - 1)]

    return token_fn


@dataclass
class _RunnerState:
    tokens: list[int]
    prompt_len: int
    num_computed_tokens: int
    block_ids: list[int]


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, token_fn: TokenFn):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.token_fn = token_fn
        self.kv: list[int | None] = [None] * (num_blocks * block_size)
        self.states: dict[str, _RunnerState] = {}

    def _slot(self, st: _RunnerState, pos: int) -> int:
        return st.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)  # may never have reached the runner
        for req_id in so.preempted_req_ids:
            assert req_id in self.states, f"preempted {req_id} unknown to the runner"
            del self.states[req_id]
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} added twice"
            assert new.prompt_len <= new.prefill_len
            self.states[new.req_id] = _RunnerState(
                list(new.prompt_token_ids), new.prompt_len, new.num_computed_tokens,
                list(new.block_ids),
            )
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            st = self.states[req_id]
            assert st.num_computed_tokens == num_computed, (req_id, st.num_computed_tokens, num_computed)
            st.block_ids.extend(new_blocks)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        # Every layer writes the whole batch's K/V before attention reads any of it.
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.states[req_id]
            end = st.num_computed_tokens + n
            assert 0 < n and end <= len(st.tokens), (req_id, n, st)
            assert end <= self.max_model_len
            assert len(st.block_ids) * self.block_size >= end
            for pos in range(st.num_computed_tokens, end):
                self.kv[self._slot(st, pos)] = st.tokens[pos]
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.states[req_id]
            st.num_computed_tokens += n
            for pos in range(st.num_computed_tokens):
                assert self.kv[self._slot(st, pos)] == st.tokens[pos], (req_id, pos)
            req_ids.append(req_id)
            if st.num_computed_tokens == len(st.tokens):
                token = self.token_fn(st.tokens, st.prompt_len)
                st.tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])  # a partial prefill chunk samples nothing
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )


class FakeRunnerFault(Exception):
    """An exception injected into a step (tests of the scheduler's recovery)."""


def execute_partially(runner: FakeRunner, so: SchedulerOutput, num_reqs_written: int) -> None:
    """A forward that fails after writing the K/V of only the first `num_reqs_written`
    scheduled requests: the rest of the step's blocks hold no (or stale) tokens."""
    runner._update_states(so)
    for req_id, n in list(so.num_scheduled_tokens.items())[:num_reqs_written]:
        st = runner.states[req_id]
        for pos in range(st.num_computed_tokens, st.num_computed_tokens + n):
            runner.kv[runner._slot(st, pos)] = st.tokens[pos]
    raise FakeRunnerFault("inside execute")


def reset_runner(runner: FakeRunner) -> None:
    """The runners' reset_request_states(): forget every request, keep the KV memory."""
    runner.states.clear()


def run_step(sched: Scheduler, runner: FakeRunner):
    so = sched.schedule()
    out = runner.execute(so)
    return so, sched.update_from_output(so, out)


def expected_output(
    prompt: list[int],
    params: SamplingParams,
    eos_token_id: int | None,
    max_model_len: int,
    token_fn: TokenFn,
) -> tuple[list[int], str, int | None]:
    """(outputs, finish_reason, stop_reason) of an uninterrupted run: the oracle."""
    tokens, outputs = list(prompt), []
    while True:
        token = token_fn(tokens, len(prompt))
        tokens.append(token)
        outputs.append(token)
        if len(tokens) >= max_model_len:
            return outputs, "length", None
        # The k-th output (k = len(outputs) - 1) may stop only when k >= min_tokens.
        if len(outputs) > params.min_tokens:
            if not params.ignore_eos and eos_token_id is not None and token == eos_token_id:
                return outputs, "stop", None
            if token in params.stop_token_ids:
                return outputs, "stop", token
        if len(outputs) >= params.max_tokens:
            return outputs, "length", None
