"""Prompt logprobs, both runners: for every prompt position p >= 1, the raw logprob of
prompt token p given the tokens before it, its rank and the top-k.

The numerics are those of the sampled-token logprobs (runner_v1/sampler.py
compute_logprobs, runner_v2/sample/logprobs.py): raw = log_softmax of the unprocessed
logits, the logsumexp and the subtraction in float64, rounded once to the compute dtype.
Both runners call the same function here on the same rows, so their prompt logprobs are
bit-identical.

Also here, shared by the runners: which prompt_logprobs requests are live
(`PromptLogprobsRequests`, fed from the SchedulerOutput), which rows of a step's chunk
predict a prompt token (`prompt_span`), the logits of those rows only, and the
packaging of the result into ModelRunnerOutput.prompt_logprobs through the output's
host tensors (`PendingPromptLogprobs.attach`: no sync of its own).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from shared.contract.step import ModelRunnerOutput, PromptLogprobs, SchedulerOutput
from shared.sampling.top_ids import top_ids

# Rows per compute_logits pass: a long prefill chunk of one request would otherwise
# materialise [chunk, vocab] logits plus a float64 copy at once (8192 x 128256 float32
# is 4 GiB, its float64 copy 8 GiB). A GEMM's last bits may depend on its row count, so
# the slicing is part of the numerics: both runners slice the same rows the same way,
# which keeps them bit-identical.
MAX_ROWS_PER_PASS = 512

_KEYS = ("prompt_lp_ids", "prompt_lp_logprobs", "prompt_lp_ranks")


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [M, V] (any float dtype), target_ids int64 [M], num_logprobs k >= 0 ->
    (ids int64 [M, 1 + k]: the target then the top-k, logprobs [M, 1 + k] in the compute
    dtype (float64 for float64 logits, else float32), ranks int64 [M]: 1 + the number of
    tokens with a strictly larger logit than the target)."""
    assert logits.dim() == 2 and target_ids.shape == (logits.shape[0],)
    assert num_logprobs >= 0
    raw = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    lse = torch.logsumexp(raw.to(torch.float64), dim=-1, keepdim=True)
    ids = target_ids.to(torch.int64)[:, None]
    if num_logprobs > 0:
        # topk on the compute dtype, as both samplers do, so ties break the same way
        ids = torch.cat([ids, top_ids(raw, num_logprobs)], dim=1)
    logprobs = (raw.gather(1, ids).to(torch.float64) - lse).to(raw.dtype)
    ranks = (raw > raw.gather(1, ids[:, :1])).sum(dim=-1) + 1
    return ids, logprobs, ranks


def prompt_span(num_computed: int, num_scheduled: int, prompt_len: int) -> tuple[int, int]:
    """The chunk's positions p in [num_computed, num_computed + num_scheduled) with
    p + 1 < prompt_len (each predicts prompt token p + 1; the chunk's last position
    predicts the next chunk's first token, known since the prompt is): -> (first p,
    count). A resumed request's prefill past prompt_len holds outputs, not prompt."""
    end = min(num_computed + num_scheduled, prompt_len - 1)
    return num_computed, max(0, end - num_computed)


@dataclass(frozen=True)
class _Tracked:
    num_logprobs: int
    prompt_len: int
    prompt: np.ndarray | None  # the user prompt (int64), when the runner keeps it


class PromptLogprobsRequests:
    """The live requests with SamplingParams.prompt_logprobs whose prompt still has
    positions to compute; host-side, small. keep_prompt: store the user prompt too (V2,
    whose token table is on the device). An entry is dropped once its prompt is done:
    the prompt is computed again only by a resumed (preempted) request or after a failed
    step, and both come back as new requests, which are tracked again."""

    def __init__(self, keep_prompt: bool):
        self.keep_prompt = keep_prompt
        self.requests: dict[str, _Tracked] = {}

    def __bool__(self) -> bool:
        return bool(self.requests)

    def update(self, so: SchedulerOutput) -> None:
        """Finishes and preemptions first: an id may be finished and scheduled new in one
        step (abort then resubmit), two distinct requests."""
        if self.requests:
            for req_id in so.finished_req_ids | so.preempted_req_ids:
                self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            k = new.sampling_params.prompt_logprobs
            if k is None:
                self.requests.pop(new.req_id, None)
                continue
            prompt = None
            if self.keep_prompt:
                prompt = np.asarray(new.prompt_token_ids[: new.prompt_len], dtype=np.int64)
            self.requests[new.req_id] = _Tracked(k, new.prompt_len, prompt)

    def clear(self) -> None:
        self.requests.clear()

    def prompt(self, req_id: str) -> np.ndarray:
        """The stored user prompt (keep_prompt only)."""
        prompt = self.requests[req_id].prompt
        assert prompt is not None, "PromptLogprobsRequests(keep_prompt=False) stores none"
        return prompt

    def rows_for_step(
        self,
        batch_index: Callable[[str], int | None],
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        query_start: np.ndarray,
        tokens: Callable[[str, int], np.ndarray],
    ) -> PromptLogprobsRows:
        """This step's rows. batch_index: req_id -> its batch position, None when not
        scheduled; num_computed / num_scheduled / query_start: per batch position, before
        this step's tokens; tokens(req_id, batch position): an array whose entry q is the
        prompt token at position q (q < prompt_len). Requests whose prompt is done after
        this step are dropped."""
        rows = PromptLogprobsRows.empty()
        done = []
        for req_id, tracked in self.requests.items():  # the few prompt_logprobs requests
            i = batch_index(req_id)
            if i is None:
                continue
            first, count = prompt_span(int(num_computed[i]), int(num_scheduled[i]),
                                       tracked.prompt_len)
            if first + count >= tracked.prompt_len - 1:
                done.append(req_id)
            if count == 0:
                continue
            hidden_rows = np.arange(count, dtype=np.int64) + int(query_start[i])
            targets = tokens(req_id, i)[first + 1 : first + 1 + count].astype(np.int64)
            rows.add(req_id, first + 1, tracked.num_logprobs, hidden_rows, targets)
        for req_id in done:
            del self.requests[req_id]
        return rows


