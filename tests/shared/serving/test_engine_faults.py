"""Faults leave the engine consistent: an exception raised at any stage boundary of a
step, in either runner and with async scheduling, rolls the scheduler and the runner back,
so that the interrupted requests finish with exactly the tokens of an unfaulted run, a
later generate() is correct, and every KV block returns to the pool.

The oracle is the same engine configuration run without faults (float64 and seeded
sampling: a request's tokens are a function of its prompt and seed, whatever the batch
or a recompute does). A SIGINT sent from outside, during generate(), is the real-world
form of the fault; it runs in a subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from shared import LLM, SamplingParams

CONFIGS = {
    "v1": dict(model_runner="v1"),
    "v2": dict(model_runner="v2"),
    "v1-async": dict(model_runner="v1", async_scheduling=True),
    "v2-async": dict(model_runner="v2", async_scheduling=True),
}
PREFIX = list(range(10, 42))  # two full blocks shared by two prompts: prefix-cache hits
PROMPTS = [PREFIX + [5, 6, 7], list(range(60, 69)), PREFIX + [9], [3, 4]]
PARAMS = [
    SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.9, top_k=50, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=5, temperature=0.7, seed=12, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
]


class InjectedFault(Exception):
    pass


def make_llm(name: str) -> LLM:
    return LLM(model="tiny-llama", dtype="float64", device="cpu", seed=0,
               enable_prefix_caching=True, num_gpu_blocks_override=64, **CONFIGS[name])


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engine_case(request):
    llm = make_llm(request.param)
    reference = tokens_of(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    return llm, reference


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def arm(monkeypatch, llm: LLM, stage: str, at_call: int) -> dict:
    """Raise InjectedFault at the at_call-th pass through `stage` (1-based)."""
    engine = llm.engine
    targets = {
        "after_schedule": (engine.scheduler, "schedule", "after"),
        "inside_execute": (engine.runner.executor, "forward", "before"),
        "between_execute_and_sample": (engine.runner, "sample_tokens", "before"),
        "inside_update": (engine.scheduler, "_apply_sampled", "before"),
    }
    obj, name, when = targets[stage]
    original = getattr(obj, name)
    calls = {"n": 0, "fired": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        fire = calls["n"] == at_call
        if fire and when == "before":
            calls["fired"] += 1
            raise InjectedFault(stage)
        result = original(*args, **kwargs)
        if fire:
            calls["fired"] += 1
            raise InjectedFault(stage)
        return result

    monkeypatch.setattr(obj, name, wrapper)
    return calls


def assert_idle_and_free(llm: LLM) -> None:
    engine = llm.engine
    assert engine.scheduler.get_num_unfinished_requests() == 0
    assert engine.num_free_kv_blocks() == engine.num_total_kv_blocks()


STAGES = ["after_schedule", "inside_execute", "between_execute_and_sample", "inside_update"]


@pytest.mark.parametrize("at_call", [1, 4])
@pytest.mark.parametrize("stage", STAGES)
def test_generate_fault_then_next_generate_is_correct(engine_case, monkeypatch, stage, at_call):
    llm, reference = engine_case
    calls = arm(monkeypatch, llm, stage, at_call)
    with pytest.raises(InjectedFault):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert calls["fired"] == 1
    monkeypatch.undo()
    assert_idle_and_free(llm)  # generate() aborted what it had submitted
    assert tokens_of(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference
    assert_idle_and_free(llm)


@pytest.mark.parametrize("at_call", [2, 5])
@pytest.mark.parametrize("stage", STAGES)
def test_engine_step_fault_rolls_back_and_requests_finish_unchanged(
        engine_case, monkeypatch, stage, at_call):
    """Driving the engine directly: the step raises, the caller keeps stepping, and every
    request in flight finishes with the unfaulted tokens; its finish is reported once."""
    llm, reference = engine_case
    engine = llm.engine
    ids = [f"fault-{stage}-{at_call}-{i}" for i in range(len(PROMPTS))]
    for rid, prompt, params in zip(ids, PROMPTS, PARAMS):
        engine.add_request(rid, prompt, params)
    calls = arm(monkeypatch, llm, stage, at_call)
    finished: dict[str, list[int]] = {}
    faults = 0
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        try:
            outs = engine.step()
        except InjectedFault:
            faults += 1
            continue
        for out in outs:
            if out.finished:
                assert out.request_id not in finished, "a finish reported twice"
                finished[out.request_id] = out.outputs[0].token_ids
    assert faults == 1 and calls["fired"] == 1
    assert [finished[r] for r in ids] == reference
    assert_idle_and_free(llm)


def test_abort_reported_after_a_failed_update(engine_case, monkeypatch):
    """An abort whose report was due in the update that failed is reported by a later one."""
    llm, _ = engine_case
    engine = llm.engine
    engine.add_request("keep", PROMPTS[1], PARAMS[1])
    engine.add_request("drop", PROMPTS[3], PARAMS[3])
    engine.step()
    engine.step()
    engine.abort_request("drop")
    arm(monkeypatch, llm, "inside_update", 1)
    reported: list[str] = []
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        try:
            reported += [o.request_id for o in engine.step() if o.finished]
        except InjectedFault:
            pass
    assert sorted(reported) == ["drop", "keep"]
    assert_idle_and_free(llm)


@pytest.mark.parametrize("stage", ["after_schedule", "inside_execute"])
def test_prefix_blocks_of_a_failed_step_are_not_hit(engine_case, monkeypatch, stage):
    """The failed step registered its full blocks in the prefix cache before its forward
    wrote them; the retry must not read that KV (a fresh prefix, never computed)."""
    llm, _ = engine_case
    prefix = list(range(100 + len(stage), 132 + len(stage)))
    prompts = [prefix + [1, 2], prefix + [3]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    reference = tokens_of(make_llm("v1").generate(prompts, params, use_tqdm=False))
    arm(monkeypatch, llm, stage, 1)
    with pytest.raises(InjectedFault):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert tokens_of(llm.generate(prompts, params, use_tqdm=False)) == reference
    assert_idle_and_free(llm)


SIGINT_CHILD = textwrap.dedent("""
    import sys
    from shared import LLM, SamplingParams

    llm = LLM(model="tiny-llama", dtype="float32", device="cpu", seed=0,
              model_runner=sys.argv[1], num_gpu_blocks_override=256)
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = llm.generate([[1, 2, 3], [7, 8]], short, use_tqdm=False)
    engine = llm.engine
    step, steps = engine.step, [0]

    def counting_step():
        steps[0] += 1
        if steps[0] == 3:
            print("STEPPING", flush=True)  # the parent's cue to send SIGINT
        return step()

    engine.step = counting_step
    long = SamplingParams(max_tokens=400, temperature=0.8, seed=1, ignore_eos=True)
    try:
        llm.generate([[5, 6, 7, 8]] * 8, long, use_tqdm=False)
        print("NOT INTERRUPTED", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED at step", steps[0], flush=True)
    engine.step = step
    assert engine.scheduler.get_num_unfinished_requests() == 0
    assert engine.num_free_kv_blocks() == engine.num_total_kv_blocks()
    again = llm.generate([[1, 2, 3], [7, 8]], short, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]
    assert engine.num_free_kv_blocks() == engine.num_total_kv_blocks()
    print("CONSISTENT", flush=True)
""")


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_sigint_during_generate_leaves_engine_consistent(runner: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGINT_CHILD, runner], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=dict(os.environ),
    )
    try:
        for line in proc.stdout:
            if line.startswith("STEPPING"):
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "INTERRUPTED at step" in out and "CONSISTENT" in out, out + err[-2000:]
