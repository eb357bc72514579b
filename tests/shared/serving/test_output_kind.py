"""SamplingParams.output_kind through the engine, both runners. The oracle is the
CUMULATIVE stream of an identical request in the same batch (same prompt, same seed:
seeded sampling is a function of the seed and the position, so the three requests draw
the same tokens): a FINAL_ONLY request reports exactly once, the CUMULATIVE request's
last output; a DELTA request reports on the same steps, each time what its twin's output
gained since the step before, and its pieces concatenate to the final output. Text comes
from the SmolLM2 tokenizer on a tiny random model (as in test_stop_strings.py)."""

from __future__ import annotations

import pytest

from policy import EngineArgs
from shared.contract.sampling_params import RequestOutputKind, SamplingParams
from shared.serving.engine import LLMEngine

ENGINE = dict(model="tiny-llama", dtype="float64", device="cpu", seed=0, max_model_len=64)
PROMPT = [(7 * j + 3) % 400 + 30 for j in range(9)]
KINDS = {"c": RequestOutputKind.CUMULATIVE, "d": RequestOutputKind.DELTA,
         "f": RequestOutputKind.FINAL_ONLY}


@pytest.fixture(scope="module")
def tokenizer():
    from shared.model.gguf import find_smollm2_gguf, load_gguf_tokenizer

    return load_gguf_tokenizer(find_smollm2_gguf())


def _engine(runner: str, tokenizer, **overrides) -> LLMEngine:
    engine = LLMEngine.from_engine_args(EngineArgs(model_runner=runner, **{**ENGINE, **overrides}))
    engine._tokenizer, engine._tokenizer_loaded = tokenizer, True  # the model has none
    return engine


def _outputs_by_step(engine: LLMEngine, params: SamplingParams) -> dict[str, list]:
    """One request per kind, same params; -> request id -> [(step, output), ...]."""
    for rid, kind in KINDS.items():
        engine.add_request(rid, PROMPT, SamplingParams(**{**vars(params), "output_kind": kind}))
    seen: dict[str, list] = {rid: [] for rid in KINDS}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append((step, out))
        step += 1
    return seen


def _close(a, b) -> bool:
    """Logprobs of twin requests: the same tokens and ranks; values within float64
    rounding (a row's logsumexp may round with its position in the batch)."""
    if a is None or b is None:
        return a is b
    if isinstance(a, float):
        return abs(a - b) <= 1e-12 * max(1.0, abs(a))
    return len(a) == len(b) and all(  # (a prompt's first position has None)
        x is y if x is None or y is None else x.keys() == y.keys() and all(
            x[t].rank == y[t].rank and _close(x[t].logprob, y[t].logprob) for t in x)
        for x, y in zip(a, b))


def _check_delta_against_cumulative(cum: list, delta: list, sample: int = 0) -> None:
    assert [s for s, _ in delta] == [s for s, _ in cum]  # the same steps
    prev = None
    for (_, c), (_, d) in zip(cum, delta):
        cc, dd = c.outputs[sample], d.outputs[sample]
        start = 0 if prev is None else len(prev.token_ids)
        assert dd.token_ids == cc.token_ids[start:]
        if cc.logprobs is not None:
            assert _close(dd.logprobs, cc.logprobs[start:])
            assert _close(dd.cumulative_logprob, cc.cumulative_logprob)
        assert (dd.finish_reason, dd.stop_reason) == (cc.finish_reason, cc.stop_reason)
        prev = cc
    final = cum[-1][1].outputs[sample]
    texts = [d.outputs[sample].text for _, d in delta]
    assert "".join(texts) == final.text
    for k in range(len(texts)):  # no piece shows text the final output does not have
        assert final.text.startswith("".join(texts[: k + 1]))


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_three_kinds_report_one_stream(tokenizer, runner):
    params = SamplingParams(max_tokens=14, temperature=0.9, seed=11, ignore_eos=True,
                            logprobs=2, prompt_logprobs=1)
    seen = _outputs_by_step(_engine(runner, tokenizer), params)
    cum, delta, final = seen["c"], seen["d"], seen["f"]
    assert len(cum) > 3 and cum[-1][1].finished and not cum[0][1].finished
    # FINAL_ONLY: once, finished, the cumulative stream's last output
    assert len(final) == 1 and final[0][0] == cum[-1][0]
    f, c = final[0][1].outputs[0], cum[-1][1].outputs[0]
    assert (f.token_ids, f.text, f.finish_reason) == (c.token_ids, c.text, c.finish_reason)
    assert _close(f.logprobs, c.logprobs) and _close(f.cumulative_logprob, c.cumulative_logprob)
    assert cum[-1][1].prompt_logprobs is not None
    assert _close(final[0][1].prompt_logprobs, cum[-1][1].prompt_logprobs)
    _check_delta_against_cumulative(cum, delta)
    # the prompt logprobs come with the first DELTA output only
    assert _close(delta[0][1].prompt_logprobs, cum[0][1].prompt_logprobs)
    assert all(d.prompt_logprobs is None for _, d in delta[1:])


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_delta_text_holds_back_a_stop_string_prefix(tokenizer, runner):
    plain = _outputs_by_step(_engine(runner, tokenizer), SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True))["c"][-1][1].outputs[0]
    stop = plain.text[len(plain.text) // 2:][:3]  # three characters from the middle
    assert len(stop) == 3 and stop not in plain.text[: len(plain.text) // 2]
    seen = _outputs_by_step(_engine(runner, tokenizer), SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]))
    cum, delta = seen["c"], seen["d"]
    assert cum[-1][1].outputs[0].finish_reason == "stop"
    _check_delta_against_cumulative(cum, delta)
    assert stop not in "".join(d.outputs[0].text for _, d in delta)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_parallel_samples_in_each_kind(tokenizer, runner):
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    first = _outputs_by_step(_engine(runner, tokenizer), params)["c"][-1][1].outputs
    # a stop id that ends sample 0 early while another sample runs on: a DELTA output
    # must then leave the finished sample out
    stop = next(t for t in first[0].token_ids[2:] if any(t not in o.token_ids for o in first))
    params = SamplingParams(**{**vars(params), "stop_token_ids": [stop]})
    seen = _outputs_by_step(_engine(runner, tokenizer), params)
    cum, delta, final = seen["c"], seen["d"], seen["f"]
    last = cum[-1][1]
    assert len(last.outputs) == 3 and len({len(o.token_ids) for o in last.outputs}) > 1
    assert len(final) == 1 and final[0][1].finished
    assert [o.token_ids for o in final[0][1].outputs] == [o.token_ids for o in last.outputs]
    # DELTA: each output names the samples it carries; per sample the pieces concatenate
    for i in range(3):
        pieces = [o for _, out in delta for o in out.outputs if o.index == i]
        assert sum((p.token_ids for p in pieces), []) == last.outputs[i].token_ids
        assert "".join(p.text for p in pieces) == last.outputs[i].text
    assert delta[-1][1].finished


