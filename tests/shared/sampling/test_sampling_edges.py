"""Sampling values at the edges of their ranges through both runners (issue 19).

float32, CPU, on the tiny-llama shape with a seeded Hugging Face checkpoint
(materialize_checkpoint), so transformers supplies logits independent of the runners.
Oracles:
- transformers' greedy search, for tiny temperatures (which must be greedy);
- the NumPy reference pipeline (tests/oracles/sampling_reference.py) run on transformers'
  teacher-forced float32 logits, for seeded sampling at MAX_TEMPERATURE, repetition
  penalties at their bounds and min_tokens with stop ids;
- the other runner: V1 and V2 give the same tokens at every edge.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from shared import LLM
from shared.contract.outputs import CompletionOutput
from shared.contract.sampling_params import (
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from shared.harness.hf_reference import HFGreedy, materialize_checkpoint
from shared.serving.engine import EngineInputError
from tests.oracles.sampling_reference import reference_sample_row

RUNNERS = ["v1", "v2"]
PROMPTS = [[5, 6, 7, 8], [100, 200, 3, 17, 250, 41], [450, 9]]
MAX_TOKENS = 6
EOS = 2  # tiny-llama
TINY_TEMPERATURES = [1e-6, 1e-30, 1e-39, np.float32(1e-39), 5e-324]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return materialize_checkpoint("tiny-llama", 0, str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def hf(checkpoint) -> HFGreedy:
    return HFGreedy(checkpoint, "float32", "cpu")


@pytest.fixture(scope="module")
def llms(checkpoint) -> dict[str, LLM]:
    """One engine per runner, shared by every test here (V2 runs under the interpreter)."""
    out = {}
    for runner in RUNNERS:
        llm = LLM(model=checkpoint, dtype="float32", device="cpu", seed=0, model_runner=runner,
                  max_model_len=64)
        assert llm.runner_name == runner and llm.engine.eos_token_id == EOS
        out[runner] = llm
    return out


@pytest.fixture(scope="module")
def hf_greedy(hf) -> list[list[int]]:
    return [hf.generate(p, MAX_TOKENS)[0] for p in PROMPTS]


def run(llm: LLM, params: SamplingParams) -> list[CompletionOutput]:
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def both(llms: dict[str, LLM], params: SamplingParams) -> list[list[int]]:
    """Token ids of every prompt; asserts V1 and V2 agree on tokens and finish reasons."""
    v1, v2 = run(llms["v1"], params), run(llms["v2"], params)
    assert [c.token_ids for c in v1] == [c.token_ids for c in v2]
    assert [c.finish_reason for c in v1] == [c.finish_reason for c in v2]
    return [c.token_ids for c in v1]


def hf_logits(hf: HFGreedy, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """transformers' float32 logits [len(prompt) + len(tokens), V], teacher-forced."""
    with torch.no_grad():
        logits = hf.model(torch.tensor([prompt + tokens])).logits[0]
    assert logits.dtype == torch.float32
    return logits.numpy()


def reference_tokens(hf: HFGreedy, prompt: list[int], tokens: list[int],
                     params: SamplingParams) -> list[int]:
    """What the reference pipeline samples at each step, given the runner's earlier
    tokens (the first divergence shows as the first differing id)."""
    logits = hf_logits(hf, prompt, tokens)
    out = []
    for t in range(len(tokens)):
        pos = len(prompt) + t - 1  # position of the input token of this logit
        row = reference_sample_row(logits[pos], params, params.seed, pos, prompt, tokens[:t], EOS)
        out.append(row.token_id)
    return out


def assert_reference(hf: HFGreedy, tokens: list[list[int]], params: SamplingParams) -> None:
    for prompt, got in zip(PROMPTS, tokens):
        assert got == reference_tokens(hf, prompt, got, params), prompt


# ---- tiny temperatures are greedy -----------------------------------------------------
def test_greedy_oracle_agrees_with_both_runners(llms, hf_greedy):
    assert both(llms, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                     ignore_eos=True)) == hf_greedy


def test_a_float32_overflow_would_not_be_greedy(hf, hf_greedy):
    # Why the next test can fail: before normalisation, float32 logits / 1e-39 overflow
    # to +inf for every logit above ~3.4e-1, and the lowest such id wins the argmax.
    # On these prompts that is never the greedy token.
    with np.errstate(over="ignore"):
        for prompt, greedy in zip(PROMPTS, hf_greedy):
            first = hf_logits(hf, prompt, [])[-1]
            scaled = first / np.float32(1e-39)
            assert np.isinf(scaled).sum() > 1
            assert int(np.argmax(scaled)) != greedy[0]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("temperature", TINY_TEMPERATURES,
                         ids=["1e-6", "1e-30", "1e-39", "np.float32(1e-39)", "min-subnormal"])
