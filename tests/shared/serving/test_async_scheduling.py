"""Async scheduling (both runners): the engine schedules and launches step N+1 before it
reads step N's tokens back. Oracles:
- V1 with the synchronous engine on every scenario of the library (float64, CPU), for
  V1 async and V2 async alike: identical tokens, finish reasons and logprobs for every
  request that ends on its own; an aborted request's tokens are a prefix of V1's (its
  in-flight token is dropped);
- a plain count: without stops on EOS, async scheduling computes exactly the tokens the
  synchronous engine computes (no step is wasted on a request at its length limit);
- the call order itself: schedule(N+1) comes before update_from_output(N).
"""

from __future__ import annotations

import numpy as np
import pytest

from policy import EngineArgs
from shared.contract.sampling_params import SamplingParams
from shared.harness.diff import DiffSetup, build_engine
from shared.harness.hf_reference import materialize_checkpoint
from shared.harness.scenario_run import run_scenario
from shared.harness.scenarios import SCENARIOS, build_scenario
from shared.serving.engine import LLMEngine

SEED = 0
VOCAB = 512
LOGPROB_TOL = 1e-9


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return materialize_checkpoint("tiny-llama", SEED, str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def sync_runs(llama_dir) -> dict:
    """V1 with the synchronous engine: the oracle, one run per scenario."""
    setup = DiffSetup("tiny-llama", llama_dir, "float64", "cpu", SEED, ["v1", "v2"])
    runs = {}
    for name in SCENARIOS:
        scenario = build_scenario(name, SEED, VOCAB)
        runs[name] = run_scenario(build_engine(setup, "v1", scenario.engine_kwargs()), scenario)
    return runs


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_async_equals_sync_v1_on_every_scenario(llama_dir, sync_runs, name, runner):
    scenario = build_scenario(name, SEED, VOCAB)
    setup = DiffSetup("tiny-llama", llama_dir, "float64", "cpu", SEED, ["v1", "v2"])
    engine = build_engine(setup, runner, {**scenario.engine_kwargs(), "async_scheduling": True})
    assert engine.async_scheduling and engine.runner_name == runner
    run = run_scenario(engine, scenario)
    assert run.missing_events(scenario.expects) == []
    assert_async_matches_sync(sync_runs[name], run, LOGPROB_TOL)
    assert run.num_free_blocks == run.num_total_blocks
    assert all(r.num_output_placeholders == 0 for r in engine.scheduler.requests.values())
    if runner == "v1":  # every placeholder landed: the runner holds no step in flight
        assert not engine.runner.in_flight


def assert_async_matches_sync(sync, run, logprob_tol: float) -> None:
    """Requests that end on their own: identical records; aborted ones: a prefix that
    lacks at most the token that was in flight."""
    assert run.requests.keys() == sync.requests.keys()
    for label, ref in sync.requests.items():
        rec = run.requests[label]
        if ref.finish_reason == "abort" or rec.finish_reason == "abort":
            assert rec.finish_reason == ref.finish_reason == "abort", label
            assert ref.token_ids[: len(rec.token_ids)] == rec.token_ids, label
            assert len(ref.token_ids) - len(rec.token_ids) <= 1, label
            continue
        assert rec.token_ids == ref.token_ids and rec.finish_reason == ref.finish_reason, label
        assert (rec.logprobs is None) == (ref.logprobs is None), label
        for pos, (da, db) in enumerate(zip(rec.logprobs or [], ref.logprobs or [])):
            assert da.keys() == db.keys(), (label, pos)
            assert max(abs(da[t] - db[t]) for t in da) <= logprob_tol, (label, pos)


def _engine(async_scheduling: bool, runner: str = "v2", **kw) -> LLMEngine:
    args = dict(model="tiny-llama", dtype="float64", model_runner=runner, seed=0,
                enable_prefix_caching=False, max_model_len=64, block_size=4,
                max_num_seqs=8, max_num_batched_tokens=48, num_gpu_blocks_override=160)
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(async_scheduling=async_scheduling, **args))


def _add_workload(engine: LLMEngine, n: int = 10) -> dict[str, int]:
    rng = np.random.default_rng(3)
    max_tokens = {}
    for i in range(n):
        prompt = rng.integers(1, VOCAB, int(rng.integers(2, 30))).tolist()
        max_tokens[str(i)] = int(rng.integers(1, 64 - len(prompt) + 8))  # some hit max_model_len
        engine.add_request(str(i), prompt, SamplingParams(
            max_tokens=max_tokens[str(i)], temperature=0.7, seed=i, ignore_eos=True))
    return max_tokens


def _drain_recording(engine: LLMEngine) -> tuple[dict[str, list[int]], int, list[str]]:
    """Drain; -> (tokens per request, tokens computed over all steps, preempted ids)."""
    scheduled, preempted = [], []
    schedule = engine.scheduler.schedule

    def recording():
        so = schedule()
        scheduled.append(so.total_num_scheduled_tokens)
        preempted.extend(so.preempted_req_ids)
        return so

    engine.scheduler.schedule = recording
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    return tokens, sum(scheduled), preempted


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_async_computes_exactly_the_tokens_sync_computes(runner):
    """No stop on EOS: every request's end is known, so async never schedules a token
    past a request's length limit, and computes what the synchronous engine computes."""
    sync, async_ = _engine(False, runner), _engine(True, runner)
    _add_workload(sync)
    _add_workload(async_)
    tokens_sync, computed_sync, _ = _drain_recording(sync)
    tokens_async, computed_async, _ = _drain_recording(async_)
    assert tokens_async == tokens_sync and len(tokens_sync) == 10
    assert computed_async == computed_sync


def test_schedule_of_next_step_precedes_update_of_this_one():
    engine = _engine(True)
    _add_workload(engine, 3)
    calls: list[str] = []
    sched = engine.scheduler
    schedule, update = sched.schedule, sched.update_from_output
    sched.schedule = lambda: (calls.append("schedule"), schedule())[1]
    sched.update_from_output = lambda so, out: (calls.append("update"), update(so, out))[1]
    for _ in range(4):
        engine.step()
    # the first step only launches; afterwards each step schedules, then settles the last
    assert calls[:7] == ["schedule", "schedule", "update", "schedule", "update",
                         "schedule", "update"]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_preemption_under_async_scheduling_matches_sync(runner):
    """A pool too small for every request: requests are preempted while their previous
    step's token may still be in flight; the sync engine (V1) is the oracle."""
    kw = dict(num_gpu_blocks_override=24, max_num_batched_tokens=32)
    sync, async_ = _engine(False, "v1", **kw), _engine(True, runner, **kw)
    _add_workload(sync)
    _add_workload(async_)
    tokens_async, _, preempted = _drain_recording(async_)
    tokens_sync, _, _ = _drain_recording(sync)
    assert preempted, "the workload must preempt"
    assert tokens_async == tokens_sync
    assert async_.num_free_kv_blocks() == async_.num_total_kv_blocks()


def test_the_policy_leaves_async_scheduling_to_either_runner():
    for runner in ("v1", "v2"):
        cfg = EngineArgs(model="tiny-llama", model_runner=runner, async_scheduling=True
                         ).create_engine_config()
        assert cfg.runner_decision.runner == runner and cfg.scheduler_config.async_scheduling
    # left to the policy, async scheduling no longer forces a runner
    cfg = EngineArgs(model="tiny-llama", async_scheduling=True).create_engine_config()
    assert cfg.runner_decision.source != "forced"
