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
            s = got.setdefault(c.index, {"ids": [], "text": "", "logprobs": [], "reason": None})
            s["ids"] += c.token_ids
            s["text"] += c.text
            s["logprobs"] += c.logprobs or []
            s["reason"] = c.finish_reason
    return {"samples": got, "prompt_logprobs": prompt_logprobs}


def _expected(items: list, finals: dict, rid: str) -> dict:
    """The unmerged stream's pieces, checked against the CUMULATIVE twin."""
    sent = _concatenated(items, f"d{rid}")
    twin = finals[f"c{rid}"]
    assert {c.index: (c.token_ids, c.text, c.finish_reason) for c in twin.outputs} == {
        i: (s["ids"], s["text"], s["reason"]) for i, s in sent["samples"].items()}
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
