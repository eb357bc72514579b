"""A response's waiting outputs, merged (shared/serving/api/coalesce.py). The oracle is an
identical CUMULATIVE request of the same engine run (same prompt, same seed: the same
tokens): however a DELTA request's outputs are grouped as a lagging reader finds them,
the merged outputs' pieces concatenate to what the unmerged outputs' pieces do, exactly,
and that is its twin's final output (token ids, text, finish reason; logprobs up to the
float64 rounding of a row's position in the batch), with n = 2 samples, prompt logprobs
and a stop string. And a ResponseStream that fell behind yields one output a request."""

from __future__ import annotations

import asyncio
import random

import pytest

from policy import EngineArgs
from shared.contract.sampling_params import SamplingParams
from shared.serving.api.async_engine import ResponseStream
from shared.serving.api.coalesce import coalesce
from shared.serving.engine import LLMEngine

ENGINE = dict(model="tiny-llama", dtype="float64", device="cpu", seed=0, max_model_len=64)
PARAMS = dict(max_tokens=14, temperature=1.0, seed=5, n=2, logprobs=2, prompt_logprobs=1,
              stop=[" w41"], ignore_eos=True)


@pytest.fixture(scope="module")
def run():
    """Per step, the DELTA outputs of two requests; and their CUMULATIVE twins' finals."""
    from tests.shared.serving.metaspace_tokenizer import metaspace_tokenizer

    engine = LLMEngine.from_engine_args(EngineArgs(model_runner="v1", **ENGINE))
    engine._tokenizer, engine._tokenizer_loaded = metaspace_tokenizer(512), True
    prompts = {"a": [30 + 7 * j % 400 for j in range(9)], "b": [11, 12, 13]}
    for rid, prompt in prompts.items():
        engine.add_request(f"d{rid}", prompt, SamplingParams(**PARAMS, output_kind="delta"))
        engine.add_request(f"c{rid}", prompt, SamplingParams(**PARAMS))
    steps, finals = [], {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps.append([o for o in outs if o.request_id.startswith("d")])
        finals.update({o.request_id: o for o in outs if o.request_id.startswith("c")})
    return steps, finals


def _concatenated(outputs: list, rid: str) -> dict:
    """Per sample index: everything a stream of DELTA outputs of `rid` sent."""
    got: dict[int, dict] = {}
    prompt_logprobs = []
    for o in outputs:
        if o.request_id != rid:
            continue
        if o.prompt_logprobs is not None:
            prompt_logprobs.append(o.prompt_logprobs)
        for c in o.outputs:
            s = got.setdefault(c.index, {"ids": [], "text": "", "logprobs": [], "reason": None,
                                         "stop_reason": None, "cumulative": None})
            s["ids"] += c.token_ids
            s["text"] += c.text
            s["logprobs"] += c.logprobs or []
            # the state after the latest piece
            s["reason"], s["stop_reason"] = c.finish_reason, c.stop_reason
            s["cumulative"] = c.cumulative_logprob
    return {"samples": got, "prompt_logprobs": prompt_logprobs}


def _expected(items: list, finals: dict, rid: str) -> dict:
    """The unmerged stream's pieces, checked against the CUMULATIVE twin."""
    sent = _concatenated(items, f"d{rid}")
    twin = finals[f"c{rid}"]
    assert {c.index: (c.token_ids, c.text, c.finish_reason, c.stop_reason)
            for c in twin.outputs} == {
        i: (s["ids"], s["text"], s["reason"], s["stop_reason"])
        for i, s in sent["samples"].items()}
    assert all(abs(sent["samples"][c.index]["cumulative"] - c.cumulative_logprob) < 1e-9
               for c in twin.outputs)
    for c in twin.outputs:
        got = sent["samples"][c.index]["logprobs"]
        assert [d.keys() for d in got] == [d.keys() for d in c.logprobs]
        assert all(abs(d[t].logprob - e[t].logprob) < 1e-12 for d, e in zip(got, c.logprobs)
                   for t in d)
    assert len(sent["prompt_logprobs"]) == 1  # sent with the first output only
    return sent


def test_any_grouping_concatenates_to_the_cumulative_twin(run):
    steps, finals = run
    items = [o for step in steps for o in step]
    expected = {rid: _expected(items, finals, rid) for rid in ("a", "b")}
    reasons = {c.finish_reason for o in finals.values() for c in o.outputs}
    assert reasons == {"stop", "length"}  # a stop string cuts one sample's text
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(items)), rng.randint(0, len(items) - 1)))
        groups = [items[i:j] for i, j in zip([0, *cuts], [*cuts, len(items)])]
        merged = [o for g in groups for o in coalesce(g, {"da", "db"})]
        assert len(merged) <= len(items)
        for rid in ("a", "b"):
            assert _concatenated(merged, f"d{rid}") == expected[rid]
    whole = coalesce(items, {"da", "db"})
    assert [o.request_id for o in whole] == ["da", "db"]  # one output a request
    assert all(o.finished for o in whole)


