"""SamplingParams at the edges of its fields: types, non-finite values, the bounds.

Each refused value must raise SamplingParamsError naming the field and the value; each
accepted one must come out normalised (Python float / int, tiny temperatures as 0.0).
The oracle is the documented contract, written out here value by value, plus float32
arithmetic in NumPy for the claims the bounds' comments make.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from shared.contract.sampling_params import (
    GREEDY_TEMPERATURE_EPS,
    MAX_ABS_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SamplingParams,
    SamplingParamsError,
)

FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty"]
INT_FIELDS = ["max_tokens", "top_k", "min_tokens", "seed", "logprobs"]
OPTIONAL_INT_FIELDS = {"seed", "logprobs"}
F32_MAX = float(np.finfo(np.float32).max)


def refused(field: str, value: object, **extra: object) -> SamplingParamsError:
    """Construct with field=value; assert the error names the field and the value."""
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value, **extra})
    msg = str(info.value)
    assert msg.startswith(f"SamplingParams.{field}={value!r} is invalid: expected "), msg
    return info.value


def test_error_is_a_value_error():
    assert issubclass(SamplingParamsError, ValueError)


# ---- float fields ---------------------------------------------------------------------
@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e39, -1e39, 10**400],
                         ids=["inf", "-inf", "nan", "1e39", "-1e39", "10**400"])
def test_float_field_refuses_non_finite_and_huge(field, value):
    refused(field, value)


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", ["0.5", None, True, False, b"1", [0.5], 1 + 0j],
                         ids=["str", "None", "True", "False", "bytes", "list", "complex"])
def test_float_field_refuses_non_numbers(field, value):
    err = refused(field, value)
    assert f"not a {type(value).__name__}" in str(err)
    assert "a real number (int or float)" in str(err)


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.75), ("top_p", 0.25), ("min_p", 0.5), ("presence_penalty", -1.5),
    ("frequency_penalty", 2.0), ("repetition_penalty", 1.25),
])
@pytest.mark.parametrize("wrap", [float, np.float64, np.float32, np.float16],
                         ids=["float", "np.float64", "np.float32", "np.float16"])
def test_float_field_accepts_numpy_floats_as_python_floats(field, value, wrap):
    got = getattr(SamplingParams(**{field: wrap(value)}), field)
    assert type(got) is float and got == value  # the values are exact in float16


_FLOAT_FROM_INT_CASES = [("temperature", 2), ("top_p", 1), ("min_p", 0), ("presence_penalty", -2),
                         ("frequency_penalty", 1), ("repetition_penalty", 3)]


@pytest.mark.parametrize("field, value, wrap", [
    pytest.param(f, v, w, id=f"{f}={v}-{w.__name__}")
    for f, v in _FLOAT_FROM_INT_CASES for w in (int, np.int64, np.int8, np.uint16)
    if w is int or np.iinfo(w).min <= v
])
def test_float_field_accepts_integers_as_python_floats(field, value, wrap):
    got = getattr(SamplingParams(**{field: wrap(value)}), field)
    assert type(got) is float and got == float(value)


# The documented ranges, each bound and the next float beyond it.
RANGES = [
    ("temperature", 0.0, MAX_TEMPERATURE, True, True),
    ("top_p", 0.0, 1.0, False, True),
    ("min_p", 0.0, 1.0, True, True),
    ("presence_penalty", -MAX_ABS_PENALTY, MAX_ABS_PENALTY, True, True),
    ("frequency_penalty", -MAX_ABS_PENALTY, MAX_ABS_PENALTY, True, True),
    ("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, True, True),
]


@pytest.mark.parametrize("field, lo, hi, lo_closed, hi_closed", RANGES, ids=[r[0] for r in RANGES])
def test_float_field_bounds(field, lo, hi, lo_closed, hi_closed):
    below, above = math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)
    refused(field, below)
    refused(field, above)
    assert getattr(SamplingParams(**{field: hi}), field) == hi
    if lo_closed:
        assert getattr(SamplingParams(**{field: lo}), field) == lo
    else:
        refused(field, lo)
        assert getattr(SamplingParams(**{field: math.nextafter(lo, math.inf)}), field) > lo


def test_documented_constants():
    assert GREEDY_TEMPERATURE_EPS == 1e-5  # vLLM's greedy threshold
    assert MAX_TEMPERATURE == 1e4
    assert (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY) == (1e-3, 1e3)


# ---- temperature: the greedy threshold ------------------------------------------------
@pytest.mark.parametrize("t", [1e-39, 1e-45, 5e-324, 1e-30, 1e-6, math.nextafter(1e-5, 0.0),
                               np.float32(1e-39), np.float64(1e-6), -0.0],
                         ids=["1e-39", "1e-45", "min-subnormal", "1e-30", "1e-6", "below-eps",
                              "np.float32(1e-39)", "np.float64(1e-6)", "-0.0"])
def test_tiny_temperature_is_stored_as_greedy(t):
    p = SamplingParams(temperature=t)
    assert p.temperature == 0.0 and math.copysign(1.0, p.temperature) == 1.0
    assert p.is_greedy


@pytest.mark.parametrize("t", [GREEDY_TEMPERATURE_EPS, 1e-4, 0.5, MAX_TEMPERATURE])
def test_temperature_from_the_threshold_up_is_kept(t):
    p = SamplingParams(temperature=t)
    assert p.temperature == t and not p.is_greedy


def test_normalisation_survives_the_engines_revalidation():
    # The engine copies params with dataclasses.replace, which re-runs __post_init__:
    # normalised values must come back unchanged, and a tiny temperature set after
    # construction must be normalised there too.
    p = SamplingParams(temperature=np.float32(1e-39), top_k=np.int64(-1),
                       stop_token_ids=np.array([5, 7]), seed=np.uint32(3), max_tokens=np.int16(4))
    assert dataclasses.replace(p) == p
    assert (p.temperature, p.top_k, p.stop_token_ids, p.seed, p.max_tokens) == (0.0, 0, [5, 7], 3, 4)
    q = SamplingParams(temperature=0.5)
    q.temperature = 1e-39
    assert dataclasses.replace(q).temperature == 0.0
    q.temperature = math.inf
    with pytest.raises(SamplingParamsError, match=r"SamplingParams\.temperature=inf"):
        dataclasses.replace(q)


# ---- the float32 arithmetic the bounds guarantee --------------------------------------
def _f32(x: float) -> np.float32:
    return np.float32(x)


def test_bounds_are_normal_float32_numbers():
    for bound in (GREEDY_TEMPERATURE_EPS, MAX_TEMPERATURE, MIN_REPETITION_PENALTY,
                  MAX_REPETITION_PENALTY):
        b = _f32(bound)
        assert np.isfinite(b) and b >= np.finfo(np.float32).tiny, bound
    assert float(_f32(MAX_TEMPERATURE)) == MAX_TEMPERATURE  # exact


def test_float32_sampling_arithmetic_stays_finite_at_the_bounds():
    with np.errstate(over="raise", invalid="raise"):
        big = _f32(3.0e30)  # far beyond any real logit, within the documented limit
        for x in (big, -big, _f32(1e-3), _f32(-1e-3)):
            for r in (_f32(MIN_REPETITION_PENALTY), _f32(MAX_REPETITION_PENALTY)):
                penalised = x / r if x > 0 else x * r
                assert np.isfinite(penalised)
                assert np.isfinite(penalised / _f32(GREEDY_TEMPERATURE_EPS))
        # a masked logit stays -inf (never NaN) at the largest temperature
        assert np.float32(-np.inf) / _f32(MAX_TEMPERATURE) == -np.inf
        # and x / T stays a normal number from |x| = 1.2e-34 on
        assert abs(_f32(1.2e-34) / _f32(MAX_TEMPERATURE)) >= np.finfo(np.float32).tiny


def test_the_overflow_the_greedy_threshold_prevents():
    # Below the threshold float32 x / T overflows for ordinary logits: why such
    # temperatures are made greedy rather than passed on.
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.isinf(_f32(1.0) / _f32(1e-39))
        assert np.isnan(_f32(-np.inf) / _f32(np.inf))


# ---- integer fields -------------------------------------------------------------------
@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("value", [True, False, np.bool_(True), 2.0, "3", np.float64(2.0), b"1"],
                         ids=["True", "False", "np.bool_", "2.0", "str", "np.float64", "bytes"])
def test_int_field_refuses_non_integers(field, value):
    extra = {"max_tokens": 8} if field == "min_tokens" else {}
    err = refused(field, value, **extra)
    assert f"not a {type(value).__name__}" in str(err)


@pytest.mark.parametrize("field", sorted(set(INT_FIELDS) - OPTIONAL_INT_FIELDS))
def test_required_int_field_refuses_none(field):
    refused(field, None)


@pytest.mark.parametrize("field", sorted(OPTIONAL_INT_FIELDS))
def test_optional_int_field_accepts_none(field):
    assert getattr(SamplingParams(**{field: None}), field) is None


_INT_CASES = [("max_tokens", 7, 7), ("top_k", 5, 5), ("top_k", -1, 0), ("min_tokens", 3, 3),
              ("seed", 2**63 - 1, 2**63 - 1), ("logprobs", 0, 0)]
_WRAPS = {"int": int, "np.int64": np.int64, "np.int32": np.int32, "np.uint64": np.uint64}


def _fits(wrap: type, value: int) -> bool:
    return wrap is int or np.iinfo(wrap).min <= value <= np.iinfo(wrap).max


@pytest.mark.parametrize("field, value, stored, wrap", [
    pytest.param(f, v, s, w, id=f"{f}={v}-{name}")
    for f, v, s in _INT_CASES for name, w in _WRAPS.items() if _fits(w, v)
])
def test_int_field_accepts_numpy_integers_as_ints(field, value, stored, wrap):
    got = getattr(SamplingParams(**{field: wrap(value)}), field)
    assert type(got) is int and got == stored


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -1), ("top_k", -2), ("min_tokens", -1), ("min_tokens", 17),
    ("seed", -1), ("seed", 2**63), ("seed", np.uint64(2**63)), ("logprobs", -1),
])
def test_int_field_range(field, value):
    refused(field, value)


def test_max_tokens_true_is_no_longer_one():
    err = refused("max_tokens", True)
    assert "not a bool" in str(err)


# ---- stop_token_ids -------------------------------------------------------------------
@pytest.mark.parametrize("value", [None, "12", b"\x05", 7, 3.0],
                         ids=["None", "str", "bytes", "int", "float"])
def test_stop_token_ids_must_be_an_iterable_of_ids(value):
    err = refused("stop_token_ids", value)
    assert "a list of non-negative token ids" in str(err)
    assert f"not a {type(value).__name__}" in str(err)


@pytest.mark.parametrize("value, bad, index", [
    ([1, True], "bool", 1), ([1.0], "float", 0), (["3"], "str", 0), ([4, None], "NoneType", 1),
    ([np.bool_(False)], "bool", 0), ([[1]], "list", 0),
])
def test_stop_token_ids_entries_must_be_ints(value, bad, index):
    err = refused("stop_token_ids", value)
    assert re.search(rf"not a {bad}\w* at index {index}", str(err)), str(err)


def test_stop_token_ids_refuses_negative_ids():
    refused("stop_token_ids", [3, -1])


@pytest.mark.parametrize("value", [[3, 4], (3, 4), np.array([3, 4]), [np.int64(3), np.uint8(4)],
                                   range(3, 5), iter([3, 4])],
                         ids=["list", "tuple", "array", "numpy scalars", "range", "iterator"])
def test_stop_token_ids_accepts_iterables_of_integers(value):
    got = SamplingParams(stop_token_ids=value).stop_token_ids
    assert got == [3, 4] and all(type(t) is int for t in got)


# ---- ignore_eos -----------------------------------------------------------------------
@pytest.mark.parametrize("value", ["no", 0, 1, None], ids=["str", "0", "1", "None"])
def test_ignore_eos_must_be_a_bool(value):
    refused("ignore_eos", value)


def test_ignore_eos_accepts_numpy_bools():
    p = SamplingParams(ignore_eos=np.bool_(True))
    assert p.ignore_eos is True


# ---- the fields of issue 23 ------------------------------------------------------------

def test_an_unknown_field_is_named_with_the_accepted_ones():
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(max_tokens=3, best_of=2, temprature=0.5)
    msg = str(err.value)
    assert "'best_of', 'temprature'" in msg
    assert "accepted fields: max_tokens, temperature" in msg and "extra_args" in msg


@pytest.mark.parametrize("kwargs, text", [
    ({"n": 0}, "SamplingParams.n=0"),
    ({"stop": ""}, "SamplingParams.stop=''"),
    ({"stop": ["ok", 3]}, "item 1 is 3"),
    ({"logit_bias": {1: 101.0}}, "value 101.0"),
    ({"logit_bias": {-1: 1.0}}, "key -1"),
    ({"logit_bias": {1: float("nan")}}, "value nan"),
    ({"logit_bias": [1, 2]}, "not a list"),
    ({"allowed_token_ids": []}, "would allow no token"),
    ({"allowed_token_ids": [1, -2]}, "negative id at index 1"),
    ({"bad_words": "oops"}, "not a str"),
    ({"bad_words_token_ids": [[1], []]}, "an empty word"),
    ({"bad_words_token_ids": [[1, "x"]]}, "not a str at index 1 of word 0"),
    ({"prompt_logprobs": -1}, "SamplingParams.prompt_logprobs=-1"),
    ({"extra_args": [("a", 1)]}, "SamplingParams.extra_args"),
    ({"skip_special_tokens": 1}, "SamplingParams.skip_special_tokens=1"),
    ({"output_kind": "streaming"}, "SamplingParams.output_kind='streaming'"),
    ({"output_kind": 2}, "one of 'cumulative', 'delta', 'final_only'"),
])
def test_new_fields_refuse_bad_values(kwargs, text):
    with pytest.raises(SamplingParamsError, match=re.escape(text)):
        SamplingParams(**kwargs)


def test_new_fields_are_normalised():
    p = SamplingParams(stop="a", logit_bias={"5": 1, np.int64(6): np.float32(-2.5)},
                       allowed_token_ids=(3, 3, np.int32(4)), bad_words_token_ids=[(1, 2)])
    assert p.stop == ["a"]
    assert p.logit_bias == {5: 1.0, 6: -2.5} and all(type(k) is int for k in p.logit_bias)
    assert p.allowed_token_ids == [3, 4]
    assert p.bad_words_token_ids == [[1, 2]]
    assert p.uses_builtin_processors and not SamplingParams().uses_builtin_processors
    from shared.contract.sampling_params import RequestOutputKind

    assert SamplingParams(output_kind="delta").output_kind is RequestOutputKind.DELTA
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE


def test_derived_seeds_are_distinct_and_stable():
    from shared.contract.sampling_params import derive_sample_seed

    seeds = [derive_sample_seed(123, i) for i in range(64)]
    assert seeds[0] == 123 and len(set(seeds)) == 64
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_sample_seed(124, 1) != derive_sample_seed(123, 2)
