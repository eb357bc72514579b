"""LLM.chat (the chat template, one conversation or several), RequestOutput.metrics (the
times follow the request's life as the scheduler runs it) and vLLM's dtype aliases."""

from __future__ import annotations

import pytest

from shared import LLM, SamplingParams
from shared.serving.chat import ChatTemplateError

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


class _TemplateTokenizer:
    """A chat template that writes [1, 100 + len(content) per message..., 2]."""

    chat_template = "fake"

    def apply_chat_template(self, conversation, tokenize=True, add_generation_prompt=True):
        ids = [1] + [100 + len(m["content"]) for m in conversation]
        return ids + ([2] if add_generation_prompt else [])

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        return " ".join(map(str, ids))

    def __len__(self):
        return 512


@pytest.fixture(scope="module")
def llm():
    llm = LLM(model="tiny-llama", dtype="float32", device="cpu", model_runner="v1",
              max_model_len=64, max_num_seqs=1)
    return llm


def test_chat_runs_the_template_then_generates(llm, monkeypatch):
    with pytest.raises(ChatTemplateError, match="no tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], PARAMS)
    monkeypatch.setattr(llm.engine, "_tokenizer", _TemplateTokenizer())
    monkeypatch.setattr(llm.engine, "_tokenizer_loaded", True)
    one = [{"role": "user", "content": "hey"}]
    two = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}]
    outs = llm.chat([one, two], PARAMS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[1, 103, 2], [1, 101, 105, 2]]
    direct = llm.generate([[1, 103, 2], [1, 101, 105, 2]], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in direct]
    single = llm.chat(one, PARAMS, add_generation_prompt=False, use_tqdm=False)
    assert [o.prompt_token_ids for o in single] == [[1, 103]]
    with pytest.raises(ValueError, match="conversation"):
        llm.chat("hi", PARAMS)


def test_metrics_follow_the_requests_life(llm):
    """max_num_seqs=1: the second request waits until the first finishes."""
    a, b = llm.generate([[5, 6, 7], [8, 9]], PARAMS, use_tqdm=False)
    for out in (a, b):
        m = out.metrics
        assert (m["arrival_time"] <= m["first_scheduled_time"] <= m["first_token_time"]
                <= m["last_token_time"] <= m["finished_time"])
        assert m["time_in_queue"] == pytest.approx(m["first_scheduled_time"] - m["arrival_time"])
    assert b.metrics["first_scheduled_time"] >= a.metrics["finished_time"]
    assert b.metrics["time_in_queue"] >= a.metrics["finished_time"] - b.metrics["arrival_time"]


def test_parallel_samples_merge_their_times(llm, monkeypatch):
    """The parent's times against each sample's own (caught on their way in): the
    earliest first-times, the latest last token and finish."""
    from shared.serving import parallel_sampling

    children: dict[int, dict[str, float]] = {}
    record = parallel_sampling.ParentRequest.record

    def spy(self, index, output):
        children[index] = dict(output.metrics)
        record(self, index, output)

    monkeypatch.setattr(parallel_sampling.ParentRequest, "record", spy)
    params = SamplingParams(max_tokens=2, temperature=1.0, n=2, seed=1, ignore_eos=True)
    (out,) = llm.generate([[5, 6]], params, use_tqdm=False)
    m, (c0, c1) = out.metrics, (children[0], children[1])
    for key in ("arrival_time", "first_scheduled_time", "first_token_time"):
        assert m[key] == min(c0[key], c1[key]), key
    for key in ("last_token_time", "finished_time"):
        assert m[key] == max(c0[key], c1[key]), key
    assert m["time_in_queue"] == pytest.approx(m["first_scheduled_time"] - m["arrival_time"])
    # max_num_seqs=1: sample 1 runs after sample 0, so the parent finishes with it
    assert c0["finished_time"] < c1["finished_time"] == m["finished_time"]
    assert c0["first_token_time"] == m["first_token_time"] < c1["first_token_time"]


@pytest.mark.parametrize("alias,name", [("half", "float16"), ("float", "float32"),
                                        ("double", "float64"), ("bfloat16", "bfloat16")])
def test_dtype_aliases(alias, name):
    from policy import EngineArgs
    from policy.cli_args import OneLineArgumentParser
    from policy.explain import add_engine_args, engine_args_from_namespace

    assert EngineArgs(model="tiny-llama", dtype=alias).dtype == name
    parser = OneLineArgumentParser(prog="t")
    add_engine_args(parser)
    ns = parser.parse_args(["--model", "tiny-llama", "--dtype", alias])
    assert engine_args_from_namespace(ns).dtype == name
