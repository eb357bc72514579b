"""LLM: the batch facade over LLMEngine (vLLM's offline API)."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from shared.contract.outputs import RequestOutput
from shared.contract.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError
from shared.serving.engine import EngineInputError, LLMEngine
from shared.serving.llm_pooling import PoolingAPI

# One prompt as LLM.generate takes it: text, or token ids as a list / tuple of ints (NumPy
# integer scalars too), a 1-D integer NumPy array or a 1-D integer torch tensor, or vLLM's
# prompt dicts {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | Sequence[int] | np.ndarray | torch.Tensor | dict[str, Any]
_FORMS = ("a str, a list of token ids, a 1-D or 2-D integer NumPy array or torch tensor, "
          'a dict {"prompt": str} or {"prompt_token_ids": ids}, or a sequence of those')
_DICT_KEYS = ("prompt", "prompt_token_ids")


def _is_token_id(x: object) -> bool:
    """Whether x is one token id (a number, of any type: the engine checks each id's type
    and range) rather than a prompt or a batch of them."""
    if isinstance(x, (str, bytes)):  # np.str_ and np.bytes_ are np.generic too
        return False
    if isinstance(x, (np.ndarray, torch.Tensor)):
        return x.ndim == 0  # a 0-d array is a scalar, as np.asarray treats it
    return isinstance(x, (numbers.Number, np.generic))


def _has_integer_dtype(arr: np.ndarray | torch.Tensor) -> bool:
    if isinstance(arr, torch.Tensor):
        return not (arr.is_floating_point() or arr.is_complex() or arr.dtype == torch.bool)
    return arr.dtype.kind in "iu"  # not bool, float, or object (a ragged array)


def _array_rows(arr: np.ndarray | torch.Tensor, where: str, max_ndim: int) -> list[list[int]]:
    """An integer array or tensor -> its rows as lists of ints (a 1-D one is one row)."""
    kind = "torch tensor" if isinstance(arr, torch.Tensor) else "NumPy array"
    if not 1 <= arr.ndim <= max_ndim:
        accepted = "1-D" if max_ndim == 1 else "1-D (one prompt) or 2-D (one prompt per row)"
        raise EngineInputError(
            f"{where} is a {arr.ndim}-D {kind} of shape {tuple(arr.shape)}; pass a {accepted} "
            "integer array or tensor"
        )
    # An empty one goes on to the engine, which names the empty prompt, as add_request does.
    if 0 not in arr.shape and not _has_integer_dtype(arr):
        raise EngineInputError(f"{where} is a {kind} of dtype {arr.dtype}; token ids must be integers")
    rows = arr.tolist()  # Python ints, from a tensor on any device too
    return [rows] if arr.ndim == 1 else rows


def _token_list(seq: Sequence[Any], where: str) -> list[Any]:
    """A flat sequence of token ids; the engine checks each id (type and range)."""
    if isinstance(seq, bytes):
        raise EngineInputError(f"{where} is bytes; pass text as a str, or token ids as ints")
    items = list(seq)
    nested = [i for i, x in enumerate(items) if not _is_token_id(x)]
    if nested:
        raise EngineInputError(
            f"{where} holds a {type(items[nested[0]]).__name__} at index {nested[0]}; a prompt "
            "is a str or a flat list of token ids"
        )
    return items


def _dict_prompt(prompt: dict[Any, Any], where: str) -> str | list[Any]:
    """vLLM's TextPrompt / TokensPrompt: exactly one of the two keys."""
    keys = [k for k in _DICT_KEYS if k in prompt]
    extra = [k for k in prompt if k not in _DICT_KEYS]
    if extra or len(keys) != 1:
        raise EngineInputError(
            f"{where} is a dict with keys {sorted(map(str, prompt))}; a prompt dict has exactly "
            'one key: "prompt" (text) or "prompt_token_ids" (token ids)')
    value = prompt[keys[0]]
    if keys[0] == "prompt":
        if not isinstance(value, str):
            raise EngineInputError(f'{where}["prompt"] is a {type(value).__name__}; pass text '
                                   'as a str, or token ids under "prompt_token_ids"')
        return value
    if isinstance(value, str):
        raise EngineInputError(f'{where}["prompt_token_ids"] is a str; pass token ids, or '
                               'text under "prompt"')
    return _one_prompt(value, f'{where}["prompt_token_ids"]')


def _one_prompt(prompt: Any, where: str) -> str | list[Any]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        return _dict_prompt(prompt, where)
    if isinstance(prompt, (np.ndarray, torch.Tensor)):
        return _array_rows(prompt, where, max_ndim=1)[0]
    if isinstance(prompt, Sequence):
        return _token_list(prompt, where)
    raise EngineInputError(f"{where} has type {type(prompt).__name__}; pass {_FORMS}")


