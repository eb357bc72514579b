"""V1's pooling step: the chunk each batch row computed this step, by the host counts of
the persistent batch, handed to the shared PromptPooler (shared/model/pooler.py)."""

from __future__ import annotations

import torch

from runner_v1.persistent_batch import PersistentBatch
from runner_v1.prepare_inputs import PreparedInputs
from shared.contract.step import ModelRunnerOutput
from shared.model.pooler import PromptPooler


def pool_step(pooler: PromptPooler, batch: PersistentBatch, inputs: PreparedInputs,
              hidden: torch.Tensor, req_ids: list[str]) -> ModelRunnerOutput:
    """One output per row: the pooled result on the CPU once the row's prompt is
    complete, else None. num_computed_tokens still holds the count before this step."""
    qsl = inputs.query_start_loc_cpu.numpy()
    pooled: list[torch.Tensor | None] = []
    for row, req_id in enumerate(req_ids):  # per request, not per token
        start, end = int(qsl[row]), int(qsl[row + 1])
        pooled.append(pooler.add_chunk(req_id, hidden[start:end],
                                       int(batch.num_computed_tokens[row]),
                                       int(batch.num_prompt_tokens[row])))
    host = [None if t is None else t.cpu() for t in pooled]  # the step's one sync
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[] for _ in req_ids], pooler_output=host,
    )
