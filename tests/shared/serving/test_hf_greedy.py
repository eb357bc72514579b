"""Greedy tokens from both runners equal Hugging Face `generate()`: every tiny
architecture, float64, 8 prompts of different lengths in one batch, 32 tokens each.

The weights are the same on both sides: a seeded random HF checkpoint is written as
safetensors and runnerlab loads that directory."""

from __future__ import annotations

import random

import pytest

from shared.contract.sampling_params import SamplingParams
from shared.harness.hf_reference import HFGreedy, materialize_checkpoint
from shared.serving.llm import LLM

PROMPT_LENS = (1, 3, 6, 9, 14, 17, 22, 30)
NUM_TOKENS = 32


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3", "tiny-mixtral", "tiny-qwen2-moe"])
def checkpoint(request, tmp_path_factory):
    preset = request.param
    model_dir = materialize_checkpoint(preset, 0, str(tmp_path_factory.mktemp(preset)))
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in PROMPT_LENS]
    hf = HFGreedy(model_dir, "float64", "cpu")
    expected = [hf.generate(p, NUM_TOKENS)[0] for p in prompts]
    return model_dir, prompts, expected


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_greedy_batch_equals_transformers(checkpoint, runner) -> None:
    model_dir, prompts, expected = checkpoint
    llm = LLM(model=model_dir, dtype="float64", device="cpu", seed=0, model_runner=runner,
              enable_prefix_caching=False)
    assert llm.runner_name == runner
    outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert [len(g) for g in got] == [NUM_TOKENS] * len(prompts)
    mismatched = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
