"""SamplingParams.prompt_logprobs end to end (CPU, float64, tiny-llama), both runners.

Oracle: Hugging Face transformers' forward over each whole prompt (float64, with the
patches of tests/oracles/hf_float64.py), log_softmax in float64: for every position
p >= 1 the prompt token's logprob, its rank (1 + tokens with a strictly larger logit)
and the top-k set with their logprobs, within 1e-9; position 0 is None. Checked with
chunked prefill forcing many chunks per prompt and with whole-prompt steps, with a
prefix already in the prefix cache (the request recomputes it), through preemption, and
V1 == V2 exactly (same values to the last bit), async scheduling included.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.contract.sampling_params import SamplingParams
from shared.harness.hf_reference import materialize_checkpoint
from shared.serving.engine import EngineInputError
from shared.serving.llm import LLM
from shared.serving.scheduler import Scheduler
from tests.oracles.hf_float64 import hf_logits, hf_oracle

VOCAB = 512
TOL = 1e-9
PREFIX = list(range(10, 42))  # two full blocks of 16
PROMPT_LENS = (1, 2, 9, 17, 30)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = materialize_checkpoint("tiny-llama", 0, str(tmp_path_factory.mktemp("tl")))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    oracle = hf_oracle(hf.eval(), torch.float64)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    return model_dir, oracle, prompts


def make_llm(model_dir: str, runner: str, **kwargs) -> LLM:
    kwargs = {"enable_prefix_caching": False, "max_model_len": 64, "max_num_seqs": 4,
              **kwargs}
    return LLM(model=model_dir, dtype="float64", device="cpu", seed=0, model_runner=runner,
               **kwargs)


def check_against_hf(oracle, prompt: list[int], got, k: int) -> None:
    """got: RequestOutput.prompt_logprobs of `prompt`, asked with prompt_logprobs=k."""
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    logits = hf_logits(oracle, prompt)
    lps = torch.log_softmax(logits, dim=-1)
    for p in range(1, len(prompt)):
        row, lp_row, token = logits[p - 1], lps[p - 1], prompt[p]
        entry = got[p]
        top = set(torch.topk(row, k).indices.tolist()) if k else set()
        assert set(entry) == top | {token}, f"position {p}"
        for tid, lp in entry.items():
            assert abs(lp.logprob - float(lp_row[tid])) < TOL, f"position {p}, token {tid}"
        assert entry[token].rank == 1 + int((row > row[token]).sum()), f"position {p}"
        for tid in top - {token}:  # a top-k token's rank is its place in the top-k
            assert entry[tid].rank == 1 + int((row > row[tid]).sum())


def generate(llm: LLM, prompts, k: int, max_tokens: int = 3):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=k)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunks-of-8", "whole"])
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_prompt_logprobs_equal_transformers(setup, runner, chunked) -> None:
    model_dir, oracle, prompts = setup
    budget = {"max_num_batched_tokens": 8} if chunked else {"max_num_batched_tokens": 128}
    llm = make_llm(model_dir, runner, **budget)
    outs = generate(llm, prompts, k=3)
    for prompt, out in zip(prompts, outs):
        check_against_hf(oracle, prompt, out.prompt_logprobs, 3)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_cached_prefix_is_recomputed(setup, runner) -> None:
    """A prefix already in the prefix cache: the request still gets every position (it
    takes no hit), and the request without prompt_logprobs after it still hits the
    blocks the first one registered."""
    model_dir, oracle, _ = setup
    llm = make_llm(model_dir, runner, enable_prefix_caching=True)
    generate(llm, [PREFIX + [7, 8]], k=None)  # fills the cache
    hits = []
    kv = llm.engine.scheduler.kv_cache_manager
    original = kv.get_computed_blocks

    def spy(request):
        result = original(request)
        hits.append((request.request_id, result[1]))
        return result

    kv.get_computed_blocks = spy
    prompt = PREFIX + [99, 100, 101]
    out = generate(llm, [prompt], k=2)[0]
    check_against_hf(oracle, prompt, out.prompt_logprobs, 2)
    assert hits[-1][1] == 0  # recomputed
    assert generate(llm, [PREFIX + [5]], k=None)[0].prompt_logprobs is None
    assert hits[-1][1] == 32  # plain requests still hit the shared prefix


def test_preempted_requests_keep_full_prompt_logprobs(setup, monkeypatch) -> None:
    """A KV cache too small for every request at once: requests are preempted and their
    prompts recomputed; the slots they rewrite hold the same values."""
    model_dir, oracle, prompts = setup
    preempted = []
    original = Scheduler._preempt

    def count(self, request, step):
        preempted.append(request.request_id)
        return original(self, request, step)

    monkeypatch.setattr(Scheduler, "_preempt", count)
    for runner in ("v1", "v2"):
        llm = make_llm(model_dir, runner, num_gpu_blocks_override=4, max_num_batched_tokens=16)
        outs = generate(llm, prompts[2:], k=1, max_tokens=10)
        for prompt, out in zip(prompts[2:], outs):
            check_against_hf(oracle, prompt, out.prompt_logprobs, 1)
    assert preempted


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_v1_equals_v2_exactly(setup, async_scheduling) -> None:
    """Mixed requests (with and without prompt_logprobs, different k) in one batch,
    chunked: both runners return the same values to the last bit."""
    model_dir, _, prompts = setup
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                             prompt_logprobs=k) for k in (0, None, 5, 1, 2)]
    results = {}
    for runner in ("v1", "v2"):
        llm = make_llm(model_dir, runner, max_num_batched_tokens=8,
                       async_scheduling=async_scheduling)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[runner] = [(o.prompt_logprobs, o.outputs[0].token_ids) for o in outs]
    assert results["v1"] == results["v2"]
    assert results["v1"][1][0] is None  # not asked
    assert all(len(e) == 1 for e in results["v1"][0][0][1:])  # k = 0: the token alone


def test_streaming_outputs_carry_prompt_logprobs(setup) -> None:
    model_dir, oracle, prompts = setup
    engine = make_llm(model_dir, "v2", max_num_batched_tokens=8).engine
    prompt = prompts[3]
    engine.add_request("s", prompt, SamplingParams(max_tokens=3, temperature=0.0,
                                                   ignore_eos=True, prompt_logprobs=1))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) == 3  # one per sampled token; the partial chunks report nothing
    for out in outputs:
        check_against_hf(oracle, prompt, out.prompt_logprobs, 1)


def test_validation(setup) -> None:
    model_dir, _, _ = setup
    engine = make_llm(model_dir, "v1").engine
    with pytest.raises(EngineInputError, match=rf"prompt_logprobs={VOCAB + 1} exceeds"):
        engine.add_request("big", [3, 4], SamplingParams(prompt_logprobs=VOCAB + 1))
    engine.add_request("vocab", [3, 4], SamplingParams(prompt_logprobs=VOCAB, max_tokens=1))
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    spec_engine = make_llm(model_dir, "v1", speculative_config=spec).engine
    with pytest.raises(EngineInputError, match="prompt_logprobs=0 with speculative decoding"):
        spec_engine.add_request("s", [3, 4], SamplingParams(prompt_logprobs=0))
