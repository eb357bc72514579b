"""Scheduler unit tests, driven through a fake runner that checks the step contract.

Expected token sequences come from `expected_output`, a plain-Python run of the same
token function and stop rules with no scheduler involved.
"""

from __future__ import annotations

import pytest

from shared.contract.outputs import Logprob
from shared.contract.sampling_params import SamplingParams
from shared.contract.step import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, TokenLogprobs
from shared.serving.request import Request, RequestStatus
from shared.serving.scheduler import Scheduler
from tests.shared.serving.scheduler_fakes import (
    FakeRunner,
    expected_output,
    hash_token_fn,
    run_step,
    script_token_fn,
)

EOS = 2


def make(token_fn=None, **overrides) -> tuple[Scheduler, FakeRunner]:
    cfg = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, num_blocks=64,
        block_size=4, enable_prefix_caching=False,
    )
    cfg.update(overrides)
    sched = Scheduler(**cfg)
    runner = FakeRunner(cfg["num_blocks"], cfg["block_size"], cfg["max_model_len"],
                        token_fn or hash_token_fn(vocab_size=50))
    return sched, runner


def req(req_id: str, prompt: list[int], eos: int | None = None, **params) -> Request:
    return Request(req_id, prompt, SamplingParams(**params), eos, 0)


def run_all(sched: Scheduler, runner: FakeRunner, max_steps: int = 500) -> list:
    steps = []
    for _ in range(max_steps):
        if not (sched.has_unfinished_requests() or sched.has_finished_requests()):
            return steps
        steps.append(run_step(sched, runner))
    raise AssertionError("did not finish")


def check_against_oracle(sched: Scheduler, runner: FakeRunner, r: Request) -> None:
    outputs, reason, stop_reason = expected_output(
        r.prompt_token_ids, r.sampling_params, r.eos_token_id, sched.max_model_len,
        runner.token_fn,
    )
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == (outputs, reason, stop_reason)


def test_chunked_prefill_runs_beside_decodes():
    sched, runner = make(max_num_batched_tokens=8)
    a = req("a", [1, 2, 3], max_tokens=20, ignore_eos=True)
    sched.add_request(a)
    run_step(sched, runner)
    b = req("b", list(range(10, 30)), max_tokens=2)  # 20-token prompt, budget 8
    sched.add_request(b)
    chunks = []
    for _ in range(3):
        so, updates = run_step(sched, runner)
        assert so.num_scheduled_tokens["a"] == 1  # the decode keeps running
        assert so.total_num_scheduled_tokens <= 8
        chunks.append((so.num_scheduled_tokens["b"], b.num_computed_tokens))
        assert {u.request.request_id for u in updates} == (
            {"a", "b"} if b.num_computed_tokens == 20 else {"a"}
        )
    assert chunks == [(7, 7), (7, 14), (6, 20)]  # contiguous, together the whole prompt
    run_all(sched, runner)
    check_against_oracle(sched, runner, a)
    check_against_oracle(sched, runner, b)


def test_chunk_num_computed_tokens_is_value_before_step():
    sched, runner = make(max_num_batched_tokens=5)
    sched.add_request(req("a", list(range(12)), max_tokens=1))
    so1 = sched.schedule()
    assert so1.scheduled_new_reqs[0].num_computed_tokens == 0
    sched.update_from_output(so1, runner.execute(so1))
    so2 = sched.schedule()
    assert so2.scheduled_cached_reqs.num_computed_tokens == [5]
    assert so2.scheduled_cached_reqs.new_block_ids == [[sched.requests["a"].block_ids[-1]]]


