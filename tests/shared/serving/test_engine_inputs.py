"""Bad input: each is refused with an error that names the setting and the fix, and the
engine keeps serving the other requests.

The pattern of most tests: a good request is added and stepped once (it is mid-flight),
the bad one is submitted and refused, then the good one runs to completion; its tokens
must equal the same request's clean run on the same engine, nothing of the bad request
may have been queued, and every KV block must be back in the pool. Both runners: the
good request lives in V1's persistent batch or V2's state table while the bad one is
refused.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest

from shared import LLM
from shared.contract.outputs import RequestOutput
from shared.contract.sampling_params import SamplingParams, SamplingParamsError
from shared.serving.engine import MAX_MIN_TOKENS_STOP_IDS, EngineInputError

RUNNERS = ["v1", "v2"]
MAX_MODEL_LEN = 64
VOCAB = 512  # tiny-llama
EOS = 2  # tiny-llama
ENGINE_KW = dict(
    model="tiny-llama", dtype="float64", device="cpu", seed=0, max_model_len=MAX_MODEL_LEN,
    max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
)
GOOD_PROMPT = list(range(5, 13))
GOOD_PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
_ids = itertools.count()


def drain(engine) -> dict[str, RequestOutput]:
    """Step until nothing is unfinished; -> the last output of every request seen."""
    last: dict[str, RequestOutput] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return last
        for out in engine.step():
            last[out.request_id] = out
    raise AssertionError("the engine did not finish within 200 steps")


@pytest.fixture(scope="module", params=RUNNERS)
def served(request):
    llm = LLM(model_runner=request.param, **ENGINE_KW)
    assert llm.runner_name == request.param
    engine = llm.engine
    engine.add_request("clean", GOOD_PROMPT, GOOD_PARAMS)
    clean = drain(engine)["clean"].outputs[0].token_ids
    assert len(clean) == GOOD_PARAMS.max_tokens
    return SimpleNamespace(llm=llm, engine=engine, clean=clean, runner=request.param)


def assert_idle(engine) -> None:
    assert engine.get_num_unfinished_requests() == 0
    assert engine.num_free_kv_blocks() == engine.num_total_kv_blocks()


def serve_around(served, submit_bad, match: str, exc_type: type = EngineInputError):
    """Good request mid-flight, bad one refused, good one finishes as in its clean run."""
    engine = served.engine
    good_id = f"good-{next(_ids)}"
    engine.add_request(good_id, GOOD_PROMPT, GOOD_PARAMS)
    engine.step()  # prefilled, first token out: the bad request arrives mid-flight
    with pytest.raises(exc_type, match=match) as info:
        submit_bad()
    outs = drain(engine)
    assert set(outs) == {good_id}, "something of the refused request was queued"
    good = outs[good_id]
    assert good.finished and good.outputs[0].finish_reason == "length"
    assert good.outputs[0].token_ids == served.clean
    assert_idle(engine)
    return info.value


def test_clean_runs_agree_across_runners():
    # The clean run is the oracle of every test here; V1 and V2 must agree on it (the
    # differential suite compares both with transformers).
    tokens = []
    for runner in RUNNERS:
        engine = LLM(model_runner=runner, **ENGINE_KW).engine
        engine.add_request("x", GOOD_PROMPT, GOOD_PARAMS)
        tokens.append(drain(engine)["x"].outputs[0].token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == GOOD_PARAMS.max_tokens


# ---- prompts --------------------------------------------------------------------------
@pytest.mark.parametrize("length", [MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 3 * MAX_MODEL_LEN])
def test_prompt_longer_than_max_model_len(served, length):
    err = serve_around(
        served, lambda: served.engine.add_request("bad", [7] * length, GOOD_PARAMS),
        match=rf"{length} tokens .*max_model_len={MAX_MODEL_LEN}",
    )
    assert "raise max_model_len" in str(err)


def test_prompt_one_short_of_max_model_len_generates_one_token(served):
    # The boundary the error above draws: max_model_len - 1 prompt tokens leave room for one.
    engine = served.engine
    engine.add_request("edge", [7] * (MAX_MODEL_LEN - 1), SamplingParams(max_tokens=16, ignore_eos=True))
    out = drain(engine)["edge"]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert_idle(engine)


def test_empty_prompt(served):
    serve_around(served, lambda: served.engine.add_request("bad", [], GOOD_PARAMS),
                 match="prompt is empty")


@pytest.mark.parametrize("prompt, bad_id, pos", [([1, VOCAB, 3], VOCAB, 1), ([-1, 4], -1, 0),
                                                 ([3, 4, 10**6], 10**6, 2)])
def test_token_id_outside_vocabulary(served, prompt, bad_id, pos):
    serve_around(
        served, lambda: served.engine.add_request("bad", prompt, GOOD_PARAMS),
        match=rf"token id {bad_id} at position {pos} is outside the vocabulary \[0, {VOCAB}\)",
    )


@pytest.mark.parametrize("prompt", [[1.0, 2.0], [[1, 2], [3, 4]], [[1, 2], [3]], [True, False],
                                    [5, True], (np.int64(5), np.bool_(False))],
                         ids=["floats", "nested", "ragged", "bools", "int and bool",
                              "numpy int and bool"])
def test_prompt_not_a_flat_list_of_ints(served, prompt):
    serve_around(served, lambda: served.engine.add_request("bad", prompt, GOOD_PARAMS),
                 match="flat list of ints")


def test_text_prompt_to_add_request_names_token_ids(served):
    serve_around(served, lambda: served.engine.add_request("bad", "hello", GOOD_PARAMS),
                 match="token ids")


# ---- sampling parameters --------------------------------------------------------------
# (field, bad value, extra fields that make the value bad)
BAD_SAMPLING = [
    ("max_tokens", -1, {}), ("max_tokens", 0, {}),
    ("temperature", -0.5, {}), ("temperature", math.nan, {}),
    ("top_p", 0.0, {}), ("top_p", 1.5, {}),
    ("top_k", -2, {}),
    ("min_p", -0.1, {}), ("min_p", 1.5, {}),
    ("repetition_penalty", 0.0, {}), ("repetition_penalty", -1.0, {}),
    ("seed", -1, {}), ("seed", 2**63, {}),
    ("min_tokens", 5, {"max_tokens": 4}),
    ("presence_penalty", 2.5, {}), ("frequency_penalty", -2.5, {}),
    ("logprobs", -1, {}), ("stop_token_ids", [-1], {}),
]


@pytest.mark.parametrize("field, value, extra", BAD_SAMPLING)
def test_sampling_params_refused_at_construction(field, value, extra):
    with pytest.raises(SamplingParamsError, match=rf"SamplingParams\.{field}=.*expected"):
        SamplingParams(**{field: value, **extra})


# One bad value per field through the engine: a SamplingParams is a plain dataclass, so a
# field set after construction must be caught again at add_request.
_ONE_PER_FIELD = list({case[0]: case for case in BAD_SAMPLING}.values())


@pytest.mark.parametrize("field, value, extra", _ONE_PER_FIELD, ids=[c[0] for c in _ONE_PER_FIELD])
def test_sampling_params_mutated_after_construction(served, field, value, extra):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for name, v in {**extra, field: value}.items():
        setattr(params, name, v)
    serve_around(served, lambda: served.engine.add_request("bad", [3, 4, 5], params),
                 match=rf"request 'bad': SamplingParams\.{field}=")


def test_engine_keeps_its_own_copy_of_sampling_params(served):
    # A caller editing its SamplingParams after add_request must not reach the request.
    engine = served.engine
    params = dataclasses.replace(GOOD_PARAMS)
    engine.add_request("copy", GOOD_PROMPT, params)
    params.max_tokens = 1
    params.temperature = 5.0
    assert drain(engine)["copy"].outputs[0].token_ids == served.clean
    assert_idle(engine)


def test_logprobs_beyond_vocabulary(served):
    serve_around(
        served,
        lambda: served.engine.add_request("bad", [3, 4], SamplingParams(logprobs=VOCAB + 1)),
        match=rf"logprobs={VOCAB + 1} exceeds the vocabulary size {VOCAB}",
    )


def test_stop_token_id_beyond_vocabulary(served):
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[7, VOCAB])
    serve_around(served, lambda: served.engine.add_request("bad", [3, 4], params),
                 match=rf"stop_token_ids \[{VOCAB}\] are outside the vocabulary")


def test_min_tokens_with_too_many_stop_ids(served):
    stops = list(range(10, 10 + MAX_MIN_TOKENS_STOP_IDS))  # + EOS = one too many
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=stops)
    err = serve_around(served, lambda: served.engine.add_request("bad", [3, 4], params),
                       match=rf"min_tokens=2 masks {MAX_MIN_TOKENS_STOP_IDS + 1} stop token ids")
    assert "min_tokens=0" in str(err)


def test_min_tokens_with_the_most_stop_ids_is_served(served):
    # The boundary: exactly MAX_MIN_TOKENS_STOP_IDS masked ids (stops + EOS) run on both
    # runners beside the good request, and the stop ids are masked while min_tokens holds.
    engine = served.engine
    stops = [t for t in range(3, VOCAB) if t != EOS][: MAX_MIN_TOKENS_STOP_IDS - 1]
    params = SamplingParams(max_tokens=3, min_tokens=3, stop_token_ids=stops, seed=5)
    engine.add_request("good", GOOD_PROMPT, GOOD_PARAMS)
    engine.add_request("many-stops", [3, 4, 5], params)
    outs = drain(engine)
    assert outs["good"].outputs[0].token_ids == served.clean
    tokens = outs["many-stops"].outputs[0].token_ids
    assert len(tokens) == 3 and not set(tokens) & set(stops) and EOS not in tokens
    assert_idle(engine)


def test_engine_limit_fits_the_v2_sampler_table():
    from runner_v2.sample.states import DEFAULT_MAX_STOP_IDS

    assert MAX_MIN_TOKENS_STOP_IDS <= DEFAULT_MAX_STOP_IDS


def test_sampling_params_of_the_wrong_type(served):
    serve_around(served, lambda: served.engine.add_request("bad", [3, 4], {"max_tokens": 4}),
                 match="must be a SamplingParams, got dict")


# ---- request ids ----------------------------------------------------------------------
def test_duplicate_id_while_the_first_is_running(served):
    engine = served.engine
    good_id = f"dup-{next(_ids)}"
    engine.add_request(good_id, GOOD_PROMPT, GOOD_PARAMS)
    engine.step()
    with pytest.raises(EngineInputError, match=rf"{good_id!r} is already in use.*abort_request"):
        engine.add_request(good_id, [3, 4, 5], SamplingParams(max_tokens=2))
    outs = drain(engine)
    assert outs[good_id].outputs[0].token_ids == served.clean
    assert outs[good_id].prompt_token_ids == GOOD_PROMPT  # not the refused one's prompt
    # Once finished, the id is free again: a new request under it is a new request.
    engine.add_request(good_id, GOOD_PROMPT, GOOD_PARAMS)
    assert drain(engine)[good_id].outputs[0].token_ids == served.clean
    assert_idle(engine)


def test_duplicate_id_while_the_first_is_waiting(served):
    engine = served.engine
    engine.add_request("waiting", GOOD_PROMPT, GOOD_PARAMS)
    with pytest.raises(EngineInputError, match="already in use"):
        engine.add_request("waiting", GOOD_PROMPT, GOOD_PARAMS)
    outs = drain(engine)
    assert list(outs) == ["waiting"] and outs["waiting"].outputs[0].token_ids == served.clean
    assert_idle(engine)


@pytest.mark.parametrize("request_id", [7, None, b"x"])
def test_request_id_must_be_a_str(served, request_id):
    serve_around(served, lambda: served.engine.add_request(request_id, [3, 4], GOOD_PARAMS),
                 match="pass a str")


def test_abort_of_an_unknown_id_does_nothing(served):
    engine = served.engine
    good_id = f"good-{next(_ids)}"
    engine.add_request(good_id, GOOD_PROMPT, GOOD_PARAMS)
    engine.step()
    free = engine.num_free_kv_blocks()
    engine.abort_request("no-such-request")
    engine.abort_request(["nope-1", "nope-2"])
    engine.abort_request("clean")  # finished long ago
    assert engine.num_free_kv_blocks() == free
    assert engine.get_num_unfinished_requests() == 1
    outs = drain(engine)
    assert set(outs) == {good_id}  # no abort output for ids that were never live
    assert outs[good_id].outputs[0].token_ids == served.clean
    assert_idle(engine)


# ---- engine construction --------------------------------------------------------------
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("blocks", [1, 3])
def test_kv_cache_too_small_for_one_request(runner, blocks):
    # max_model_len=64 in blocks of 16 needs 4 blocks.
    with pytest.raises(EngineInputError) as info:
        LLM(model_runner=runner, num_gpu_blocks_override=blocks, **ENGINE_KW)
    msg = str(info.value)
    assert f"holds {blocks} blocks" in msg and "the 4 blocks one request" in msg
    assert "num_gpu_blocks_override" in msg and f"max_model_len={MAX_MODEL_LEN}" in msg


@pytest.mark.parametrize("runner", RUNNERS)
def test_kv_cache_of_exactly_one_request_serves_a_full_length_request(runner):
    llm = LLM(model_runner=runner, num_gpu_blocks_override=4, **ENGINE_KW)
    engine = llm.engine
    assert engine.num_total_kv_blocks() == 4
    engine.add_request("full", list(range(3, 43)), SamplingParams(max_tokens=100, ignore_eos=True))
    out = drain(engine)["full"]
    assert len(out.outputs[0].token_ids) == MAX_MODEL_LEN - 40
    assert out.outputs[0].finish_reason == "length"
    assert_idle(engine)


# ---- the LLM facade -------------------------------------------------------------------
def test_text_prompt_for_a_model_without_tokenizer(served):
    with pytest.raises(EngineInputError, match="has no tokenizer; pass prompts as lists of token ids"):
        served.llm.generate(["hello"], GOOD_PARAMS, use_tqdm=False)
    assert_idle(served.engine)


def test_a_bad_prompt_in_a_batch_queues_none_of_it(served):
    # The good prompt before the bad one was added first; it must not run on, unseen,
    # inside the next generate() call.
    llm = served.llm
    with pytest.raises(EngineInputError, match="no tokenizer"):
        llm.generate([GOOD_PROMPT, "text"], GOOD_PARAMS, use_tqdm=False)
    with pytest.raises(EngineInputError, match="outside the vocabulary"):
        llm.generate([GOOD_PROMPT, [VOCAB]], GOOD_PARAMS, use_tqdm=False)
    assert served.engine.get_num_unfinished_requests() == 0
    outs = llm.generate([GOOD_PROMPT], GOOD_PARAMS, use_tqdm=False)
    assert len(outs) == 1 and outs[0].outputs[0].token_ids == served.clean
    assert_idle(served.engine)


def test_sampling_params_list_of_the_wrong_length(served):
    with pytest.raises(EngineInputError, match="got 1 SamplingParams for 2 prompts"):
        served.llm.generate([GOOD_PROMPT, GOOD_PROMPT], [GOOD_PARAMS], use_tqdm=False)
    assert_idle(served.engine)
