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

With speculative decoding (draft_model; runner_v1/spec_decode/async_spec.py) a verify
row holds 1 + d placeholders, the scheduler's optimistic count (every draft accepted):
the record keeps how many of them the device rejected, so the next step's input prep
can move that row's positions back (`rejected_by_row`), and landing drops them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from runner_v1.buffers import CpuGpuBuffer
from runner_v1.persistent_batch import PersistentBatch
from runner_v1.request_state import CachedRequestState
from runner_v1.spec_decode.metadata import append_accepted
from shared.runtime.async_output import AsyncModelRunnerOutput
from shared.runtime.host_buffers import copy_packed_to_device

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
    # speculative steps: placeholders per sampled row (1 + its drafts), and the drafts
    # the device rejected per batch row (int32 [num_reqs]); None for a plain step
    num_placeholders: tuple[int, ...] | None = None
    num_rejected: torch.Tensor | None = None


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
        num_placeholders: np.ndarray | None = None,
        num_rejected: torch.Tensor | None = None,
    ) -> None:
        """Write a PLACEHOLDER for the token each row in `rows` sampled (states[i] is
        row rows[i]'s request) and remember where its value must go. A speculative step
        passes num_placeholders (per sampled row: 1 + its drafts) and num_rejected (the
        device's count per batch row); `sampled` is then each row's last token."""
        if num_placeholders is None:
            batch.append_output_tokens(rows, np.full(rows.shape[0], PLACEHOLDER, dtype=np.int32))
            counts = [1] * rows.shape[0]
        else:
            counts = num_placeholders.tolist()
            holes = np.full((rows.shape[0], max(counts, default=1)), PLACEHOLDER, dtype=np.int32)
            append_accepted(batch, rows, holes, num_placeholders)
        index = []
        for state, c in zip(states, counts):  # per request, not per token
            index.append(len(state.output_token_ids))
            state.output_token_ids.extend([PLACEHOLDER] * c)
        rows_list = rows.tolist()
        dense = rows_list == list(range(len(rows_list)))
        self._steps.append(_InFlightStep(
            output, sampled, tuple(states), tuple(rows_list), tuple(index),
            tuple(state.req_id for state in states) if dense else None,
            None if num_placeholders is None else tuple(counts), num_rejected))

    # ---- landing --------------------------------------------------------------------
    def land(self, batch: PersistentBatch, keep_latest: bool) -> None:
        """Replace placeholders with the landed tokens: every step's, or (keep_latest)
        all but the most recent step's, whose copy may still be in flight."""
        keep = 1 if keep_latest else 0
        while len(self._steps) > keep:
            self._land_step(batch, self._steps.pop(0))

    def _land_step(self, batch: PersistentBatch, step: _InFlightStep) -> None:
        tokens = step.output.get_output().sampled_token_ids  # waits for the copy
        if step.num_placeholders is not None:
            self._land_spec_step(batch, step, tokens)
            return
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

    def _land_spec_step(self, batch: PersistentBatch, step: _InFlightStep,
                        tokens: list[list[int]]) -> None:
        """Each row's accepted run replaces its 1 + d placeholders: the rejected ones
        leave the output list and the token table (the placeholders a later step added
        move back with them: every one is a PLACEHOLDER, so only counts change), and
        the later record's indices into the same lists move back too."""
        shift: dict[int, tuple[int, int]] = {}  # id(output list) -> (index, rejected)
        for state, row, k, c in zip(step.states, step.rows, step.output_index,
                                    step.num_placeholders):  # per request
            run = tokens[row]
            state.output_token_ids[k : k + c] = run
            rejected = c - len(run)
            shift[id(state.output_token_ids)] = (k, rejected)
            at = batch.req_id_to_index.get(state.req_id)
            if at is not None and batch.req_output_token_ids[at] is state.output_token_ids:
                col = state.prompt_len + k
                batch.token_ids[at, col : col + len(run)] = run
                batch.token_ids[at, col + len(run) : col + c] = PLACEHOLDER
                batch.num_tokens[at] -= rejected
        if self._steps and shift:
            later = self._steps[0]
            index = tuple(
                k - shift[id(s.output_token_ids)][1]
                if id(s.output_token_ids) in shift and k > shift[id(s.output_token_ids)][0] else k
                for s, k in zip(later.states, later.output_index))
            self._steps[0] = dataclasses.replace(later, output_index=index)

    # ---- speculative decoding -------------------------------------------------------
    def rejected_by_row(
        self, req_ids: list[str], requests: dict[str, CachedRequestState],
    ) -> torch.Tensor | None:
        """int32 [len(req_ids)] on the device: the drafts the most recent step rejected
        for the request now in each row (0 where it did not verify there), or None when
        that step verified none. Its positions and lengths are the scheduler's minus
        this (the scheduler counted every draft as accepted)."""
        latest = self._steps[-1] if self._steps else None
        if latest is None or latest.num_rejected is None:
            return None
        if (latest.dense_req_ids is not None and tuple(req_ids) == latest.dense_req_ids
                and all(requests[r] is s for r, s in zip(req_ids, latest.states))):
            # the same requests in the same rows (identity: a resubmitted id is new)
            return latest.num_rejected[: len(req_ids)]
        src = _rows_in(latest, [requests[r] for r in req_ids])
        # a fresh pinned copy: scatter_into_input_ids' buffers are in flight this step
        index, present = copy_packed_to_device(
            [np.maximum(src, 0), (src >= 0).astype(np.int32)], latest.num_rejected.device)
        rejected = latest.num_rejected.index_select(0, index) * present
        return rejected

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
        rows_now = np.searchsorted(cu_num_tokens, holes, side="right")
        src = _rows_in(latest, [requests[req_ids[r]] for r in rows_now.tolist()])
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


def _rows_in(step: _InFlightStep | None, states: list[CachedRequestState]) -> np.ndarray:
    """Each request's row in `step` (by identity: an id may be reused by a resubmission),
    -1 where it did not sample there. int64 [len(states)]."""
    row_of = {} if step is None else {id(s): row for s, row in zip(step.states, step.rows)}
    return np.fromiter((row_of.get(id(s), -1) for s in states), dtype=np.int64,
                       count=len(states))
