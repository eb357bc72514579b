"""V2's pooling step: the chunk each batch row computed this step, by the host counts of
the state table (exact here: a pooling engine schedules synchronously), handed to the
shared PromptPooler (shared/model/pooler.py); then the device counters advance as
after any step (post_update with a placeholder token for the rows whose prompt ended:
they finish at this step's update, so the token is never read)."""

from __future__ import annotations

import torch

from runner_v2.input_batch import InputBatch
from runner_v2.post_update import post_update
from runner_v2.states import RequestState
from shared.contract.step import ModelRunnerOutput
from shared.model.pooler import PromptPooler


def pool_step(pooler: PromptPooler, batch: InputBatch, hidden: torch.Tensor,
              req_states: RequestState) -> ModelRunnerOutput:
    qsl = batch.query_start_loc_np
    idx = batch.idx_mapping_np
    pooled: list[torch.Tensor | None] = []
    for i, req_id in enumerate(batch.req_ids):  # per request, not per token
        row = int(idx[i])
        start, end = int(qsl[i]), int(qsl[i + 1])
        pooled.append(pooler.add_chunk(req_id, hidden[start:end],
                                       int(req_states.num_computed_tokens_np[row]),
                                       int(req_states.prompt_len_np[row])))
    n = batch.num_reqs
    placeholder = torch.zeros(n, dtype=torch.int64, device=hidden.device)
    post_update(batch.idx_mapping, n, placeholder, batch.seq_lens, batch.query_start_loc,
                req_states, None)
    req_states.num_computed_tokens_np[idx] += batch.num_scheduled_tokens_np
    host = [None if t is None else t.cpu() for t in pooled]  # the step's one sync
    return ModelRunnerOutput(
        req_ids=batch.req_ids, req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
        sampled_token_ids=[[] for _ in batch.req_ids], pooler_output=host,
    )
