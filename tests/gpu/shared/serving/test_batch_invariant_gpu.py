"""Batch-invariant mode on the GPU (issue 26; bf16, TRITON attention, GPU machine only):

- the needle: a request's logprobs over its prompt and its generated tokens are bitwise
  the same alone and inside batches of 2..256 at the first, a middle and the last
  position, through CUDA graphs (FULL for uniform decode, PIECEWISE for mixed steps) and
  eagerly, on both runners; and V1's equal V2's;
- chunking: the needle's prompt computed in 32-token chunks equals it computed in one;
- with the mode off the needle changes with its batch (the check has teeth).
The oracle is the needle alone on the same engine.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from shared.contract.sampling_params import SamplingParams
from shared.serving.llm import LLM

pytestmark = pytest.mark.gpu

MODEL = "qwen3-0.6b"  # dummy weights: its real shapes pick the kernels' configs
# padded decode batches replay FULL graphs, mixed steps up to 512 tokens PIECEWISE ones
SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
NEEDLE = [(7919 * j + 17) % 50000 + 100 for j in range(70)]
TOP = 20  # logprobs per position: the top 20 and the sampled token, bitwise
NEEDLE_PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=TOP,
                               prompt_logprobs=TOP, ignore_eos=True)
PLACES = [(2, 1), (7, 3), (64, 0), (64, 63), (256, 128), (256, 255)]


def _llm(runner: str, invariant: bool, eager: bool = False, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 8192)
    kw.setdefault("max_num_seqs", 256)
    if not eager:
        kw["cudagraph_capture_sizes"] = [s for s in SIZES if s <= kw["max_num_batched_tokens"]]
    return LLM(MODEL, load_format="dummy", dtype="bfloat16", device="cuda", seed=0,
               model_runner=runner, batch_invariant=invariant, enforce_eager=eager,
               enable_prefix_caching=False, max_model_len=512, num_gpu_blocks_override=4096,
               **kw)


def _free(llm: LLM) -> None:
    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _needle(llm: LLM, size: int, position: int) -> list:
    rng = random.Random(size * 1000 + position)
    prompts = [[rng.randrange(100, 50000) for _ in range(rng.randrange(1, 200))]
               for _ in range(size - 1)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0, ignore_eos=True)
              for _ in range(size - 1)]
    prompts.insert(position, NEEDLE)
    params.insert(position, NEEDLE_PARAMS)
    out = llm.generate(prompts, params, use_tqdm=False)[position]
    return [out.outputs[0].token_ids, out.prompt_logprobs, out.outputs[0].logprobs]


def _runs(runner: str, invariant: bool, eager: bool) -> dict:
    llm = _llm(runner, invariant, eager)
    try:
        runs = {"alone": _needle(llm, 1, 0)}
        for size, position in PLACES:
            runs[(size, position)] = _needle(llm, size, position)
        return runs
    finally:
        _free(llm)


@pytest.fixture(scope="module")
def graph_runs() -> dict:
    return {runner: _runs(runner, True, eager=False) for runner in ("v1", "v2")}


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_needle_is_bitwise_the_same_in_every_batch_with_graphs(graph_runs, runner):
    runs = dict(graph_runs[runner])
    alone = runs.pop("alone")
    differing = [place for place, got in runs.items() if got != alone]
    assert not differing, f"{runner}: the needle changed at {differing}"


def test_v1_equals_v2_bitwise(graph_runs):
    assert graph_runs["v1"]["alone"] == graph_runs["v2"]["alone"]
    assert graph_runs["v1"] == graph_runs["v2"]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_eager_equals_graphs(graph_runs, runner):
    runs = _runs(runner, True, eager=True)
    assert runs == graph_runs[runner]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_chunked_prefill_equals_one_chunk(graph_runs, runner):
    llm = _llm(runner, True, max_num_batched_tokens=32, max_num_seqs=32)
    try:
        assert _needle(llm, 1, 0) == graph_runs[runner]["alone"]
        assert _needle(llm, 7, 3) == graph_runs[runner]["alone"]
    finally:
        _free(llm)


def test_without_the_mode_the_needle_changes_with_its_batch():
    runs = _runs("v1", False, eager=False)
    alone = runs.pop("alone")
    assert any(got != alone for got in runs.values())
