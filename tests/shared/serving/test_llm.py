"""LLM.generate takes every prompt form engine.add_request takes (issue 19).

Oracle: the same prompts as plain lists of Python ints through the same engine. A flat
sequence of ids, a 1-D array or a 1-D tensor is one prompt; a 2-D array or tensor one
prompt per row; any other sequence a batch. A bad form raises EngineInputError and
leaves nothing queued.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from shared import LLM
from shared.contract.sampling_params import SamplingParams
from shared.serving.engine import EngineInputError
from shared.serving.llm import normalize_prompts

A = [5, 6, 7, 8]
B = [100, 200, 3, 17]
C = [450, 9]  # shorter: a ragged batch
VOCAB = 512  # tiny-llama
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["v1", "v2"])
def served(request):
    llm = LLM(model="tiny-llama", dtype="float32", device="cpu", seed=0,
              model_runner=request.param, max_model_len=64)
    assert llm.runner_name == request.param
    expected = {tuple(p): tokens(llm, [p])[0] for p in (A, B, C)}
    return llm, expected


def tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert engine.get_num_unfinished_requests() == 0
    assert engine.num_free_kv_blocks() == engine.num_total_kv_blocks()


# (form, the list-of-int prompts it stands for)
GOOD_FORMS = {
    "list": ([*A], [A]),
    "tuple": (tuple(A), [A]),
    "list of np.int64": ([np.int64(t) for t in A], [A]),
    "list of mixed numpy ints": ([np.int32(A[0]), np.uint16(A[1]), *A[2:]], [A]),
    "1-D np.int64 array": (np.array(A, dtype=np.int64), [A]),
    "1-D np.int32 array": (np.array(A, dtype=np.int32), [A]),
    "1-D np.uint16 array": (np.array(A, dtype=np.uint16), [A]),
    "1-D torch int64 tensor": (torch.tensor(A), [A]),
    "1-D torch int32 tensor": (torch.tensor(A, dtype=torch.int32), [A]),
    "2-D array": (np.array([A, B]), [A, B]),
    "2-D torch tensor": (torch.tensor([A, B]), [A, B]),
    "2-D array slice": (np.array([B, A, B])[1:], [A, B]),
    "list of lists (ragged)": ([A, B, C], [A, B, C]),
    "list of arrays": ([np.array(A), np.array(C, dtype=np.int16)], [A, C]),
    "list of tensors": ([torch.tensor(B), torch.tensor(C)], [B, C]),
    "tuple of mixed forms": ((np.array(A), torch.tensor(B), tuple(C), [np.int64(t) for t in A]),
                             [A, B, C, A]),
    # vLLM's prompt dicts
    "prompt_token_ids dict": ({"prompt_token_ids": A}, [A]),
    "list of prompt dicts": ([{"prompt_token_ids": A}, {"prompt_token_ids": np.array(B)}],
                             [A, B]),
    "dicts mixed with lists": ([{"prompt_token_ids": tuple(C)}, A], [C, A]),
}


@pytest.mark.parametrize("form", list(GOOD_FORMS))
def test_every_form_normalises_to_lists_of_python_ints(form):
    prompts, expected = GOOD_FORMS[form]
    got = normalize_prompts(prompts)
    assert got == expected
    # numpy scalars may remain in a plain list (the engine converts them); arrays and
    # tensors come out as Python ints
    for p in got:
        assert all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p)


def test_a_text_prompt_dict_is_its_text():
    assert normalize_prompts({"prompt": "hi"}) == ["hi"]
    assert normalize_prompts([{"prompt": "a"}, "b", {"prompt_token_ids": A}]) == ["a", "b", A]


@pytest.mark.parametrize("form", list(GOOD_FORMS))
def test_every_form_generates_as_the_list_of_ints(served, form):
    llm, expected = served
    prompts, as_lists = GOOD_FORMS[form]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == as_lists
    assert all(type(t) is int for o in outs for t in o.prompt_token_ids)
    assert [o.outputs[0].token_ids for o in outs] == [expected[tuple(p)] for p in as_lists]
    assert_idle(llm)


def test_2d_array_takes_one_sampling_params_per_row(served):
    llm, expected = served
    params = [PARAMS, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)]
    outs = llm.generate(np.array([A, B]), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected[tuple(A)], expected[tuple(B)][:1]]
    with pytest.raises(EngineInputError, match="got 2 SamplingParams for 1 prompts"):
        llm.generate(np.array(A), params, use_tqdm=False)  # a 1-D array is ONE prompt
    assert_idle(llm)


def test_empty_batch_generates_nothing(served):
    llm, _ = served
    assert llm.generate([], PARAMS, use_tqdm=False) == []
    assert llm.generate(np.zeros((0, 4), dtype=np.int64), PARAMS, use_tqdm=False) == []


# (form, a piece of the expected message)
BAD_FORMS = {
    "float array": (np.array(A, dtype=np.float64), "NumPy array of dtype float64"),
    "float tensor": (torch.tensor(A, dtype=torch.float32), "torch tensor of dtype torch.float32"),
    "bool array": (np.array([True, False]), "dtype bool"),
    "bool tensor": (torch.tensor([True, False]), "dtype torch.bool"),
    "3-D array": (np.zeros((2, 2, 2), dtype=np.int64), "3-D NumPy array of shape (2, 2, 2)"),
    "3-D tensor": (torch.zeros(2, 2, 2, dtype=torch.int64), "3-D torch tensor of shape (2, 2, 2)"),
    "0-d array": (np.array(5), "0-D NumPy array"),
    "ragged object array": (np.array([A, C], dtype=object), "dtype object"),
    "ragged nested prompt": ([[A, C]], "prompt 0 holds a list at index 0"),
    "2-D array inside a batch": ([np.array([A, B])], "prompt 0 is a 2-D NumPy array"),
    "float array inside a batch": ([np.array(A), np.array(B, dtype=np.float32)],
                                   "prompt 1 is a NumPy array of dtype float32"),
    "ids mixed with prompts": ([5, A], "mixes token ids with prompts"),
    "bytes": (b"\x05\x06", "prompts has type bytes"),
    "bytes inside a batch": ([A, b"\x05"], "prompt 1 is bytes"),
    "set": (set(A), "prompts has type set"),
    "int": (5, "prompts has type int"),
    "None": (None, "prompts has type NoneType"),
    "dict with an unknown key": ([A, {"ids": B}], "prompt 1 is a dict with keys ['ids']"),
    "dict with both keys": ({"prompt": "x", "prompt_token_ids": A}, "exactly one key"),
    "text dict holding ids": ({"prompt": A}, 'prompts["prompt"] is a list'),
    "ids dict holding text": ([{"prompt_token_ids": "abc"}], 'prompt 0["prompt_token_ids"] is a str'),
    "ids dict holding floats": ({"prompt_token_ids": [1.5]}, "flat list of ints"),
}


@pytest.mark.parametrize("form", list(BAD_FORMS))
def test_bad_form_is_refused_before_anything_is_queued(served, form):
    llm, _ = served
    prompts, message = BAD_FORMS[form]
    with pytest.raises(EngineInputError, match=re.escape(message)):
        llm.generate(prompts, PARAMS, use_tqdm=False)
    assert_idle(llm)


@pytest.mark.parametrize("prompts, message", [
    ([np.array(A), np.array([1, VOCAB])], "outside the vocabulary"),
    ([torch.tensor(A), [1.5, 2.5]], "flat list of ints"),
    ([[np.int64(5), True]], "flat list of ints"),
    ([A, np.array([], dtype=np.int64)], "prompt is empty"),
], ids=["id beyond vocab", "list of floats", "bool id", "empty array"])
def test_a_bad_prompt_the_engine_refuses_refuses_the_whole_call(served, prompts, message):
    # The good prompt before it was already queued: it must be aborted, not left to run
    # on inside the next generate().
    llm, expected = served
    with pytest.raises(EngineInputError, match=message):
        llm.generate(prompts, PARAMS, use_tqdm=False)
    assert_idle(llm)
    assert tokens(llm, [A]) == [expected[tuple(A)]]
