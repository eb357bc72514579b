"""A V1 verify step's results into the batch and the requests.

Synchronous loop: the step's one sync reads the accepted runs (target-verified drafts plus
the target's own token), which are appended to the host token table and to each
request's outputs. Async scheduling: no sync; placeholders stand in for the runs until
their copy lands (runner_v1/spec_decode/async_spec.py record_spec_step).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runner_v1.prepare_inputs import PreparedInputs
from runner_v1.spec_decode.async_spec import record_spec_step
from runner_v1.spec_decode.metadata import append_accepted
from shared.contract.sampler_output import RejectionOutput
from shared.contract.step import ModelRunnerOutput
from shared.runtime.async_output import AsyncModelRunnerOutput


def spec_bookkeeping(
    runner: Any, req_ids: list[str], inputs: PreparedInputs, num_draft: np.ndarray,
    out: RejectionOutput,
) -> ModelRunnerOutput | AsyncModelRunnerOutput:
    """The runner's output of a verify step, its accepted runs recorded in the runner's
    persistent batch and requests (or their placeholders under async scheduling)."""
    batch = runner.persistent_batch
    n = inputs.num_reqs
    # a partial prefill chunk samples nothing (its row has no drafts)
    rows = np.flatnonzero(inputs.seq_lens_cpu[:n].numpy() >= batch.num_tokens[:n])
    if runner.async_scheduling:
        return record_spec_step(runner, req_ids, rows, num_draft, out)
    tokens = out.output_token_ids.cpu().numpy()  # the step's one sync
    counts = out.num_sampled.cpu().numpy().astype(np.int64)
    append_accepted(batch, rows, tokens[rows], counts[rows])
    sampled: list[list[int]] = [[] for _ in range(n)]
    for row in rows.tolist():  # per request: its accepted run
        run = tokens[row, : counts[row]].tolist()
        sampled[row] = run
        runner.requests[req_ids[row]].output_token_ids.extend(run)
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
