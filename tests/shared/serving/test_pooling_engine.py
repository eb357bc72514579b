"""Pooling end to end (CPU, float64, both runners): embeddings equal transformers'
pooled hidden states (AutoModel), classification equals *ForSequenceClassification
logits, token classification equals *ForTokenClassification logits, within 1e-9; with
prompts of mixed lengths, chunked prefill over several chunks, and preemption; V1 == V2
exactly; bad inputs fail alone."""

from __future__ import annotations

import pytest
import torch

from policy import EngineArgs
from shared.contract.pooling import PoolingParams, PoolingParamsError
from shared.contract.sampling_params import SamplingParams
from shared.harness.hf_reference import materialize_checkpoint
from shared.serving.engine import EngineInputError, LLMEngine
from shared.serving.llm import LLM
from tests.oracles.hf_float64 import hf_oracle
from tests.policy.pooling_models import SEQ_CLS, TOKEN_CLS, save_classifier

TOL = 1e-9
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate([5, 23, 1, 17, 40, 9])]
# a 16-token budget: the 23- and 40-token prompts take several chunks
SMALL = dict(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, block_size=4)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return materialize_checkpoint("tiny-llama", 0, str(tmp_path_factory.mktemp("tiny-llama")))


def _classifier_dir(tmp_path_factory, kind: str) -> str:
    architecture = SEQ_CLS if kind == "seq" else TOKEN_CLS
    return save_classifier(str(tmp_path_factory.mktemp(f"tiny-llama-{kind}")), architecture)


@pytest.fixture(scope="module")
def seq_dir(tmp_path_factory) -> str:
    return _classifier_dir(tmp_path_factory, "seq")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    return _classifier_dir(tmp_path_factory, "tok")


def _llm(path, runner, task, **kw) -> LLM:
    return LLM(model=path, dtype="float64", device="cpu", seed=0, model_runner=runner,
               pooling_task=task, **{**SMALL, **kw})


