"""The differential scenario library (DESIGN.md §9).

A scenario is a small deterministic script over an LLMEngine: its own engine settings
(a tiny KV pool to force preemption, a small token budget to force chunked prefill,
prefix caching with shared prefixes, ...) and a list of actions — add, abort, step,
drain. shared/harness/scenario_run.py plays it and records, per request label, the token
ids, per-token logprobs (when requested) and the finish reason, and per step a summary
of the SchedulerOutput, from which the scenario's `expects` (preemption happened, a
prefix was hit, ...) are checked: a scenario that no longer exercises its hard case
would otherwise pass vacuously.

Labels: a request id's first submission is labelled by the id, its k-th submission
`<id>#k` (an id can be aborted and resubmitted; the two are distinct requests).

Every random request carries an explicit seed: its tokens are then a pure function of
(seed, position, logits), the same alone, in any batch and across preemption, which is
what the solo reference checks.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.contract.sampling_params import SamplingParams


@dataclass(frozen=True)
class Add:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Step:
    count: int = 1


@dataclass(frozen=True)
class Drain:
    """Step until nothing is unfinished and every finish was handed to the runner."""

    max_steps: int = 200


Action = Add | Abort | Step | Drain

# Small engines by default: short steps, and dense V1 tables / V2 state rows stay tiny.
BASE_ENGINE: dict[str, Any] = dict(
    max_model_len=64, block_size=8, max_num_seqs=8, max_num_batched_tokens=64,
    num_gpu_blocks_override=64, enable_prefix_caching=False,
)
# Scenario events (see StepEvent) a scenario may require.
EVENTS = (
    "preemption", "resume", "prefix_hit", "chunked_prefill_with_decode", "zero_token_step",
    "resubmit_same_step", "finish_and_add_same_step", "decode_batch_shrink",
    "stop_token",  # a request finished on one of its stop_token_ids (from the records)
)


@dataclass
class Scenario:
    name: str
    summary: str
    actions: list[Action]
    engine_overrides: dict[str, Any] = field(default_factory=dict)
    greedy: bool = True  # every request is greedy: the HF comparison applies
    seeded: bool = False  # some requests sample with a seed
    solo: bool = True  # each request's tokens in the batch must equal its solo run
    expects: tuple[str, ...] = ()  # EVENTS that must occur

    def engine_kwargs(self) -> dict[str, Any]:
        return {**BASE_ENGINE, **self.engine_overrides}

    def solo_engine_kwargs(self) -> dict[str, Any]:
        # A roomy engine (no preemption, no chunking) with the same length limit.
        return {**BASE_ENGINE, "max_model_len": self.engine_kwargs()["max_model_len"]}

    def labelled_adds(self) -> dict[str, Add]:
        out: dict[str, Add] = {}
        seen: dict[str, int] = {}
        for action in self.actions:
            if isinstance(action, Add):
                seen[action.request_id] = seen.get(action.request_id, 0) + 1
                out[label_of(action.request_id, seen[action.request_id])] = action
        return out


def label_of(request_id: str, submission: int) -> str:
    return request_id if submission == 1 else f"{request_id}#{submission}"


# ---------------------------------------------------------------- building blocks


def _prompt(rng: random.Random, vocab: int, n: int) -> tuple[int, ...]:
    # ids 0..2 are BOS / EOS / padding in the presets: prompts stay clear of them
    return tuple(rng.randrange(3, vocab) for _ in range(n))


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _seeded(rng: random.Random, max_tokens: int, temperature: float = 0.8, **kw: Any):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                          seed=rng.randrange(2**31), **kw)


def _adds(rng: random.Random, vocab: int, specs: list[tuple[str, int, SamplingParams]]):
    return [Add(rid, _prompt(rng, vocab, n), sp) for rid, n, sp in specs]


# Prompts of 9-11 tokens fill 9 of these 10 blocks of 4; after a few decode steps the
# newest running request (the third) is preempted with ~3 outputs and resumes, by
# recompute, once the first finishes, with several tokens (and its min_tokens window)
# still to go.
TINY_KV_POOL: dict[str, Any] = dict(
    block_size=4, max_model_len=32, num_gpu_blocks_override=10, max_num_batched_tokens=32,
    max_num_seqs=4,
)


# ---------------------------------------------------------------- the scenarios


def greedy_logprobs(rng: random.Random, vocab: int) -> Scenario:
    actions = _adds(rng, vocab, [
        ("a", 3, _greedy(4, logprobs=0)), ("b", 9, _greedy(5, logprobs=3)),
        ("c", 17, _greedy(4)), ("d", 6, _greedy(5, logprobs=1)),
    ])
    return Scenario("greedy_logprobs", "a batch of prompt lengths, 0/1/3/no logprobs", actions)


def out_of_order_finish(rng: random.Random, vocab: int) -> Scenario:
    first = _adds(rng, vocab, [
        ("a", 5, _greedy(6)), ("b", 8, _greedy(2)), ("c", 6, _greedy(5, logprobs=2)),
        ("d", 7, _greedy(3)),
    ])
    later = _adds(rng, vocab, [("e", 4, _greedy(3)), ("f", 9, _greedy(4))])
    return Scenario(
        "out_of_order_finish", "middle rows finish first; new arrivals fill the holes",
        [*first, Step(3), *later], expects=("finish_and_add_same_step",),
    )


def abort_resubmit(rng: random.Random, vocab: int) -> Scenario:
    first = _adds(rng, vocab, [("a", 6, _greedy(8)), ("b", 9, _greedy(8)), ("c", 5, _greedy(8))])
    b2 = Add("b", _prompt(rng, vocab, 4), _greedy(4, logprobs=3))
    a2 = Add("a", first[0].prompt_token_ids, _greedy(3, logprobs=1))
    return Scenario(
        "abort_resubmit", "abort an id and resubmit it (other params) before the next step",
        [*first, Step(3), Abort(("b",)), b2, Step(2), Abort(("a",)), a2],
        expects=("resubmit_same_step",),
    )


def preemption(rng: random.Random, vocab: int) -> Scenario:
    actions = _adds(rng, vocab, [
        ("a", 9, _greedy(8)), ("b", 10, _greedy(8)), ("c", 11, _greedy(8, logprobs=2)),
    ])
    return Scenario("preemption", "a tiny KV pool: preempt, recompute and resume", actions,
                    engine_overrides=TINY_KV_POOL, expects=("preemption", "resume"))


def chunked_prefill(rng: random.Random, vocab: int) -> Scenario:
    a = _adds(rng, vocab, [("a", 4, _greedy(8))])
    later = _adds(rng, vocab, [("b", 20, _greedy(4, logprobs=1)), ("c", 11, _greedy(3))])
    return Scenario(
        "chunked_prefill", "long prompts chunked by an 8-token budget beside a decode",
        [*a, Step(2), *later], engine_overrides=dict(max_num_batched_tokens=8, max_num_seqs=4),
        expects=("chunked_prefill_with_decode",),
    )


def prefix_cache(rng: random.Random, vocab: int) -> Scenario:
    prefix = _prompt(rng, vocab, 12)  # three full blocks of 4
    a = Add("a", prefix + _prompt(rng, vocab, 3), _greedy(4))
    later = [
        Add("b", prefix + _prompt(rng, vocab, 5), _greedy(4)),
        Add("c", prefix[:8] + _prompt(rng, vocab, 6), _greedy(3)),
        Add("d", a.prompt_token_ids, _greedy(4, logprobs=2)),  # the whole prompt cached
    ]
    return Scenario(
        "prefix_cache", "shared prefixes served from cached blocks",
        [a, Step(2), *later], engine_overrides=dict(enable_prefix_caching=True, block_size=4),
        expects=("prefix_hit",),
    )


def padded_batch(rng: random.Random, vocab: int) -> Scenario:
    lens, max_tokens = [3, 10, 5, 8, 4, 9, 6], [2, 2, 2, 2, 6, 6, 6]
    actions = _adds(rng, vocab, [
        (f"r{i}", n, _greedy(m, logprobs=1 if i == 5 else None))
        for i, (n, m) in enumerate(zip(lens, max_tokens))
    ])
    return Scenario(
        "padded_batch", "7 decodes, then 3 (a padded graph size on GPU): stale rows",
        actions, expects=("decode_batch_shrink",),
    )


def seeded_sampling(rng: random.Random, vocab: int) -> Scenario:
    first = _adds(rng, vocab, [
        ("s1", 5, _seeded(rng, 6, top_p=0.9)), ("s2", 8, _seeded(rng, 6, top_k=20)),
        ("s3", 3, _seeded(rng, 6, temperature=1.0, min_p=0.05)),
        ("s4", 7, _seeded(rng, 6, temperature=0.7, top_k=50, top_p=0.9, min_p=0.02, logprobs=2)),
        ("g1", 6, _greedy(6)),
    ])
    later = _adds(rng, vocab, [("s5", 9, _seeded(rng, 5, temperature=1.2, top_p=0.95))])
    return Scenario(
        "seeded_sampling", "seeded temperature/top-p/top-k/min-p in a mixed batch",
        [*first, Step(2), *later], greedy=False, seeded=True,
    )


def seeded_preemption(rng: random.Random, vocab: int) -> Scenario:
    actions = _adds(rng, vocab, [
        ("a", 9, _seeded(rng, 8, top_p=0.9)), ("b", 10, _seeded(rng, 8, top_k=30)),
        ("c", 11, _seeded(rng, 8, temperature=1.0, min_p=0.05, logprobs=1)),
    ])
    return Scenario(
        "seeded_preemption", "seeded sampling across preemption and recompute", actions,
        engine_overrides=TINY_KV_POOL, greedy=False, seeded=True,
        expects=("preemption", "resume"),
    )


def penalties_preemption(rng: random.Random, vocab: int) -> Scenario:
    # c masks ~100 stop ids (and EOS) for its first 5 outputs, then may stop on one: the
    # resumed prefill must still count its earlier tokens as outputs.
    stop_ids = sorted(rng.sample(range(3, vocab), min(100, vocab - 3)))
    actions = _adds(rng, vocab, [
        ("a", 9, _greedy(8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5)),
        ("b", 10, _seeded(rng, 8, frequency_penalty=0.8, presence_penalty=0.3,
                         repetition_penalty=1.2)),
    ])
    c = Add("c", _prompt(rng, vocab, 11), SamplingParams(
        max_tokens=8, temperature=0.0, min_tokens=5, stop_token_ids=stop_ids,
        repetition_penalty=1.1, logprobs=1,
    ))
    return Scenario(
        "penalties_preemption", "penalties and min_tokens across preemption",
        [*actions, c], engine_overrides=TINY_KV_POOL, greedy=False, seeded=True,
        expects=("preemption", "resume"),
    )


def zero_token_step(rng: random.Random, vocab: int) -> Scenario:
    # This scheduler schedules every new request it admits with >= 1 token, so a step of
    # zero tokens happens only when nothing is left to run: the adds come with the very
    # next step, into the rows (V1) / state slots (V2) the zero-token step just freed.
    first = _adds(rng, vocab, [("a", 5, _greedy(2)), ("b", 7, _greedy(8)), ("c", 6, _greedy(8))])
    # e is aborted while waiting: the runner hears of an id it never saw
    e = Add("e", _prompt(rng, vocab, 4), _greedy(4))
    later = _adds(rng, vocab, [("d", 6, _greedy(3)), ("c", 3, _greedy(4, logprobs=1))])
    return Scenario(
        "zero_token_step", "every request finished or aborted: a step of 0 tokens that "
        "carries the finishes, then new and resubmitted requests",
        [*first, Step(2), e, Abort(("b", "c", "e")), Step(1), *later],
        expects=("zero_token_step",),
    )


def stops_in_flight(rng: random.Random, vocab: int) -> Scenario:
    # Each request stops on any of ~100 random ids once its min_tokens window closes, so
    # under async scheduling a stop (and a window closing) is reached on a step whose
    # tokens are still in flight while the next step runs; one request is aborted with a
    # step in flight, another runs penalties over its in-flight outputs.
    def stops() -> list[int]:
        return sorted(rng.sample(range(3, vocab), min(100, vocab - 3)))

    first = [
        Add("a", _prompt(rng, vocab, 5), _greedy(12, stop_token_ids=stops(), min_tokens=3)),
        Add("b", _prompt(rng, vocab, 8), _seeded(rng, 12, stop_token_ids=stops(), min_tokens=2,
                                                  logprobs=1)),
        Add("c", _prompt(rng, vocab, 6), _greedy(12, stop_token_ids=stops(), min_tokens=4,
                                                  repetition_penalty=1.2, frequency_penalty=0.4)),
        Add("d", _prompt(rng, vocab, 7), _greedy(12)),
        Add("e", _prompt(rng, vocab, 4), _seeded(rng, 12, stop_token_ids=stops())),
    ]
    later = _adds(rng, vocab, [("f", 5, _greedy(6, stop_token_ids=stops(), min_tokens=1))])
    return Scenario(
        "stops_in_flight", "stop ids, min_tokens windows and an abort reached while the "
        "next step is in flight", [*first, Step(3), Abort(("d",)), *later],
        greedy=False, seeded=True, expects=("stop_token",),
    )


ScenarioBuilder = Callable[[random.Random, int], Scenario]
SCENARIOS: dict[str, ScenarioBuilder] = {
    f.__name__: f
    for f in (
        greedy_logprobs, out_of_order_finish, abort_resubmit, preemption, chunked_prefill,
        prefix_cache, padded_batch, seeded_sampling, seeded_preemption, penalties_preemption,
        zero_token_step, stops_in_flight,
    )
}
# `runnerlab diff --quick`: one of each kind of hard case, short.
QUICK_SCENARIOS = ("greedy_logprobs", "abort_resubmit", "seeded_preemption", "zero_token_step")


def build_scenario(name: str, seed: int, vocab_size: int) -> Scenario:
    """The scenario `name` with prompts and sampling seeds drawn from `seed`."""
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    return SCENARIOS[name](random.Random(f"{name}/{seed}"), vocab_size)
