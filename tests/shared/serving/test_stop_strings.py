"""Stop strings and text outputs through the engine (both runners): the SmolLM2
tokenizer on a tiny random model whose ids are all SmolLM2 tokens. The oracle is the
tokenizer's own decode of the whole output (transformers), not the incremental
detokenizer under test."""

from __future__ import annotations

import pytest

from policy import EngineArgs
from shared.contract.sampling_params import SamplingParams
from shared.serving.engine import EngineInputError, LLMEngine

ENGINE = dict(model="tiny-llama", dtype="float64", device="cpu", seed=0, max_model_len=64)
PROMPT = [(11 * j + 5) % 500 + 20 for j in range(6)]


@pytest.fixture(scope="module")
def tokenizer():
    from shared.model.gguf import find_smollm2_gguf, load_gguf_tokenizer

    return load_gguf_tokenizer(find_smollm2_gguf())


def _engine(runner: str, tokenizer) -> LLMEngine:
    engine = LLMEngine.from_engine_args(EngineArgs(model_runner=runner, **ENGINE))
    engine._tokenizer, engine._tokenizer_loaded = tokenizer, True  # the model has none
    return engine


def _run(engine: LLMEngine, params: SamplingParams):
    engine.add_request("r", PROMPT, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    return out.outputs[0]


def _split_stop(tokenizer, tokens: list[int]) -> tuple[str, int]:
    """A stop string made of the last character of one token's text and the first of the
    next one's, at the earliest token pair whose join is new in the text; -> (stop, index
    of the token that completes it)."""
    for k in range(1, len(tokens)):
        before = tokenizer.decode(tokens[:k])
        after = tokenizer.decode(tokens[: k + 1])
        new = after[len(before):]
        if before and new and after.startswith(before):
            stop = before[-1] + new[0]
            if stop not in before:
                return stop, k
    raise AssertionError("no token boundary to split a stop string over")


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_split_across_two_tokens(tokenizer, runner, include):
    plain = _run(_engine(runner, tokenizer), SamplingParams(max_tokens=20, temperature=0.0,
                                                           ignore_eos=True))
    assert plain.text == tokenizer.decode(plain.token_ids, skip_special_tokens=True)
    stop, k = _split_stop(tokenizer, plain.token_ids)
    out = _run(_engine(runner, tokenizer), SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop, "\x00never"],
        include_stop_str_in_output=include))
    assert out.token_ids == plain.token_ids[: k + 1]  # through the completing token
    assert out.finish_reason == "stop" and out.stop_reason == stop
    full = tokenizer.decode(plain.token_ids)
    cut = full.index(stop) + (len(stop) if include else 0)
    assert out.text == full[:cut]


def test_stop_strings_need_a_tokenizer():
    engine = LLMEngine.from_engine_args(EngineArgs(model_runner="v1", **ENGINE))
    with pytest.raises(EngineInputError, match="stop.*need a tokenizer"):
        engine.add_request("r", PROMPT, SamplingParams(stop=["x"]))
    with pytest.raises(EngineInputError, match="bad_words.*need a tokenizer"):
        engine.add_request("r", PROMPT, SamplingParams(bad_words=["x"]))
    assert not engine.has_unfinished_requests()


def test_text_bad_words_are_tokenised_both_ways(tokenizer):
    from shared.serving.request_params import tokenize_bad_words

    words = tokenize_bad_words(tokenizer, ["hello", " hello"])  # the second adds nothing
    assert words == [tokenizer.encode("hello", add_special_tokens=False),
                     tokenizer.encode(" hello", add_special_tokens=False)]
    assert words[0] != words[1]
    # the tiny model's vocabulary is smaller than SmolLM2's: the words' ids fall outside
    engine = _engine("v1", tokenizer)
    with pytest.raises(EngineInputError, match="bad_words_token_ids has token ids .* outside"):
        engine.add_request("r", PROMPT, SamplingParams(bad_words=["hello"]))
