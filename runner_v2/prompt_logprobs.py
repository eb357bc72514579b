"""V2's prompt logprobs: which rows of this step's chunks predict a prompt token. V2's
token table is on the device, so the prompts of prompt_logprobs requests (only those)
are kept on the host by PromptLogprobsRequests(keep_prompt=True); the logits and
logprobs of those rows only (shared/sampling/prompt_logprobs.py)."""

from __future__ import annotations

import numpy as np
import torch

from runner_v2.input_batch import InputBatch
from runner_v2.states import RequestState
from shared.runtime.model_executor import ModelExecutor
from shared.sampling.prompt_logprobs import (
    PendingPromptLogprobs,
    PromptLogprobsRequests,
    compute_rows,
)


def compute_prompt_logprobs_v2(
    requests: PromptLogprobsRequests,
    batch: InputBatch,
    hidden_states: torch.Tensor,
    req_states: RequestState,
    executor: ModelExecutor,
) -> PendingPromptLogprobs | None:
    """This step's prompt logprobs on the device (None when no request asks for them
    here). Call before the host mirror num_computed_tokens_np is advanced past this
    step: it is the scheduler's count before it, exact without speculative decoding
    (which the engine refuses with prompt_logprobs)."""
    if not requests:
        return None
    n = batch.num_reqs
    # state row -> batch position (-1: not scheduled this step)
    position = np.full(req_states.max_num_reqs, -1, dtype=np.int64)
    position[batch.idx_mapping_np] = np.arange(n)
    rows_of = req_states.req_id_to_index

    def batch_index(req_id: str) -> int | None:
        row = rows_of.get(req_id)
        i = -1 if row is None else int(position[row])
        return None if i < 0 else i

    rows = requests.rows_for_step(
        batch_index,
        req_states.num_computed_tokens_np[batch.idx_mapping_np],
        batch.num_scheduled_tokens_np,
        batch.query_start_loc_np,
        lambda req_id, _i: requests.prompt(req_id),
    )
    return compute_rows(rows, hidden_states, executor.compute_logits)
