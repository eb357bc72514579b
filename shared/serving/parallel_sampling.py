"""n > 1: one prompt, n samples. The engine runs each sample as a child request and
hands the caller one RequestOutput with n CompletionOutputs (vLLM's parallel sampling).

The children are added together, so the prompt's KV is shared through the prefix cache:
the first child's full prompt blocks are registered when they are allocated
(shared/serving/block_manager.py), and every later child takes them as hits in the same
schedule() and computes only its last, partial block. Sample i runs with
derive_sample_seed(seed, i): sample 0 is exactly the request run alone with its seed,
and each other sample is the request run alone with its derived seed.
Prompt logprobs are the same for every sample; only child 0 computes them (a request
that computes prompt logprobs takes no prefix-cache hits, so asking it of every child
would undo the sharing).
"""

from __future__ import annotations

import dataclasses

from shared.contract.outputs import CompletionOutput, RequestOutput
from shared.contract.sampling_params import RequestOutputKind, SamplingParams, derive_sample_seed


def child_request_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"  # vLLM's form


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    assert params.seed is not None  # the engine seeds every request at admission
    return dataclasses.replace(
        params, n=1, seed=derive_sample_seed(params.seed, index),
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )


class ParentRequest:
    """Collects the children's outputs into the parent's RequestOutput."""

    def __init__(self, request_id: str, n: int,
                 output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.request_id = request_id
        self.output_kind = output_kind  # the children's too
        self.child_ids = [child_request_id(request_id, i) for i in range(n)]
        self._latest: list[CompletionOutput | None] = [None] * n
        self._finished = [False] * n
        self._first: RequestOutput | None = None  # child 0's latest (prompt, logprobs)
        self._metrics: list[dict[str, float]] = [{} for _ in range(n)]

    @property
    def finished(self) -> bool:
        return all(self._finished)

    def record(self, index: int, output: RequestOutput) -> None:
        completion = dataclasses.replace(output.outputs[0], index=index)
        self._latest[index] = completion
        self._finished[index] = output.finished
        self._metrics[index] = output.metrics
        if index == 0 or self._first is None:
            self._first = output

    def output(self, indices: list[int] | None = None) -> RequestOutput:
        """Every sample's latest output; with `indices` (output_kind DELTA) only theirs,
        each the delta its child's last output carried, and the prompt logprobs only in
        the output that carries sample 0's first."""
        first = self._first
        assert first is not None
        if indices is None:
            outputs = [c if c is not None else CompletionOutput(index=i, token_ids=[])
                       for i, c in enumerate(self._latest)]
            prompt_logprobs = first.prompt_logprobs if self._latest[0] is not None else None
        else:
            outputs = [self._latest[i] for i in sorted(indices)]
            # child 0's DELTA outputs carry its prompt logprobs in the first one only
            prompt_logprobs = first.prompt_logprobs if 0 in indices else None
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(first.prompt_token_ids),
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=prompt_logprobs,
            spec_decode_stats=first.spec_decode_stats,
            metrics=self._merged_metrics(),
        )

    def _merged_metrics(self) -> dict[str, float]:
        """The parent's times: the earliest first-times over its samples, the latest last
        token, and a finish time once every sample has one."""
        out: dict[str, float] = {}
        for key, pick in (("arrival_time", min), ("first_scheduled_time", min),
                          ("first_token_time", min), ("last_token_time", max)):
            values = [m[key] for m in self._metrics if key in m]
            if values:
                out[key] = pick(values)
        finished = [m.get("finished_time") for m in self._metrics]
        if all(t is not None for t in finished):
            out["finished_time"] = max(finished)  # type: ignore[type-var]
        if "first_scheduled_time" in out:
            out["time_in_queue"] = out["first_scheduled_time"] - out["arrival_time"]
        return out
