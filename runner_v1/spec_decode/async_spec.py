"""V1 speculative decoding under async scheduling (draft_model): what the host cannot know.

vLLM's V1 does this too: the engine schedules step N+1 before step N's accepted counts
reach the host, so the scheduler counts every draft of step N as accepted; a row that
verified drafts in step N gets PLACEHOLDER drafts scheduled (the proposals stay on the
device) and positions that are too far on by the drafts step N rejected. Input prep
builds everything from the host's (optimistic) values as usual, then this module, on the
device and without a sync:
- writes each drafted row's proposed tokens into the step's input ids (`fill_drafts`);
- moves each row's positions, seq_len and KV slots back by the drafts the previous step
  rejected (`correct_positions`; the count comes from runner_v1/in_flight_tokens.py).
The host keeps its optimistic counts (token table, num_tokens): landing the previous
step's tokens corrects them, one step later, as the scheduler's update does.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from runner_v1.prepare_inputs import PreparedInputs
from runner_v1.spec_decode.metadata import ragged_arange
from shared.contract.sampler_output import RejectionOutput
from shared.contract.step import ModelRunnerOutput
from shared.runtime.async_output import AsyncModelRunnerOutput, fill_spec_sampled_output
from shared.runtime.host_buffers import copy_packed_to_device


def draft_positions(inputs: PreparedInputs, num_draft: np.ndarray) -> np.ndarray:
    """The flat token index of every scheduled draft, rows in order: a row's drafts are
    the last num_draft[row] tokens of its query. int64 [sum num_draft]."""
    ends = inputs.query_start_loc_cpu[1 : inputs.num_reqs + 1].numpy().astype(np.int64)
    counts = num_draft.astype(np.int64)
    return np.repeat(ends - counts, counts) + ragged_arange(counts)


def fill_drafts(input_ids: torch.Tensor, index: torch.Tensor, drafts: torch.Tensor) -> None:
    """input_ids[index] = drafts (the proposals, flat in row order, on the device): the
    host gathered placeholders there under async scheduling (and the same tokens under
    the synchronous loop, which this rewrites unchanged)."""
    input_ids.index_copy_(0, index, drafts.to(input_ids.dtype))


def correct_positions(
    inputs: PreparedInputs, rejected: torch.Tensor, block_table: torch.Tensor,
    block_size: int, req_indices: np.ndarray,
) -> None:
    """In place on the step's device inputs (the persistent buffers a FULL graph reads):
    every token of row r moves back by rejected[r] positions (int32 [num_reqs]), its
    seq_len with it, and its KV slot is looked up again in the device block table (the
    host computed it for the optimistic position). Padding rows and tokens are untouched.
    req_indices: int64 [num_tokens], each token's row."""
    n, t = inputs.num_reqs, inputs.num_tokens
    (rows,) = copy_packed_to_device([req_indices.astype(np.int64)], rejected.device)
    shift = rejected.index_select(0, rows)
    positions = inputs.positions[:t]
    positions -= shift
    inputs.seq_lens[:n] -= rejected
    blocks = block_table[rows, positions // block_size].to(torch.int64)
    torch.add(blocks * block_size, positions % block_size, out=inputs.slot_mapping[:t])


def record_spec_step(
    runner: Any, req_ids: list[str], rows: np.ndarray, num_draft: np.ndarray,
    out: RejectionOutput,
) -> AsyncModelRunnerOutput:
    """A verify step's output under async scheduling, with no sync: the runs' device-to-
    host copy on the side stream, and per sampling row (rows) 1 + its drafts
    placeholders in the batch and the request (the scheduler's optimistic count), the
    last token of its run (the next step's input) and the drafts the device rejected
    (the next step's correction) kept on the device by runner.in_flight."""
    n = len(req_ids)
    output = ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[])
    is_sampled = np.zeros(n, dtype=bool)
    is_sampled[rows] = True
    fill = functools.partial(fill_spec_sampled_output, is_sampled=is_sampled.tolist(),
                             num_drafts=runner.speculator.k)
    pending = AsyncModelRunnerOutput(
        output, {"sampled": out.output_token_ids, "num_sampled": out.num_sampled}, fill,
        runner.copy_stream, runner.output_ring)
    accepted = out.num_sampled[:n].to(torch.int64) - 1
    last = out.output_token_ids[:n].gather(1, accepted.clamp(min=0)[:, None]).squeeze(1)
    (drafts,) = copy_packed_to_device([num_draft[:n].astype(np.int32)], accepted.device)
    # a row without drafts rejects nothing (a partial prefill's num_sampled is no run)
    rejected = torch.where(drafts > 0, drafts - accepted.to(torch.int32), 0).to(torch.int32)
    states = [runner.requests[req_ids[row]] for row in rows.tolist()]
    runner.in_flight.record(runner.persistent_batch, states, rows, last, pending,
                            num_placeholders=1 + num_draft[rows].astype(np.int64),
                            num_rejected=rejected)
    return pending
