"""Admission: the checks add_request runs before anything is queued, so a bad request
raises EngineInputError (naming the setting and the fix) and the requests in flight are
untouched. The model-independent field checks live in SamplingParams itself, the
vocabulary / tokenizer / table-size ones in shared/serving/request_params.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from shared.contract.pooling import PoolingParams
from shared.contract.sampling_params import SamplingParams, SamplingParamsError
from shared.serving.request_params import (
    check_text_fields,
    check_vocabulary_fields,
    spec_decode_unsupported,
    tokenize_bad_words,
)

# While a request has fewer than min_tokens outputs, its stop ids (and EOS) are masked.
# V2's sampler keeps them in a fixed-width per-row table of this many ids
# (runner_v2.sample.states.DEFAULT_MAX_STOP_IDS); the engine refuses more at admission so
# that both runners accept exactly the same requests and none fails mid-step.
MAX_MIN_TOKENS_STOP_IDS = 128


class EngineInputError(ValueError):
    """A request the engine refuses; the message names the setting and the fix. The
    engine keeps serving the other requests."""



def validate_prompt(request_id: str, prompt: Any, max_model_len: int, vocab_size: int) -> list[int]:
    """The prompt as a list of ints, or EngineInputError naming what is wrong."""
    if isinstance(prompt, str):
        raise EngineInputError(
            f"request {request_id!r}: the prompt is text; add_request takes token ids "
            "(tokenize it first, or use LLM.generate, which tokenizes for models with a tokenizer)"
        )
    try:
        arr = np.asarray(prompt)
    except (TypeError, ValueError) as exc:  # e.g. a ragged nested list
        raise EngineInputError(
            f"request {request_id!r}: prompt token ids must be a flat list of ints ({exc})"
        ) from exc
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise EngineInputError(
            f"request {request_id!r}: prompt token ids must be a flat list of ints, got an "
            f"array of shape {arr.shape} and dtype {arr.dtype}"
        )
    if isinstance(prompt, (list, tuple)):
        # np.asarray([5, True]) is an int64 array: a bool among ints shows only by element
        pos = next((i for i, t in enumerate(prompt) if isinstance(t, (bool, np.bool_))), None)
        if pos is not None:
            raise EngineInputError(
                f"request {request_id!r}: prompt token ids must be a flat list of ints, got "
                f"the bool {prompt[pos]!r} at position {pos}"
            )
    if arr.size == 0:
        raise EngineInputError(f"request {request_id!r}: the prompt is empty; pass at least one token")
    if arr.size >= max_model_len:
        raise EngineInputError(
            f"request {request_id!r}: prompt of {arr.size} tokens leaves no room to generate "
            f"within max_model_len={max_model_len}; shorten the prompt or raise max_model_len"
        )
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        pos = int(np.argmax(bad))
        raise EngineInputError(
            f"request {request_id!r}: token id {int(arr[pos])} at position {pos} is outside "
            f"the vocabulary [0, {vocab_size})"
        )
    return arr.tolist()


def validate_params(request_id: str, sampling_params: Any, engine: Any) -> SamplingParams:
    """A private, re-validated copy: a SamplingParams mutated after construction (it is a
    plain dataclass) is checked again, and the caller's later edits cannot reach a
    request in flight. Also the limits that depend on the model. `engine`: the
    LLMEngine (its vocab_size, eos_token_id, tokenizer, num_speculative_tokens and the
    custom processors' classes)."""
    vocab_size = engine.vocab_size
    if not isinstance(sampling_params, SamplingParams):
        raise EngineInputError(
            f"request {request_id!r}: sampling_params must be a SamplingParams, "
            f"got {type(sampling_params).__name__}"
        )
    try:
        params = dataclasses.replace(sampling_params)  # re-runs __post_init__ validation
    except SamplingParamsError as exc:
        raise EngineInputError(f"request {request_id!r}: {exc}") from exc
    bad_stops = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad_stops:
        # The samplers index logits by stop id (min_tokens masking): out of range would
        # be an out-of-bounds write on the device.
        raise EngineInputError(
            f"request {request_id!r}: SamplingParams.stop_token_ids {bad_stops} are outside "
            f"the vocabulary [0, {vocab_size})"
        )
    try:
        check_vocabulary_fields(params, vocab_size)
        check_text_fields(params, engine.tokenizer, engine._model_name)
        if params.bad_words:
            # the runners read token sequences only: the words' tokens join the ids
            words = list(params.bad_words_token_ids or [])
            for ids in tokenize_bad_words(engine.tokenizer, params.bad_words):
                if ids not in words:
                    words.append(ids)
            params.bad_words_token_ids = words
            check_vocabulary_fields(params, vocab_size)  # the merged count
        for cls in engine._processor_classes:
            validate = getattr(cls, "validate_params", None)
            if validate is not None:
                validate(params, vocab_size)
    except ValueError as exc:
        raise EngineInputError(f"request {request_id!r}: {exc}") from exc
    if engine.num_speculative_tokens:
        _check_spec_decode_params(request_id, params)
    if params.min_tokens > 0:
        masked = set(params.stop_token_ids)
        if engine.eos_token_id is not None and not params.ignore_eos:
            masked.add(engine.eos_token_id)
        if len(masked) > MAX_MIN_TOKENS_STOP_IDS:
            raise EngineInputError(
                f"request {request_id!r}: SamplingParams.min_tokens={params.min_tokens} masks "
                f"{len(masked)} stop token ids (stop_token_ids and EOS); at most "
                f"{MAX_MIN_TOKENS_STOP_IDS} are supported with min_tokens > 0: pass fewer "
                "stop_token_ids or set min_tokens=0"
            )
    return params

def _check_spec_decode_params(request_id: str, params: SamplingParams) -> None:
    """What the rejection samplers do not implement yet is refused, never ignored."""
    unsupported = spec_decode_unsupported(params)
    if unsupported:
        raise EngineInputError(
            f"request {request_id!r}: {', '.join(unsupported)} with speculative decoding "
            "is not supported yet; drop them from SamplingParams or run the engine with "
            "speculative_config=None"
        )



# What a pooling request carries as its SamplingParams: the runners' per-request tables
# want one, and a pooling request never samples, so nothing reads these values.
POOLING_PLACEHOLDER_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, seed=0)


def validate_pooling_params(request_id: str, params: Any, engine_task: str | None) -> PoolingParams:
    """A pooling request on a pooling engine: PoolingParams (or None) whose task, when
    given, is the engine's."""
    if engine_task is None:
        raise EngineInputError(
            f"request {request_id!r}: PoolingParams need a pooling engine; create it with "
            "pooling_task='embed' (or classify, score, token_embed, token_classify)"
        )
    if params is None:
        return PoolingParams(task=engine_task)
    if not isinstance(params, PoolingParams):
        raise EngineInputError(
            f"request {request_id!r}: this engine runs pooling_task={engine_task!r}; pass "
            f"PoolingParams (or None), not {type(params).__name__}"
        )
    if params.task is not None and params.task != engine_task:
        raise EngineInputError(
            f"request {request_id!r}: PoolingParams.task={params.task!r} but the engine runs "
            f"pooling_task={engine_task!r}; one engine runs one task"
        )
    return params
