"""V1's prompt logprobs: which rows of this step's chunks predict a prompt token, read
from the persistent batch (the prompt is on the host, in the token table); the logits
and logprobs of those rows only (shared/sampling/prompt_logprobs.py)."""

from __future__ import annotations

import torch

from runner_v1.persistent_batch import PersistentBatch
from runner_v1.prepare_inputs import PreparedInputs
from shared.runtime.model_executor import ModelExecutor
from shared.sampling.prompt_logprobs import (
    PendingPromptLogprobs,
    PromptLogprobsRequests,
    compute_rows,
)


def compute_prompt_logprobs_v1(
    requests: PromptLogprobsRequests,
    batch: PersistentBatch,
    inputs: PreparedInputs,
    hidden_states: torch.Tensor,
    executor: ModelExecutor,
) -> PendingPromptLogprobs | None:
    """This step's prompt logprobs on the device (None when no request asks for them
    here). Call before the next step's input prep overwrites inputs' host buffers."""
    if not requests:
        return None
    n = inputs.num_reqs
    num_scheduled = inputs.num_scheduled_tokens_np
    # seq_lens = num_computed + num_scheduled, per row, exact on the host
    num_computed = inputs.seq_lens_cpu[:n].numpy() - num_scheduled
    rows = requests.rows_for_step(
        batch.req_id_to_index.get,  # the condensed batch: row == batch position
        num_computed, num_scheduled, inputs.query_start_loc_cpu.numpy(),
        # the token table's row: the prefill from position 0 (prompt first)
        lambda _req_id, row: batch.token_ids[row],
    )
    return compute_rows(rows, hidden_states, executor.compute_logits)