def test_max_num_seqs_limits_running_requests():
    sched, runner = make(max_num_seqs=2)
    reqs = [req(f"r{i}", [i + 1] * 3, max_tokens=2 + i, ignore_eos=True) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    steps = run_all(sched, runner)
    assert all(so.num_reqs <= 2 for so, _ in steps)
    first_new = [next(i for i, (so, _) in enumerate(steps)
                      if any(n.req_id == r.request_id for n in so.scheduled_new_reqs))
                 for r in reqs]
    first_finish = min(i for i, (_, ups) in enumerate(steps) if any(u.finished for u in ups))
    assert first_new[:2] == [0, 0] and first_new[2] == first_finish + 1
    for r in reqs:
        check_against_oracle(sched, runner, r)


def test_preemption_recomputes_and_returns_as_new():
    # 4 blocks of 2 slots: two 3-token prompts fill the pool at the first decode boundary.
    sched, runner = make(num_blocks=4, block_size=2, max_model_len=8)
    a = req("a", [1, 2, 3], max_tokens=4, ignore_eos=True)
    b = req("b", [4, 5, 6], max_tokens=4, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    steps = run_all(sched, runner)
    preempting = [i for i, (so, _) in enumerate(steps) if so.preempted_req_ids]
    assert preempting and all(steps[i][0].preempted_req_ids == {"b"} for i in preempting)
    i = preempting[0]
    assert "b" not in steps[i][0].num_scheduled_tokens
    assert not steps[i][0].scheduled_new_reqs  # no admission right after a preemption
    resumed = next(n for so, _ in steps[i + 1:] for n in so.scheduled_new_reqs if n.req_id == "b")
    assert resumed.prompt_len == 3 and resumed.prefill_len > 3
    assert resumed.prompt_token_ids[:3] == [4, 5, 6]
    check_against_oracle(sched, runner, a)
    check_against_oracle(sched, runner, b)  # same tokens as an uninterrupted run
    assert sched.num_free_blocks == sched.num_total_blocks


def test_request_too_big_for_the_pool_is_an_error_not_a_hang():
    sched, runner = make(num_blocks=2, block_size=2, max_model_len=16)
    sched.add_request(req("a", [1, 2, 3, 4, 5, 6], max_tokens=1))
    with pytest.raises(RuntimeError, match="'a' alone does not fit"):
        sched.schedule()


@pytest.mark.parametrize(
    "script, params, expected",
    [
        ([5, EOS, 7], dict(max_tokens=8), ([5, EOS], "stop", None)),
        ([5, EOS, 7], dict(max_tokens=4, ignore_eos=True), ([5, EOS, 7, 7], "length", None)),
        # min_tokens=2: outputs 0 and 1 cannot stop (the sampler would have masked them).
        ([EOS], dict(max_tokens=8, min_tokens=2), ([EOS, EOS, EOS], "stop", None)),
        ([9, 4, 9], dict(max_tokens=8, min_tokens=1, stop_token_ids=[9]), ([9, 4, 9], "stop", 9)),
        ([5], dict(max_tokens=3), ([5, 5, 5], "length", None)),
        ([5, EOS], dict(max_tokens=2), ([5, EOS], "stop", None)),  # EOS checked before max_tokens
        ([5, 6, 7, 8], dict(max_tokens=8, stop_token_ids=[8, 7]), ([5, 6, 7], "stop", 7)),
    ],
)
def test_stop_conditions(script, params, expected):
    sched, runner = make(token_fn=script_token_fn(script))
    r = req("r", [1, 2, 3], eos=EOS, **params)
    sched.add_request(r)
    run_all(sched, runner)
    assert (r.output_token_ids, r.finish_reason, r.stop_reason) == expected
    check_against_oracle(sched, runner, r)


def test_no_eos_token_means_no_eos_stop():
    sched, runner = make(token_fn=script_token_fn([EOS]))
    r = req("r", [1, 2, 3], eos=None, max_tokens=3)
    sched.add_request(r)
    run_all(sched, runner)
    assert (r.output_token_ids, r.finish_reason) == ([EOS] * 3, "length")


def test_max_model_len_caps_before_eos():
    sched, runner = make(token_fn=script_token_fn([5, 5, EOS]), max_model_len=8)
    r = req("r", [1, 2, 3, 4, 5], eos=EOS, max_tokens=10)
    sched.add_request(r)
    steps = run_all(sched, runner)
    # 5 + 3 = 8 tokens: the third token reaches max_model_len ("length" wins over EOS).
    assert (r.output_token_ids, r.finish_reason) == ([5, 5, EOS], "length")
    assert max(n for so, _ in steps for n in so.num_scheduled_tokens.values()) == 5
    check_against_oracle(sched, runner, r)


def test_abort_unknown_id_is_a_noop():
    sched, runner = make()
    sched.add_request(req("a", [1, 2], max_tokens=3))
    assert sched.abort_requests(["nope"]) == []
    so, updates = run_step(sched, runner)
    assert so.finished_req_ids == set() and [u.request.request_id for u in updates] == ["a"]


def test_abort_waiting_and_running():
    sched, runner = make(max_num_seqs=1)
    a = req("a", [1, 2, 3], max_tokens=10, ignore_eos=True)
    b = req("b", [4, 5], max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched, runner)
    assert (a.status, b.status) == (RequestStatus.RUNNING, RequestStatus.WAITING)
    assert sched.abort_requests(["a", "b"]) == [a, b]
    assert (a.finish_reason, b.finish_reason) == ("abort", "abort")
    assert sched.num_free_blocks == sched.num_total_blocks
    so, updates = run_step(sched, runner)
    assert so.total_num_scheduled_tokens == 0 and so.finished_req_ids == {"a", "b"}
    assert [(u.request, u.finished, u.new_token_ids) for u in updates] == [
        (a, True, []), (b, True, [])
    ]
    assert not runner.states and not sched.has_finished_requests()


def test_abort_then_resubmit_before_schedule():
    sched, runner = make()
    old = req("x", [1, 2, 3], max_tokens=10, ignore_eos=True)
    sched.add_request(old)
    run_step(sched, runner)
    run_step(sched, runner)
    sched.abort_requests(["x"])
    new = req("x", [7, 8, 9, 10, 11], max_tokens=3)
    sched.add_request(new)
    so = sched.schedule()
    assert "x" in so.finished_req_ids
    [nrd] = so.scheduled_new_reqs
    assert nrd.req_id == "x" and nrd.prompt_token_ids == [7, 8, 9, 10, 11]
    assert nrd.num_computed_tokens == 0 and nrd.prompt_len == 5
    updates = sched.update_from_output(so, runner.execute(so))
    assert [(u.request, u.finished) for u in updates] == [(old, True), (new, False)]
    assert old.num_output_tokens == 2  # nothing after the abort
    run_all(sched, runner)
    check_against_oracle(sched, runner, new)
    assert sched.num_free_blocks == sched.num_total_blocks


def test_late_output_of_aborted_request_is_ignored_by_identity():
    sched, runner = make()
    old = req("x", [1, 2, 3], max_tokens=10, ignore_eos=True)
    sched.add_request(old)
    so = sched.schedule()
    out = runner.execute(so)
    sched.abort_requests(["x"])  # while the step is in flight
    new = req("x", [4, 5], max_tokens=2)
    sched.add_request(new)
    assert sched.update_from_output(so, out) == []
    assert old.output_token_ids == [] and new.output_token_ids == []
    so2, updates = run_step(sched, runner)
    assert so2.finished_req_ids == {"x"} and so2.scheduled_new_reqs[0].prompt_token_ids == [4, 5]
    assert [(u.request, u.finished) for u in updates] == [(old, True), (new, False)]


def test_late_output_ignored_even_when_resubmitted_id_runs():
    # Async-style order: step N+1 is scheduled before step N's output is applied. The
    # resubmitted "x" is RUNNING by then, so only object identity tells the outputs apart.
    sched, runner = make(token_fn=script_token_fn([5]))
    old = req("x", [1, 2, 3], max_tokens=10, ignore_eos=True)
    sched.add_request(old)
    so1 = sched.schedule()
    out1 = runner.execute(so1)
    sched.abort_requests(["x"])
    new = req("x", [4, 5], max_tokens=3, ignore_eos=True)
    sched.add_request(new)
    so2 = sched.schedule()
    assert new.status == RequestStatus.RUNNING
    assert sched.update_from_output(so1, out1) == []
    assert new.output_token_ids == [] and old.output_token_ids == []
    updates = sched.update_from_output(so2, runner.execute(so2))
    assert [(u.request, u.new_token_ids) for u in updates] == [(old, []), (new, [5])]


def test_zero_token_step_carries_finishes():
    sched, runner = make(token_fn=script_token_fn([5]))
    r = req("r", [1, 2], max_tokens=1)
    sched.add_request(r)
    _, updates = run_step(sched, runner)
    assert updates[0].finished and not sched.has_unfinished_requests()
    assert sched.has_finished_requests()
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 0 and so.finished_req_ids == {"r"}
    assert sched.update_from_output(so, EMPTY_MODEL_RUNNER_OUTPUT) == []
    assert not sched.has_finished_requests()
    assert sched.schedule().finished_req_ids == set()  # reported once


def test_duplicate_live_id_raises():
    sched, runner = make(max_num_seqs=1, token_fn=script_token_fn([5]))
    sched.add_request(req("a", [1], max_tokens=1))
    sched.add_request(req("b", [1], max_tokens=1))
    run_step(sched, runner)  # a runs and finishes, b still waiting
    with pytest.raises(ValueError, match="'b'"):
        sched.add_request(req("b", [2]))
    sched.add_request(req("a", [2], max_tokens=1))  # finished: the id is free again
    sched.abort_requests(["b"])
    sched.add_request(req("b", [3], max_tokens=1))


def test_prefix_hit_in_scheduler_same_and_later_step():
    sched, runner = make(enable_prefix_caching=True)
    prompt = list(range(100, 110))  # 2.5 blocks of 4
    sched.add_request(req("a", prompt, max_tokens=2))
    sched.add_request(req("b", prompt, max_tokens=2))
    so, _ = run_step(sched, runner)
    assert [n.num_computed_tokens for n in so.scheduled_new_reqs] == [0, 8]
    assert so.num_scheduled_tokens == {"a": 10, "b": 2}
    a, b = sched.requests["a"], sched.requests["b"]
    assert b.block_ids[:2] == a.block_ids[:2] and len(b.block_ids) == 3
    assert sched.num_free_blocks == sched.num_total_blocks - 4
    run_all(sched, runner)
    c = req("c", prompt + [1, 2, 3], max_tokens=2)
    sched.add_request(c)
    so, _ = run_step(sched, runner)  # the fake KV check proves the hit holds a's tokens
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    run_all(sched, runner)
    check_against_oracle(sched, runner, c)
    assert sched.num_free_blocks == sched.num_total_blocks


def test_logprobs_become_dicts():
    sched, _ = make()
    sched.add_request(req("a", [1, 2], max_tokens=4, logprobs=1))
    sched.add_request(req("b", [3, 4], max_tokens=4))
    so = sched.schedule()
    out = ModelRunnerOutput(
        req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[7], [8]],
        logprobs=[TokenLogprobs(token_ids=[7, 7, 3], logprobs=[-0.5, -0.5, -1.5], rank=1), None],
    )
    sched.decode_token = lambda t: f"<{t}>"
    ups = {u.request.request_id: u for u in sched.update_from_output(so, out)}
    # the sampled token keeps its rank; the top-k entries are ranked by their order, and
    # the sampled token listed again among them is not repeated
    expected = [{7: Logprob(-0.5, 1, "<7>"), 3: Logprob(-1.5, 2, "<3>")}]
    assert ups["a"].new_logprobs == expected and ups["a"].new_token_ids == [7]
    assert ups["b"].new_logprobs is None and ups["b"].new_token_ids == [8]
    assert ups["a"].request.logprobs == expected and ups["b"].request.logprobs == []
    assert ups["a"].request.cumulative_logprob == -0.5


def test_without_chunking_a_long_prompt_waits_for_a_whole_budget():
    sched, runner = make(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    sched.add_request(req("a", [1] * 40, max_tokens=3))
    sched.add_request(req("b", [2] * 30, max_tokens=3))
    so, _ = run_step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 40}  # b (30) does not fit the 24 left
    so, _ = run_step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 30}
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        make(max_num_batched_tokens=32, max_model_len=64, enable_chunked_prefill=False)


def test_update_rejects_foreign_scheduler_output():
    sched, _ = make()
    other, _ = make()
    with pytest.raises(ValueError):
        sched.update_from_output(other.schedule(), EMPTY_MODEL_RUNNER_OUTPUT)
