"""V1 under async scheduling: sampled tokens that have not reached the host yet.

With async scheduling the engine prepares step N+1 before it reads step N's tokens
back (shared/serving/engine.py). V1 builds its inputs from host token tables, so it
does what vLLM retrofitted into its V1 runner:
- step N's bookkeeping writes a PLACEHOLDER where each sampled token goes (the persistent
  batch's token table, and the request's output list, which the penalties read), so
  every count (num_tokens, outputs for min_tokens) is already exact, and keeps step N's
  sampled ids on the device;
- step N+1's input prep gathers PLACEHOLDER for those decode positions, and
  `scatter_into_input_ids` overwrites them on the device from step N's sampled ids;
- the placeholders get their values when the copy has landed (`land`): at the start of
  the step after next at the latest, or at once when this step's penalties need the
  real tokens (an event wait on a copy that overlapped the forward).

Only the most recent step's tokens can still be placeholders when inputs are prepared:
the engine keeps one step in flight and reads each step's output before it launches
the step after the next, and every older record is landed first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runner_v1.buffers import CpuGpuBuffer
from runner_v1.persistent_batch import PersistentBatch
from runner_v1.request_state import CachedRequestState
from shared.runtime.async_output import AsyncModelRunnerOutput

# Not a vocabulary id: a gathered PLACEHOLDER is either scattered over before the
# forward or caught by the consistency check in scatter_into_input_ids.
PLACEHOLDER = -1


@dataclass(frozen=True)
class _InFlightStep:
    """One step's sampled tokens on their way to the host."""

    output: AsyncModelRunnerOutput  # its fill puts the tokens in sampled_token_ids
    sampled: torch.Tensor  # int64 [num_reqs] on the device: the scatter's source
    # per sampled row: the request (identity: an id may be reused by a resubmission),
    # the row in `sampled`, and the index its token got in the request's output list
    states: tuple[CachedRequestState, ...]
    rows: tuple[int, ...]
    output_index: tuple[int, ...]
    # the sampled rows are exactly 0..len-1 (a steady decode), with these request ids
    dense_req_ids: tuple[str, ...] | None


class InFlightTokens:
    def __init__(self, max_num_tokens: int, device: torch.device):
        self._steps: list[_InFlightStep] = []
        # scatter indices, pinned: guarded by V1's input-prep barrier like every buffer
        # input prep writes (the previous step's copy out of them must be done)
        self._dst = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)
        self._src = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)

    def __bool__(self) -> bool:
        return bool(self._steps)

    def clear(self) -> None:
        self._steps.clear()

    # ---- after sampling -------------------------------------------------------------
    def record(
        self,
        batch: PersistentBatch,
        states: list[CachedRequestState],
        rows: np.ndarray,
        sampled: torch.Tensor,
        output: AsyncModelRunnerOutput,
    ) -> None:
        """Write a PLACEHOLDER for the token each row in `rows` sampled (states[i] is
        row rows[i]'s request) and remember where its value must go."""
        batch.append_output_tokens(rows, np.full(rows.shape[0], PLACEHOLDER, dtype=np.int32))
        index = []
        for state in states:  # per request, not per token
            index.append(len(state.output_token_ids))
            state.output_token_ids.append(PLACEHOLDER)
        rows_list = rows.tolist()
        dense = rows_list == list(range(len(rows_list)))
        self._steps.append(_InFlightStep(
            output, sampled, tuple(states), tuple(rows_list), tuple(index),
            tuple(state.req_id for state in states) if dense else None))

    # ---- landing --------------------------------------------------------------------
    def land(self, batch: PersistentBatch, keep_latest: bool) -> None:
        """Replace placeholders with the landed tokens: every step's, or (keep_latest)
        all but the most recent step's, whose copy may still be in flight."""
        keep = 1 if keep_latest else 0
        while len(self._steps) > keep:
            self._land_step(batch, self._steps.pop(0))

    def _land_step(self, batch: PersistentBatch, step: _InFlightStep) -> None:
        tokens = step.output.get_output().sampled_token_ids  # waits for the copy
        rows, cols, values = [], [], []
        for state, row, k in zip(step.states, step.rows, step.output_index):
            token = tokens[row][0]
            state.output_token_ids[k] = token
            # The request's batch row, if it still holds this very request (it may have
            # been moved by condense, scheduled out, preempted or replaced since).
            at = batch.req_id_to_index.get(state.req_id)
            if at is not None and batch.req_output_token_ids[at] is state.output_token_ids:
                rows.append(at)
                cols.append(state.prompt_len + k)
                values.append(token)
        if rows:
            batch.token_ids[rows, cols] = values

    # ---- input prep -----------------------------------------------------------------
    def scatter_into_input_ids(
        self,
        input_ids_host: np.ndarray,  # int32 [num_tokens]: what input prep gathered
        cu_num_tokens: np.ndarray,  # int32 [num_reqs]: end of each row's tokens
        req_ids: list[str],  # row -> request id of this step
        requests: dict[str, CachedRequestState],
        input_ids: torch.Tensor,  # int32 device: the step's input ids (written in place)
    ) -> None:
        """Overwrite, on the device, each gathered PLACEHOLDER with the token the most
        recent step sampled for it. Called after input prep started the H2D copy of
        input_ids (same stream: the copy lands first)."""
        holes = np.flatnonzero(input_ids_host == PLACEHOLDER)
        if holes.size == 0:
            return
        latest = self._steps[-1] if self._steps else None
        n = holes.size
        if (latest is not None and latest.dense_req_ids is not None and holes[-1] == n - 1
                and tuple(req_ids[:n]) == latest.dense_req_ids):
            # Steady decode: the first n tokens are the holes of rows 0..n-1 (each hole is
            # its row's one token), the same requests in the same rows as when they
            # sampled (a resubmitted id brings no hole). One slice copy, no index tensors.
            input_ids[:n].copy_(latest.sampled[:n])
            return
        src_of = {} if latest is None else {
            id(state): row for state, row in zip(latest.states, latest.rows)}
        rows_now = np.searchsorted(cu_num_tokens, holes, side="right")
        src = np.fromiter(
            (src_of.get(id(requests[req_ids[r]]), -1) for r in rows_now.tolist()),
            dtype=np.int64, count=holes.size)
        if (src < 0).any():
            r = int(rows_now[int(np.argmax(src < 0))])
            raise RuntimeError(
                f"V1 async scheduling: request {req_ids[r]!r} (row {r}) is scheduled over a "
                "token that the most recent step did not sample and that has not landed: "
                "the scheduler and the runner disagree about it"
            )
        self._dst.np[:n] = holes
        self._src.np[:n] = src
        dst, src_t = self._dst.copy_to_gpu(n), self._src.copy_to_gpu(n)
        input_ids.index_copy_(0, dst, latest.sampled.index_select(0, src_t).to(input_ids.dtype))
