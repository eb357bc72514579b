"""`runnerlab serve` over the real SmolLM2-135M-Instruct (text, chat template, stop strings)
through the `openai` client: the streamed text equals the non-streamed text, and both
equal LLM.generate / LLM.chat with the same seed on a separate engine."""

from __future__ import annotations

import openai
import pytest

from shared import LLM, SamplingParams
from tests.shared.serving.api.live_server import LiveServer

CONFIG = dict(model="smollm2-135m", dtype="float32", device="cpu", max_model_len=256,
              model_runner="v1", max_num_seqs=8)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(**CONFIG)


class _Reference:
    """LLM.generate / LLM.chat on the server's own engine, run before the server starts
    (the engine has one owner at a time): one model load instead of two."""

    def __init__(self, llm):
        self.llm = llm
        self.outputs = {}

    def generate(self, key, prompt, **params):
        self.outputs[key] = self.llm.generate([prompt], SamplingParams(**params),
                                              use_tqdm=False)[0].outputs[0]

    def chat(self, key, messages, **params):
        self.outputs[key] = self.llm.chat(messages, SamplingParams(**params),
                                          use_tqdm=False)[0].outputs[0]


PROMPT = "The capital of France is"
CHAT = dict(max_tokens=8, temperature=0.7, seed=3)
LOGPROBS = dict(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def reference(llm):
    ref = _Reference(llm)
    ref.chat("chat", QUESTION, **CHAT)
    ref.chat("logprobs", QUESTION, logprobs=2, **LOGPROBS)
    ref.generate("greedy", PROMPT, max_tokens=8, temperature=0.0)
    greedy = ref.outputs["greedy"].text
    ref.stop = greedy.strip().split()[1][:3]  # a piece of the second word: matched mid-text
    ref.generate("stop", PROMPT, max_tokens=8, temperature=0.0, stop=[ref.stop])
    return ref


@pytest.fixture(scope="module")
def server(llm, reference):
    with LiveServer(llm.engine, "smollm2") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _streamed_text(chunks, chat: bool) -> str:
    parts = []
    for chunk in chunks:
        for choice in chunk.choices:
            parts.append((choice.delta.content or "") if chat else choice.text)
    return "".join(parts)


def test_chat_streamed_equals_whole_equals_llm_chat(client, reference):
    params = CHAT
    want = reference.outputs["chat"]
    whole = client.chat.completions.create(model="smollm2", messages=QUESTION, **params)
    assert whole.choices[0].message.content == want.text
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="smollm2", messages=QUESTION,
                                                 stream=True, **params))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert _streamed_text(chunks, chat=True) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_text_completion_with_a_stop_string(client, reference):
    """The stop string ends the text (excluded) in both forms; streaming holds back what
    could be the start of one, so no chunk ever shows text the final answer cuts."""
    prompt, stop = PROMPT, reference.stop
    params = dict(max_tokens=8, temperature=0.0, stop=[stop])
    want = reference.outputs["stop"]
    assert want.finish_reason == "stop" and stop not in want.text
    whole = client.completions.create(model="smollm2", prompt=prompt, **params)
    assert whole.choices[0].text == want.text
    assert whole.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model="smollm2", prompt=prompt, stream=True,
                                            **params))
    assert _streamed_text(chunks, chat=False) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs_carry_the_tokens_text(client, reference):
    want = reference.outputs["logprobs"]
    out = client.chat.completions.create(model="smollm2", messages=QUESTION, logprobs=True,
                                         top_logprobs=2, **LOGPROBS)
    content = out.choices[0].logprobs.content
    assert "".join(t.token for t in content) == want.text
    for entry, d, token in zip(content, want.logprobs, want.token_ids):
        assert entry.logprob == pytest.approx(d[token].logprob, abs=1e-5)
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token


def test_unsupported_chat_fields_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2,
                                       response_format={"type": "json_object"})
    assert "response_format" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=[{"role": "tool",
                                                                   "content": "x"}])
    assert "role" in str(err.value)
    ok = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_streamed_samples_with_logprobs_equal_the_whole_answer(client):
    """n = 2 with logprobs, streamed: per choice the pieces (text, logprob tokens and
    values, text offsets, token ids) concatenate to the non-streamed answer's, and the
    usage chunk counts what the whole answer counts. The stream is built from the
    engine's DELTA outputs, the answer from its CUMULATIVE ones."""
    params = dict(max_tokens=12, temperature=0.9, seed=21, n=2, logprobs=2,
                  extra_body={"return_token_ids": True})
    whole = client.completions.create(model="smollm2", prompt=PROMPT, **params)
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **params))
    got: dict[int, dict] = {}
    for chunk in chunks[:-1]:
        for ch in chunk.choices:
            g = got.setdefault(ch.index, {"text": "", "tokens": [], "lp": [], "offsets": [],
                                          "ids": []})
            g["text"] += ch.text
            g["ids"] += ch.model_extra.get("token_ids") or []
            if ch.logprobs is not None:
                g["tokens"] += ch.logprobs.tokens
                g["lp"] += ch.logprobs.token_logprobs
                g["offsets"] += ch.logprobs.text_offset
            if ch.finish_reason is not None:
                g["finish"] = ch.finish_reason
    assert sorted(got) == [0, 1]
    for want in whole.choices:
        g = got[want.index]
        assert g["text"] == want.text and g["ids"] == want.model_extra["token_ids"]
        assert g["tokens"] == want.logprobs.tokens
        assert g["lp"] == pytest.approx(want.logprobs.token_logprobs, abs=1e-6)
        assert g["offsets"] == want.logprobs.text_offset
        assert g["finish"] == want.finish_reason
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens)