def normalize_prompts(prompts: Any) -> list[str | list[Any]]:
    """Every form LLM.generate takes -> one entry per prompt: a str or a list of ids.

    A flat sequence of ids, a 1-D array or a 1-D tensor is ONE prompt; a 2-D array or
    tensor is one prompt per row; any other sequence is a batch of prompts. A bad form
    raises EngineInputError before anything is queued."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, dict):
        return [_dict_prompt(prompts, "prompts")]
    if isinstance(prompts, (np.ndarray, torch.Tensor)):
        return _array_rows(prompts, "prompts", max_ndim=2)
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        raise EngineInputError(f"prompts has type {type(prompts).__name__}; pass {_FORMS}")
    items = list(prompts)
    kinds = {_is_token_id(x) for x in items}
    if kinds == {True, False}:
        raise EngineInputError(
            "prompts mixes token ids with prompts; pass one flat list of token ids, or a "
            "sequence in which every item is a prompt"
        )
    if kinds == {True}:  # a flat list of ids: one prompt
        return [_token_list(items, "prompts")]
    return [_one_prompt(p, f"prompt {i}") for i, p in enumerate(items)]


class LLM(PoolingAPI):
    """`LLM(model="tiny-llama", dtype="float64", device="cpu", seed=0, model_runner="auto")`
    takes any EngineArgs field as a keyword."""

    def __init__(self, model: str, **engine_kwargs: Any):
        from policy import EngineArgs

        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_kwargs))
        self._counter = 0

    @property
    def runner_name(self) -> str:
        return self.engine.runner_name

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. prompts: one
        prompt, a sequence of them, or a 2-D integer array / tensor (one prompt per row);
        see normalize_prompts."""
        prompts = normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise EngineInputError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; pass one "
                    "SamplingParams, or one per prompt"
                )
        return self._run(self._add_all(prompts, params_list), prompts, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation ([{"role": ..., "content": ...}, ...]) or to
        a list of them, each through the model's chat template (as `runnerlab serve`'s
        /v1/chat/completions does)."""
        from shared.serving.chat import chat_prompt_token_ids

        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise EngineInputError("messages is a conversation (a non-empty list of "
                                   '{"role", "content"} dicts) or a list of conversations')
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = [chat_prompt_token_ids(tokenizer, list(c), add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _add_all(self, prompts: Sequence[Any], params_list: Sequence[Any]) -> list[str]:
        """Queue every prompt with its params (SamplingParams, or PoolingParams on a
        pooling engine); -> the request ids. One bad prompt refuses the whole call: the
        ones already queued would otherwise run on, unseen, inside the next call."""
        request_ids: list[str] = []
        copies: dict[int, Any] = {}  # one FINAL_ONLY copy per params object, not per prompt
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(self._counter)
                self._counter += 1
                if id(params) not in copies:
                    copies[id(params)] = _final_only(request_id, params)
                params = copies[id(params)]
                self.engine.add_request(request_id, self._tokenize(prompt), params)
                request_ids.append(request_id)
        except Exception:
            self.engine.abort_request(request_ids)
            raise
        return request_ids

    def _tokenize(self, prompt: str | list[Any]) -> list[Any]:
        if isinstance(prompt, str):
            tokenizer = self.engine.tokenizer
            if tokenizer is None:
                raise EngineInputError(
                    f"model {self.engine.model_config.preset or self.engine.model_config.model_dir!r} "
                    "has no tokenizer; pass prompts as lists of token ids"
                )
            return tokenizer.encode(prompt)
        return list(prompt)

    def _run(self, request_ids: list[str], prompts: Sequence[Any], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Generating", unit="req", leave=False)
        wanted = set(request_ids)
        try:
            self._step_until_done(request_ids, wanted, finished, bar)
        except BaseException:
            # generate() owns its requests: on any exception (Ctrl-C included) none may run
            # on, unseen, inside a later call, or keep its KV blocks. engine.step() has
            # already rolled itself back when the exception came from inside it.
            self.engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            if bar is not None:
                bar.close()
        results = []
        for request_id, prompt in zip(request_ids, prompts):
            out = finished[request_id]
            if isinstance(prompt, str):
                out.prompt = prompt
            results.append(out)
        return results

    def _step_until_done(self, request_ids, wanted, finished, bar) -> None:
        while len(finished) < len(request_ids) and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)


def _final_only(request_id: str, params: Any) -> Any:
    """generate() returns each request once, finished (vLLM's LLM does the same): a copy
    of the caller's SamplingParams with output_kind FINAL_ONLY, so the engine builds no
    per-step outputs whatever the params say. The copy re-validates, as the engine's
    admission does, and a bad field is the same EngineInputError."""
    if not isinstance(params, SamplingParams) or params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    try:
        return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    except SamplingParamsError as exc:
        raise EngineInputError(f"request {request_id!r}: {exc}") from exc
