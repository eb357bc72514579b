"""Request bodies -> SamplingParams, and the refusals: each names the request's field."""

from __future__ import annotations

import pytest

from shared.serving.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)

USER = [{"role": "user", "content": "hi"}]


def _refusal(model, body, *, prompt_len=3, max_model_len=64) -> APIError:
    with pytest.raises(APIError) as err:
        parse_body(model, body).sampling_params(prompt_len, max_model_len)
    assert err.value.status == 400
    return err.value


def test_openai_fields_map_to_sampling_params():
    req = parse_body(CompletionRequest, {
        "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "n": 2,
        "seed": 7, "stop": "x", "logprobs": 3, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "logit_bias": {"4": 2.0}, "top_k": 8, "min_p": 0.1,
        "repetition_penalty": 1.1, "ignore_eos": True, "stop_token_ids": [9]})
    p = req.sampling_params(3, 64)
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.seed, p.stop, p.logprobs) == (
        5, 0.5, 0.9, 2, 7, ["x"], 3)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.5, -0.5, {4: 2.0})
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos, p.stop_token_ids) == (
        8, 0.1, 1.1, True, [9])


def test_defaults_are_openais():
    p = parse_body(CompletionRequest, {"prompt": "x"}).sampling_params(3, 64)
    assert (p.max_tokens, p.temperature, p.top_p) == (16, 1.0, 1.0)
    # chat without max_tokens: whatever the context leaves
    chat = parse_body(ChatCompletionRequest, {"messages": USER})
    assert chat.sampling_params(10, 64).max_tokens == 54


def test_chat_logprobs_and_max_completion_tokens():
    chat = parse_body(ChatCompletionRequest, {"messages": USER, "logprobs": True,
                                              "top_logprobs": 4, "max_completion_tokens": 6})
    p = chat.sampling_params(3, 64)
    assert (p.logprobs, p.max_tokens) == (4, 6)
    assert parse_body(ChatCompletionRequest, {"messages": USER, "logprobs": True}
                      ).sampling_params(3, 64).logprobs == 0  # the sampled token's only


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0.0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "presence_penalty": 3.0}, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"a": 1.0}}, "logit_bias"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
])
def test_a_bad_value_names_its_field(body, param):
    assert _refusal(CompletionRequest, body).param == param


def test_chat_refusals_name_the_chat_fields():
    assert _refusal(ChatCompletionRequest, {"messages": USER, "logprobs": True,
                                            "top_logprobs": -1}).param == "top_logprobs"
    assert _refusal(ChatCompletionRequest, {"messages": USER, "top_logprobs": 2}
                    ).param == "top_logprobs"
    assert _refusal(ChatCompletionRequest, {"messages": USER, "max_tokens": 2,
                                            "max_completion_tokens": 2}
                    ).param == "max_completion_tokens"


def test_a_prompt_that_fills_the_context_is_refused_by_length():
    err = _refusal(CompletionRequest, {"prompt": [1] * 64}, prompt_len=64, max_model_len=64)
    assert err.param == "prompt" and "64 tokens" in err.message


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "x", "tools": []}, "tools", "not supported"),
    ({"prompt": "x", "echo": True}, "echo", "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "suffix"),
    ({"prompt": 5}, "prompt", "expected one of"),
    ({"prompt": "x", "temperature": "1"}, "temperature", "valid number"),
    ({"prompt": "x", "stream": 1}, "stream", "valid boolean"),
    ({"prompt": "x", "n": True}, "n", "valid integer"),
    ({"prompt": "x", "stream_options": {"include_usage": True, "x": 1}}, "stream_options",
     "not supported"),
    ({}, "prompt", "required"),
])
def test_parse_refuses_unknown_and_mistyped_fields(body, param, words):
    with pytest.raises(APIError) as err:
        parse_body(CompletionRequest, body)
    assert err.value.param == param and words in err.value.message


@pytest.mark.parametrize("messages,words", [
    ([], "at least 1"),
    ([{"role": "tool", "content": "x"}], "role"),
    ([{"role": "user"}], "required"),
])
def test_chat_messages_are_checked(messages, words):
    with pytest.raises(APIError) as err:
        parse_body(ChatCompletionRequest, {"messages": messages})
    assert err.value.param == "messages" and words in err.value.message


def test_content_parts_other_than_text_are_refused():
    req = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.conversation() == [{"role": "user", "content": "ab"}]
    req = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(APIError) as err:
        req.conversation()
    assert "image_url" in err.value.message


def test_prompt_forms():
    assert parse_body(CompletionRequest, {"prompt": "a"}).prompts() == ["a"]
    assert parse_body(CompletionRequest, {"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert parse_body(CompletionRequest, {"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert parse_body(CompletionRequest, {"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    with pytest.raises(APIError):
        parse_body(CompletionRequest, {"prompt": []}).prompts()
    with pytest.raises(APIError):
        parse_body(CompletionRequest, [1, 2])