@dataclass
class PromptLogprobsRows:
    """One step's rows, built by a runner: per request its span, and over all of them
    the hidden-state rows and the prompt tokens they predict."""

    req_ids: list[str]
    starts: list[int]  # first prompt position predicted (first p + 1)
    counts: list[int]
    num_logprobs: list[int]
    hidden_rows: list[np.ndarray]  # per request, int64 rows of the step's hidden states
    targets: list[np.ndarray]  # per request, the prompt tokens at starts .. + counts

    @classmethod
    def empty(cls) -> PromptLogprobsRows:
        return cls([], [], [], [], [], [])

    def add(self, req_id: str, start: int, num_logprobs: int, hidden_rows: np.ndarray,
            targets: np.ndarray) -> None:
        self.req_ids.append(req_id)
        self.starts.append(start)
        self.counts.append(len(hidden_rows))
        self.num_logprobs.append(num_logprobs)
        self.hidden_rows.append(hidden_rows)
        self.targets.append(targets)


def compute_rows(
    rows: PromptLogprobsRows,
    hidden_states: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> PendingPromptLogprobs | None:
    """Logits of the rows only (MAX_ROWS_PER_PASS at a time), then their prompt
    logprobs, on the device; None when there are no rows."""
    if not rows.req_ids or sum(rows.counts) == 0:
        return None
    device = hidden_states.device
    index = torch.from_numpy(np.concatenate(rows.hidden_rows)).to(device, non_blocking=True)
    targets = torch.from_numpy(np.concatenate(rows.targets)).to(device, non_blocking=True)
    k = max(rows.num_logprobs)
    parts = []
    for lo in range(0, index.shape[0], MAX_ROWS_PER_PASS):
        sl = slice(lo, lo + MAX_ROWS_PER_PASS)
        logits = compute_logits(hidden_states.index_select(0, index[sl]))
        parts.append(compute_prompt_logprobs(logits, targets[sl], k))
    ids, lps, ranks = (torch.cat(t) if len(parts) > 1 else t[0] for t in zip(*parts))
    return PendingPromptLogprobs(rows, {_KEYS[0]: ids, _KEYS[1]: lps, _KEYS[2]: ranks})


Fill = Callable[[ModelRunnerOutput, dict], None]


class PendingPromptLogprobs:
    """A step's prompt logprobs on the device, until the output's host copy lands."""

    def __init__(self, rows: PromptLogprobsRows, tensors: dict[str, torch.Tensor]):
        self.rows = rows
        self.tensors = tensors

    def attach(self, tensors: dict, fill: Fill) -> tuple[dict, Fill]:
        """The output's device tensors and fill, extended: the prompt logprobs travel in
        the same host copy as the sampled ids (the sync or async output's own)."""
        return {**tensors, **self.tensors}, functools.partial(_fill_both, fill, self)

    def fill(self, output: ModelRunnerOutput, host: dict) -> None:
        ids, lps, ranks = (host[key].tolist() for key in _KEYS)
        offset = 0
        r = self.rows
        for req_id, start, n, k in zip(r.req_ids, r.starts, r.counts, r.num_logprobs):
            rows = slice(offset, offset + n)
            output.prompt_logprobs[req_id] = PromptLogprobs(
                start=start,
                token_ids=[row[: 1 + k] for row in ids[rows]],
                logprobs=[row[: 1 + k] for row in lps[rows]],
                ranks=ranks[rows],
            )
            offset += n


def attach_prompt_logprobs(
    pending: PendingPromptLogprobs | None, tensors: dict, fill: Fill
) -> tuple[dict, Fill]:
    """attach() when there is something to attach; else the output's own, unchanged."""
    return (tensors, fill) if pending is None else pending.attach(tensors, fill)


def _fill_both(fill: Fill, pending: PendingPromptLogprobs, output: ModelRunnerOutput,
               host: dict) -> None:
    fill(output, host)
    pending.fill(output, host)