def test_tiny_temperature_gives_the_greedy_tokens(llms, hf_greedy, runner, temperature):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=13,
                            ignore_eos=True)
    assert [c.token_ids for c in run(llms[runner], params)] == hf_greedy
    assert params.is_greedy and params.temperature == 0.0


@pytest.mark.parametrize("runner", RUNNERS)
def test_tiny_temperature_set_after_construction_is_greedy(llms, hf_greedy, runner):
    # The engine re-validates a copy at admission: the normalisation happens there too.
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=13, ignore_eos=True)
    params.temperature = 1e-39
    assert [c.token_ids for c in run(llms[runner], params)] == hf_greedy


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("field, value", [
    ("temperature", math.inf), ("temperature", 1e39), ("repetition_penalty", math.inf),
    ("temperature", "0.5"), ("stop_token_ids", None), ("max_tokens", True),
])
def test_edge_values_set_after_construction_are_refused(llms, runner, field, value):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    setattr(params, field, value)
    engine = llms[runner].engine
    with pytest.raises(EngineInputError, match=re.escape(f"SamplingParams.{field}={value!r} is invalid")):
        llms[runner].generate(PROMPTS, params, use_tqdm=False)
    assert engine.get_num_unfinished_requests() == 0


# ---- V1 = V2 = reference at the bounds ------------------------------------------------
def test_max_temperature(llms, hf):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=MAX_TEMPERATURE, seed=11,
                            ignore_eos=True)
    tokens = both(llms, params)
    assert_reference(hf, tokens, params)
    # At this temperature the choice is the noise's, not the logits': not greedy.
    assert tokens != both(llms, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                               ignore_eos=True))


@pytest.mark.parametrize("filters", [dict(top_k=40), dict(top_p=0.5), dict(min_p=0.999),
                                     dict(top_k=100, top_p=0.9, min_p=0.5)],
                         ids=["top_k", "top_p", "min_p", "all"])
def test_max_temperature_with_filters(llms, filters):
    # The filters act on scaled = x / 1e4, a nearly flat row: both runners must still
    # draw the same threshold (compared with each other only: the reference on
    # transformers' logits could differ on a token at the threshold by a rounding).
    both(llms, SamplingParams(max_tokens=MAX_TOKENS, temperature=MAX_TEMPERATURE, seed=5,
                              ignore_eos=True, **filters))


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 21)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("rep", [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY], ids=["min", "max"])
def test_repetition_penalty_at_its_bounds(llms, hf, rep, temperature, seed):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                            repetition_penalty=rep, ignore_eos=True)
    tokens = both(llms, params)
    assert_reference(hf, tokens, params)


def test_repetition_penalty_bounds_change_the_greedy_tokens(llms, hf_greedy):
    # The penalties above really acted: at 1e-3 seen tokens are boosted a thousandfold,
    # at 1e3 damped as much, and the greedy tokens change either way.
    for rep in (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, repetition_penalty=rep,
                                ignore_eos=True)
        assert both(llms, params) != hf_greedy, rep


# ---- min_tokens with stop ids ---------------------------------------------------------
MIN_TOKENS = 4
STOPS = list(range(3, 100))  # ~19% of the 512 ids (EOS = 2 is masked as well)


@pytest.mark.parametrize("temperature, seed", [(MAX_TEMPERATURE, 3), (1.0, 8)],
                         ids=["max-temperature", "seeded"])
def test_min_tokens_masks_the_stop_ids(llms, hf, temperature, seed):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                            min_tokens=MIN_TOKENS, stop_token_ids=STOPS)
    tokens = both(llms, params)
    for got in tokens:
        assert len(got) >= MIN_TOKENS
        assert not set(got[:MIN_TOKENS]) & {*STOPS, EOS}, got
    assert_reference(hf, tokens, params)


def test_without_min_tokens_those_stop_ids_are_drawn(llms):
    # The control: at MAX_TEMPERATURE with the same seed and no min_tokens, some prompt
    # stops on a stop id inside the first MIN_TOKENS tokens, so the mask above mattered.
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=MAX_TEMPERATURE, seed=3,
                            stop_token_ids=STOPS)
    tokens = both(llms, params)
    assert any(len(t) <= MIN_TOKENS and t[-1] in STOPS for t in tokens), tokens


def test_min_tokens_masks_the_greedy_tokens_themselves(llms, hf, hf_greedy):
    # Greedy, with every token greedy search picks declared a stop id: none of them may
    # appear while min_tokens holds, in either runner.
    stops = sorted({t for seq in hf_greedy for t in seq} - {EOS})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, min_tokens=MAX_TOKENS,
                            stop_token_ids=stops)
    tokens = both(llms, params)
    for got in tokens:
        assert len(got) == MAX_TOKENS and not set(got) & {*stops, EOS}, got
    assert_reference(hf, tokens, params)