def test_generate_returns_finished_outputs_whatever_the_kind(tokenizer):
    from shared.serving.llm import LLM

    llm = LLM(model="tiny-llama", model_runner="v1", dtype="float64", device="cpu", seed=0,
              max_model_len=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, output_kind="delta")
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    engine = LLMEngine.from_engine_args(EngineArgs(model_runner="v1", **ENGINE))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=6, temperature=0.0,
                                                   ignore_eos=True))
    last = None
    while engine.has_unfinished_requests():
        last = next(iter(engine.step()), last)
    assert out.finished and out.outputs[0].token_ids == last.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 6
    assert params.output_kind is RequestOutputKind.DELTA  # the caller's params untouched


class _CountingTokenizer:
    """The tokenizer, recording the length of every id list it decodes."""

    def __init__(self, inner) -> None:
        self.inner, self.lengths = inner, []

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


@pytest.mark.parametrize("kind", ["cumulative", "delta"])
def test_reported_text_grows_a_token_at_a_time(tokenizer, kind):
    """An output that reports every step must not decode its whole output again at each
    step (quadratic in the length, the engine loop's cost under a server's streams): its
    text grows token by token, each decode a short window; the final text is the whole
    output's decode. FINAL_ONLY decodes once, at the end."""
    counting = _CountingTokenizer(tokenizer)
    engine = _engine("v1", counting)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, output_kind=kind)
    engine.add_request("r", PROMPT, params)
    engine.add_request("f", PROMPT, SamplingParams(**{**vars(params), "output_kind": "final_only"}))
    texts, final = [], None
    while engine.has_unfinished_requests():
        counting.lengths.clear()
        outs = engine.step()
        for out in outs:
            if out.request_id == "r":
                texts.append(out.outputs[0].text)
                ids = out.outputs[0].token_ids
            elif out.finished:
                final = out.outputs[0]
        if not any(out.finished for out in outs):  # FINAL_ONLY's one decode is at the end
            assert max(counting.lengths, default=0) <= 12, counting.lengths
    whole = "".join(texts) if kind == "delta" else texts[-1]
    assert len(final.token_ids) == 40 and whole == final.text
    assert final.text == tokenizer.decode(final.token_ids, skip_special_tokens=True)
    if kind == "cumulative":
        assert ids == final.token_ids
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_every_output_kind_has_the_text_of_the_output_in_context(runner):
    """With a tokenizer whose decode of the output alone differs from its decode after the
    prompt (SentencePiece's first-piece space), the text is the same whatever the output
    kind and whether stop strings are watched: the output decoded in the prompt's context,
    as the CUMULATIVE text grows (vLLM's one detokenizer path)."""
    from tests.shared.serving.metaspace_tokenizer import metaspace_tokenizer

    sp = metaspace_tokenizer(512)
    engine = _engine(runner, sp)
    base = dict(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    variants = {"c": dict(output_kind="cumulative"), "d": dict(output_kind="delta"),
                "f": dict(output_kind="final_only"),
                "f_stop": dict(output_kind="final_only", stop=["never there"])}
    prompt = [p for p in PROMPT if p % 3]  # pieces that start a word
    for rid, extra in variants.items():
        engine.add_request(rid, prompt, SamplingParams(**base, **extra))
    texts: dict[str, str] = dict.fromkeys(variants, "")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            texts[out.request_id] = texts[out.request_id] + c.text if out.request_id == "d" \
                else c.text
            if out.finished:
                finals[out.request_id] = c.token_ids if out.request_id != "d" else None
    ids = finals["c"]
    assert finals["f"] == finals["f_stop"] == ids  # one seed: the same tokens
    in_context = sp.decode(prompt + ids)[len(sp.decode(prompt)):]
    assert sp.decode(ids) != in_context  # the case that matters here
    assert texts == dict.fromkeys(variants, in_context)
