"""Speculative decoding end to end (CPU, float64, tiny-llama), both runners.

Oracles:
- greedy: with any proposer and any k, every request's tokens and finish reason equal
  the plain (non-speculative) V1 engine's on every scenario of the differential library;
  the plain engine itself equals Hugging Face greedy (tests/shared/serving/test_hf_greedy.py).
- seeded sampling: V1 and V2 with the same draft model give the same tokens.
- the proposals were really used: drafts were verified, some accepted and (with a weak
  draft) some rejected, so the comparison is not vacuous.
Scenario requests lose what the rejection samplers refuse (logprobs, penalties,
min_tokens: EngineInputError with speculative decoding, checked below).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from shared.contract.sampling_params import SamplingParams
from shared.harness.diff import DiffSetup, build_engine
from shared.harness.hf_reference import materialize_checkpoint
from shared.harness.scenario_run import run_scenario
from shared.harness.scenarios import SCENARIOS, Add, Drain, Scenario, build_scenario
from shared.serving.engine import EngineInputError

SEED = 0
VOCAB = 512

# (runner, speculative_config): the draft "self" is the target's own checkpoint (its greedy
# drafts are almost always accepted); tiny-llama-draft is a different random model (its
# drafts are almost always rejected)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
CONFIGS = {
    "v1-ngram-k3": ("v1", NGRAM),
    "v1-ngram-k1": ("v1", {**NGRAM, "num_speculative_tokens": 1}),
    "v1-self-k3": ("v1", {"method": "draft_model", "model": "SELF", "num_speculative_tokens": 3}),
    "v1-weak-k2": ("v1", {"method": "draft_model", "model": "tiny-llama-draft",
                          "num_speculative_tokens": 2}),
    "v2-self-k3": ("v2", {"method": "draft_model", "model": "SELF", "num_speculative_tokens": 3}),
    "v2-weak-k2": ("v2", {"method": "draft_model", "model": "tiny-llama-draft",
                          "num_speculative_tokens": 2}),
    # async scheduling: the next step is planned before the drafts and accepted counts land
    "v1-async-self-k3": ("v1-async", {"method": "draft_model", "model": "SELF",
                                      "num_speculative_tokens": 3}),
    "v1-async-weak-k2": ("v1-async", {"method": "draft_model", "model": "tiny-llama-draft",
                                      "num_speculative_tokens": 2}),
    "v2-async-self-k3": ("v2-async", {"method": "draft_model", "model": "SELF",
                                      "num_speculative_tokens": 3}),
    "v2-async-weak-k2": ("v2-async", {"method": "draft_model", "model": "tiny-llama-draft",
                                      "num_speculative_tokens": 2}),
}


def spec_compatible(scenario: Scenario) -> Scenario:
    """The scenario without logprobs, penalties and min_tokens (refused with spec decode)."""
    def strip(p: SamplingParams) -> SamplingParams:
        return dataclasses.replace(p, logprobs=None, presence_penalty=0.0, frequency_penalty=0.0,
                                   repetition_penalty=1.0, min_tokens=0)
    actions = [Add(a.request_id, a.prompt_token_ids, strip(a.params)) if isinstance(a, Add) else a
               for a in scenario.actions]
    return dataclasses.replace(scenario, actions=actions)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return materialize_checkpoint("tiny-llama", SEED, str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def setup(llama_dir) -> DiffSetup:
    return DiffSetup("tiny-llama", llama_dir, "float64", "cpu", SEED, ["v1", "v2"])


def spec_kwargs(config: str, llama_dir: str) -> tuple[str, dict]:
    runner, spec = CONFIGS[config]
    if spec.get("model") == "SELF":
        spec = {**spec, "model": llama_dir}
    return runner, spec


@pytest.fixture(scope="module")
def plain_runs(setup) -> dict:
    runs = {}
    for name in GREEDY:
        scenario = scenario_named(name)
        runs[name] = run_scenario(build_engine(setup, "v1", scenario.engine_kwargs()), scenario)
    return runs


def spec_preemption(seed: int, vocab: int) -> Scenario:
    """Two requests that fit a small pool at admission (drafts' lookahead included) and
    outgrow it together: the second is preempted and resumes after the first finishes.
    (The library's preemption scenario does not preempt here: its third request waits
    for the lookahead slots instead.)"""
    rng = random.Random(seed)
    adds = [Add(r, tuple(rng.randrange(3, vocab) for _ in range(6)),
                SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
            for r in ("a", "b")]
    return Scenario("spec_preemption", "two requests outgrow a pool of 8 blocks of 4",
                    [*adds, Drain()], engine_overrides=dict(
                        block_size=4, max_model_len=32, num_gpu_blocks_override=8,
                        max_num_batched_tokens=32, max_num_seqs=4),
                    expects=("preemption", "resume"))


def repetitive(seed: int, vocab: int) -> Scenario:
    """Prompts that repeat a pattern: the ngram proposer finds matches in them."""
    rng = random.Random(seed)
    adds = []
    for i, (period, reps) in enumerate(((3, 4), (2, 5), (4, 3), (5, 2))):
        pattern = [rng.randrange(3, vocab) for _ in range(period)]
        adds.append(Add(f"r{i}", tuple(pattern * reps),
                        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)))
    return Scenario("repetitive", "prompts repeating a pattern", [*adds, Drain()])


EXTRA = {"spec_preemption": spec_preemption, "repetitive": repetitive}


def scenario_named(name: str) -> Scenario:
    if name in EXTRA:
        return EXTRA[name](SEED, VOCAB)
    return spec_compatible(build_scenario(name, SEED, VOCAB))


GREEDY = [n for n in SCENARIOS if build_scenario(n, SEED, VOCAB).greedy] + list(EXTRA)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", GREEDY)
def test_greedy_spec_decode_equals_plain_greedy(setup, llama_dir, plain_runs, config, name):
    scenario = scenario_named(name)
    runner, spec = spec_kwargs(config, llama_dir)
    engine = build_engine(setup, runner, {**scenario.engine_kwargs(), "speculative_config": spec})
    assert engine.runner_name == runner.partition("-")[0]
    assert engine.num_speculative_tokens == spec["num_speculative_tokens"]
    assert engine.async_scheduling == runner.endswith("-async")
    run = run_scenario(engine, scenario)
    ref = plain_runs[name]
    # the library's preemption scenario may not preempt with drafts' lookahead (see
    # spec_preemption, which must, for every configuration)
    expects = () if name == "preemption" else scenario.expects
    assert run.missing_events(expects) == []
    assert_same_as_plain(ref, run)


def assert_same_as_plain(ref, run) -> None:
    """Every request's tokens and finish reason equal the plain run's; all blocks free."""
    for label, rec in ref.requests.items():
        got = run.requests[label]
        if rec.finish_reason == "abort":
            # An abort lands at a step boundary, and a speculative step emits several
            # tokens: the aborted request may be further along (or already finished).
            # Both are prefixes of the same greedy sequence.
            common = min(len(rec.token_ids), len(got.token_ids))
            assert got.token_ids[:common] == rec.token_ids[:common], label
            continue
        assert (got.token_ids, got.finish_reason) == (rec.token_ids, rec.finish_reason), label
    assert run.num_free_blocks == run.num_total_blocks


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_drafts_were_really_verified(setup, llama_dir, config):
    """The comparison above is not vacuous: every configuration drafts; the target's own
    checkpoint as the draft is always accepted (greedy: q's argmax is p's), the other
    random model mostly rejected."""
    scenario = repetitive(SEED, VOCAB)
    runner, spec = spec_kwargs(config, llama_dir)
    engine = build_engine(setup, runner, {**scenario.engine_kwargs(), "speculative_config": spec})
    run_scenario(engine, scenario)
    stats = engine.spec_decode_stats
    assert stats.num_draft_tokens > 0
    rate = stats.acceptance_rate
    if "self" in config:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    elif "weak" in config:
        assert rate < 0.5
    else:  # ngram on a random model: some of each
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("method", ["standard", "synthetic"])
def test_seeded_spec_decode_v1_equals_v2(setup, llama_dir, method):
    scenario = spec_compatible(build_scenario("seeded_sampling", SEED, VOCAB))
    spec = {"method": "draft_model", "model": "tiny-llama-draft", "num_speculative_tokens": 2,
            "rejection_sample_method": method}
    if method == "synthetic":
        spec["synthetic_acceptance_rates"] = [0.7, 0.5]
    runs = {}
    for runner in ("v1", "v2"):
        engine = build_engine(setup, runner, {**scenario.engine_kwargs(), "speculative_config": spec})
        runs[runner] = run_scenario(engine, scenario)
    assert runs["v1"].requests == runs["v2"].requests


@pytest.mark.parametrize("bad", [dict(logprobs=1), dict(repetition_penalty=1.2), dict(min_tokens=2)])
def test_refused_params_fail_alone(setup, bad):
    engine = build_engine(setup, "v1", {"speculative_config": NGRAM})
    engine.add_request("ok", [5, 6, 7, 5, 6], SamplingParams(max_tokens=6, temperature=0.0))
    with pytest.raises(EngineInputError, match="with speculative decoding is not supported yet"):
        engine.add_request("bad", [5, 6], SamplingParams(max_tokens=4, temperature=0.0, **bad))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    done = [o for o in outputs if o.finished]
    assert [o.request_id for o in done] == ["ok"] and len(done[0].outputs[0].token_ids) == 6
    assert done[0].spec_decode_stats is not None


@pytest.mark.parametrize("config", ["v1-ngram-k3", "v2-self-k3", "v2-weak-k2"])
def test_greedy_spec_decode_equals_transformers(llama_dir, config):
    """Directly against Hugging Face generate() (the plain engine's own oracle)."""
    from shared.harness.hf_reference import HFGreedy
    from shared.serving.llm import LLM

    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 7, 12)]
    prompts.append([7, 8, 9] * 4)  # a repetitive one: ngram drafts from it
    hf = HFGreedy(llama_dir, "float64", "cpu")
    expected = [hf.generate(p, 16)[0] for p in prompts]
    runner, spec = spec_kwargs(config, llama_dir)
    llm = LLM(model=llama_dir, dtype="float64", device="cpu", seed=0, model_runner=runner,
              enable_prefix_caching=False, speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.spec_decode_stats.num_draft_tokens > 0
