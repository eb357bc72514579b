"""Batch-invariant mode end to end on the CPU (issue 26; TORCH attention, float32): a
needle request gives bitwise the same log-probabilities over the whole vocabulary (its
prompt's and every generated token's) alone and inside batches of 2..64 other requests,
at the first, a middle and the last position, on both runners, and V1 and V2 agree
bitwise with each other. With the mode off the same comparison fails (CPU GEMMs pick
another reduction order for one row than for many: the mode matters on the CPU too).

The oracle is the needle alone on the same engine; nothing here restates an expected
value. Prefix caching is off and the token budget covers every prompt at once, so the
needle's prompt is computed in one chunk in every batch (the TORCH backend is invariant to
the batch, not to chunking: policy/batch_invariance.py).
"""

from __future__ import annotations

import random

import pytest

from shared.contract.sampling_params import SamplingParams
from shared.serving.llm import LLM

VOCAB = 512  # the tiny presets
NEEDLE = [(7 * j + 3) % (VOCAB - 3) + 3 for j in range(23)]
NEEDLE_PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=VOCAB,
                               prompt_logprobs=VOCAB, ignore_eos=True)
# (batch size, the needle's position); sizes 2..64, positions first, middle, last
PLACES = [(2, 1), (3, 0), (8, 7), (17, 9), (64, 31), (64, 63)]


def _engine(runner: str, invariant: bool, model: str = "tiny-llama") -> LLM:
    return LLM(model, dtype="float32", device="cpu", seed=0, model_runner=runner,
               batch_invariant=invariant, enable_prefix_caching=False, max_num_seqs=64,
               max_num_batched_tokens=4096, max_model_len=128)


def _fillers(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0, ignore_eos=True)
              for _ in range(n)]
    return prompts, params


def _needle_logprobs(llm: LLM, size: int, position: int) -> list:
    """The needle's prompt and sample logprobs, run at `position` of a batch of `size`."""
    prompts, params = _fillers(size - 1, seed=size * 100 + position)
    prompts.insert(position, NEEDLE)
    params.insert(position, NEEDLE_PARAMS)
    out = llm.generate(prompts, params, use_tqdm=False)[position]
    completion = out.outputs[0]
    return [completion.token_ids, out.prompt_logprobs, completion.logprobs]


def _runs(runner: str, invariant: bool, model: str = "tiny-llama") -> dict:
    llm = _engine(runner, invariant, model)
    try:
        runs = {"alone": _needle_logprobs(llm, 1, 0)}
        for size, position in PLACES:
            runs[(size, position)] = _needle_logprobs(llm, size, position)
    finally:
        llm.engine.shutdown()
    return runs


@pytest.fixture(scope="module")
def invariant_runs() -> dict:
    return {runner: _runs(runner, True) for runner in ("v1", "v2")}


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_needle_is_bitwise_the_same_in_every_batch(invariant_runs, runner):
    runs = dict(invariant_runs[runner])
    alone = runs.pop("alone")
    assert len(alone[2]) == NEEDLE_PARAMS.max_tokens and len(alone[2][0]) == VOCAB
    differing = [place for place, got in runs.items() if got != alone]
    assert not differing, f"{runner}: the needle's logprobs changed at {differing}"


def test_v1_and_v2_agree_bitwise(invariant_runs):
    assert invariant_runs["v1"] == invariant_runs["v2"]


def test_without_the_mode_the_needle_changes_with_its_batch():
    # the comparison has teeth: the same runs with the mode off differ somewhere
    runs = _runs("v1", False)
    alone = runs.pop("alone")
    assert any(got != alone for got in runs.values())


def test_a_moe_model_is_invariant_too():
    # tiny-mixtral on the CPU runs each expert on the tokens routed to it: how many,
    # and which, depends on the whole batch
    llm = _engine("v1", True, "tiny-mixtral")
    try:
        alone = _needle_logprobs(llm, 1, 0)
        assert _needle_logprobs(llm, 17, 9) == alone
        assert _needle_logprobs(llm, 64, 63) == alone
    finally:
        llm.engine.shutdown()