@torch.no_grad()
def _hf_hidden(path, prompt) -> torch.Tensor:
    from transformers import AutoModel

    model = hf_oracle(AutoModel.from_pretrained(path), torch.float64)
    return model(torch.tensor([prompt])).last_hidden_state[0]


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embed_equals_transformers(llama_dir, runner, pooling_type):
    llm = _llm(llama_dir, runner, "embed", pooler_config={"pooling_type": pooling_type})
    outs = llm.embed(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        hidden = _hf_hidden(llama_dir, prompt)
        pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
        ref = pooled / pooled.norm()
        assert out.outputs.data.shape == ref.shape
        assert (out.outputs.data - ref).abs().max() < TOL
    assert llm.engine.num_free_kv_blocks() == llm.engine.num_total_kv_blocks()


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_classify_equals_transformers(seq_dir, runner):
    from transformers import LlamaForSequenceClassification

    hf = hf_oracle(LlamaForSequenceClassification.from_pretrained(seq_dir), torch.float64)
    raw = _llm(seq_dir, runner, "classify", pooler_config={"use_activation": False})
    soft = _llm(seq_dir, runner, "classify")
    for prompt, r, s in zip(PROMPTS, raw.classify(PROMPTS), soft.classify(PROMPTS)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert (r.outputs.data - ref).abs().max() < TOL
        assert (s.outputs.data - torch.softmax(ref, -1)).abs().max() < TOL


def test_token_classify_equals_transformers(tok_dir):
    from transformers import LlamaForTokenClassification

    hf = hf_oracle(LlamaForTokenClassification.from_pretrained(tok_dir), torch.float64)
    llm = _llm(tok_dir, "v1", "token_classify", pooler_config={"use_activation": False})
    for prompt, out in zip(PROMPTS, llm.encode(PROMPTS)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert out.outputs.data.shape == ref.shape
        assert (out.outputs.data - ref).abs().max() < TOL


def _preempt_mid_prefill(sched) -> list[str]:
    """Preempt the newest running request whose prompt is only partly computed, at every
    third schedule, three times (a pooling engine's requests leave as soon as their
    prompt is done, so a small KV pool rarely preempts one on its own; a bound, or a long
    prompt could be preempted forever)."""
    preempted: list[str] = []
    original = sched._schedule_running
    calls = [0]

    def schedule_running(step):
        calls[0] += 1
        partial = [r for r in sched.running if 0 < r.num_computed_tokens < r.num_prompt_tokens]
        if calls[0] % 3 == 0 and partial and len(preempted) < 3:
            victim = partial[-1]
            sched.running.remove(victim)
            sched._preempt(victim, step)
            preempted.append(victim.request_id)
        original(step)

    sched._schedule_running = schedule_running
    return preempted


@pytest.mark.parametrize("task", ["embed", "classify"])
def test_v1_equals_v2_with_preemption(llama_dir, seq_dir, task):
    path = llama_dir if task == "embed" else seq_dir
    results = {}
    for runner in ("v1", "v2"):
        llm = _llm(path, runner, task, pooler_config={"pooling_type": "MEAN"})
        preempted = _preempt_mid_prefill(llm.engine.scheduler)
        results[runner] = [o.outputs.data for o in llm.encode(PROMPTS * 2)]
        assert len(preempted) >= 2
    assert all(torch.equal(a, b) for a, b in zip(results["v1"], results["v2"]))
    roomy = _llm(path, "v1", task, pooler_config={"pooling_type": "MEAN"})
    for a, b in zip(results["v1"], [o.outputs.data for o in roomy.encode(PROMPTS * 2)]):
        assert (a - b).abs().max() < TOL  # preemption recomputed the same result


def test_score_is_the_cosine_of_the_embeddings(llama_dir):
    llm = _llm(llama_dir, "v2", "score")
    (score,) = llm.score(PROMPTS[0], [PROMPTS[1]])
    a, b = _hf_hidden(llama_dir, PROMPTS[0])[-1], _hf_hidden(llama_dir, PROMPTS[1])[-1]
    assert abs(float(score.outputs.data) - float(torch.cosine_similarity(a, b, dim=0))) < TOL


def test_bad_inputs_fail_alone(llama_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=llama_dir, dtype="float64", device="cpu", pooling_task="embed", **SMALL))
    engine.add_request("ok", PROMPTS[0], None)
    with pytest.raises(PoolingParamsError, match="PoolingParams.task='nope'"):
        PoolingParams(task="nope")
    bad = [
        (PROMPTS[0], PoolingParams(task="classify"), "one engine runs one task"),
        (PROMPTS[0], SamplingParams(), "pass PoolingParams"),
        ([], None, "the prompt is empty"),
        ([1] * 64, None, "max_model_len=64"),
    ]
    for i, (prompt, params, text) in enumerate(bad):
        with pytest.raises(EngineInputError, match=text):
            engine.add_request(f"bad{i}", prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert list(outs) == ["ok"] and outs["ok"].outputs.data.shape == (64,)


def test_a_generation_engine_refuses_pooling(llama_dir):
    llm = LLM(model=llama_dir, dtype="float64", device="cpu", **SMALL)
    with pytest.raises(EngineInputError, match="pooling_task='embed'"):
        llm.embed(PROMPTS[:1])
    with pytest.raises(EngineInputError, match="need a pooling engine"):
        llm.engine.add_request("x", PROMPTS[0], PoolingParams())


def test_token_embed_equals_transformers(llama_dir):
    llm = _llm(llama_dir, "v1", "token_embed")
    for prompt, out in zip(PROMPTS, llm.encode(PROMPTS)):
        hidden = _hf_hidden(llama_dir, prompt)
        ref = hidden / hidden.norm(dim=-1, keepdim=True)
        assert out.outputs.data.shape == ref.shape
        assert (out.outputs.data - ref).abs().max() < TOL


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_score_on_a_classifier_classifies_the_pair(seq_dir, runner):
    from transformers import LlamaForSequenceClassification

    hf = hf_oracle(LlamaForSequenceClassification.from_pretrained(seq_dir), torch.float64)
    llm = _llm(seq_dir, runner, "score")
    scores = llm.score(PROMPTS[0], [PROMPTS[1], PROMPTS[3]])
    for b, score in zip([PROMPTS[1], PROMPTS[3]], scores):
        with torch.no_grad():
            ref = torch.softmax(hf(torch.tensor([PROMPTS[0] + b])).logits[0], -1)
        assert (score.outputs.data - ref).abs().max() < TOL