def test_cumulative_outputs_are_superseded_and_an_error_is_a_boundary(run):
    steps, finals = run
    first, second = steps[0][0], steps[1][0]
    error = RuntimeError("step failed")
    out = coalesce([first, second, error, first, second], {first.request_id})
    assert len(out) == 3 and out[1] is error
    assert out[0].outputs == out[2].outputs  # the same two merged either side
    assert coalesce([first, second], set()) == [second]  # CUMULATIVE: the later one


def test_a_stream_that_fell_behind_yields_one_output_a_request(run):
    steps, finals = run

    async def read() -> list:
        stream = ResponseStream(engine=None)  # type: ignore[arg-type]
        stream.pending, stream._delta = {"da", "db"}, {"da", "db"}
        for step in steps:  # every step's outputs waiting before the first read
            for o in step:
                stream._queue.put_nowait(o)
        return [o async for o in stream]

    got = asyncio.run(read())
    assert [o.request_id for o in got] == ["da", "db"]
    items = [o for step in steps for o in step]
    for rid in ("a", "b"):
        assert _concatenated(got, f"d{rid}") == _expected(items, finals, rid)


def _streamed_logprobs(outputs: list) -> dict[int, dict]:
    """The completions stream's logprobs per choice, for these DELTA outputs (n = 2)."""
    import json

    from shared.serving.api.protocol import CompletionRequest
    from shared.serving.api.streaming import response_events, response_header

    req = CompletionRequest(model="m", prompt=[1, 2, 3], n=2, logprobs=2, stream=True)

    class _Stream:
        def __aiter__(self):
            return self._gen()

        async def _gen(self):
            for o in outputs:
                yield o

    async def read() -> list[str]:
        return [e async for e in response_events(_Stream(), ["da"], req,
                                                 response_header(req, "m"))]

    got: dict[int, dict] = {}
    for event in asyncio.run(read()):
        data = event[len("data: "):].strip()
        if data == "[DONE]":
            continue
        for ch in json.loads(data)["choices"]:
            g = got.setdefault(ch["index"], {"text": "", "tokens": [], "offsets": []})
            g["text"] += ch["text"]
            if ch["logprobs"] is not None:
                g["tokens"] += ch["logprobs"]["tokens"]
                g["offsets"] += ch["logprobs"]["text_offset"]
    return got


def test_streamed_logprobs_do_not_depend_on_how_outputs_were_grouped(run):
    """A piece whose text is held back (a stop string may be starting) still carries its
    tokens' logprobs: the stream sends them, merged or not, with the text offsets of
    the text as it grows (each token's offset: the characters of the tokens before it)."""
    steps, finals = run
    items = [o for step in steps for o in step if o.request_id == "da"]
    assert any(c.token_ids and not c.text for o in items for c in o.outputs)  # held pieces
    unmerged, merged = _streamed_logprobs(items), _streamed_logprobs(coalesce(items, {"da"}))
    assert unmerged == merged
    for c in finals["ca"].outputs:
        g = unmerged[c.index]
        assert len(g["tokens"]) == len(c.token_ids) and g["text"] == c.text
        lengths = [len(t) for t in g["tokens"]]
        assert g["offsets"] == [sum(lengths[:i]) for i in range(len(lengths))]


def test_outputs_that_came_before_a_failed_step_are_read_before_its_error(run):
    steps, _ = run

    async def read() -> tuple[list, BaseException | None]:
        stream = ResponseStream(engine=None)  # type: ignore[arg-type]
        stream.pending, stream._delta = {"da", "db"}, {"da", "db"}
        for o in steps[0] + steps[1]:
            stream._queue.put_nowait(o)
        stream._queue.put_nowait(RuntimeError("the step failed"))
        got = []
        try:
            async for o in stream:
                got.append(o)
        except RuntimeError as exc:
            return got, exc
        return got, None

    got, error = asyncio.run(read())
    assert error is not None and [o.request_id for o in got] == ["da", "db"]
    assert [len(o.outputs[0].token_ids) for o in got] == [2, 2]  # two steps merged
