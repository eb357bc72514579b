"""LLM: the batch facade over LLMEngine (vLLM's offline API)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.engine import EngineInputError, LLMEngine
from shared.outputs import RequestOutput
from shared.sampling_params import SamplingParams


class LLM:
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
        prompts: Sequence[str] | Sequence[list[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
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
        request_ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(self._counter)
                self._counter += 1
                self.engine.add_request(request_id, self._tokenize(prompt), params)
                request_ids.append(request_id)
        except Exception:
            # One bad prompt refuses the whole call: the ones already queued would
            # otherwise run on, unseen, inside the next generate().
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, prompts, use_tqdm)

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
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
        stream, self.engine.stream_outputs = self.engine.stream_outputs, False
        try:
            self._step_until_done(request_ids, wanted, finished, bar)
        except BaseException:
            # generate() owns its requests: on any exception (Ctrl-C included) none may run
            # on, unseen, inside a later call, or keep its KV blocks. engine.step() has
            # already rolled itself back when the exception came from inside it.
            self.engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            self.engine.stream_outputs = stream
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
