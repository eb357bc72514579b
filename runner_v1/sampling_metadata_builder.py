"""The sampler's view of V1's persistent batch: builds SamplingMetadata from the rows
[0, num_reqs) of a PersistentBatch. PersistentBatch.refresh_sampling_metadata decides
when a rebuild is needed; these functions only read the batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from runner_v1.buffers import CpuGpuBuffer
from runner_v1.sampling_metadata import SamplingMetadata

if TYPE_CHECKING:
    from runner_v1.persistent_batch import PersistentBatch


def compute_min_tokens_stop_ids(batch: PersistentBatch) -> dict[int, list[int]]:
    """Rows that have generated fewer than min_tokens -> token ids to mask (stop ids,
    and EOS unless ignored). Cheap when no row uses min_tokens."""
    n = batch.num_reqs
    min_tokens = batch.min_tokens[:n]
    if not min_tokens.any():
        return {}
    num_output = batch.num_tokens[:n] - batch.num_prompt_tokens[:n]
    result: dict[int, list[int]] = {}
    for row in np.flatnonzero(num_output < min_tokens).tolist():
        ids = list(batch.stop_token_ids[row])
        if batch.eos_token_id[row] >= 0:
            ids.append(int(batch.eos_token_id[row]))
        if ids:
            result[row] = ids
    return result


def make_sampling_metadata(batch: PersistentBatch) -> SamplingMetadata:
    """Copy the rows' sampling values to the device; optional parts stay None when no row
    uses them. min_tokens_stop_ids is left empty: it is refreshed on every step."""
    n = batch.num_reqs
    temperature = batch.temperature.np[:n]

    def copied_if(buf: CpuGpuBuffer, used: bool) -> torch.Tensor | None:
        return buf.copy_to_gpu(n) if used else None

    no_penalties = not (
        batch.presence_penalty.np[:n].any()
        or batch.frequency_penalty.np[:n].any()
        or (batch.repetition_penalty.np[:n] != 1.0).any()
    )
    num_logprobs = batch.num_logprobs[:n].tolist()
    max_num_logprobs = max(num_logprobs, default=-1)
    return SamplingMetadata(
        num_reqs=n,
        temperature=batch.temperature.copy_to_gpu(n),
        all_greedy=bool((temperature == 0.0).all()),
        all_random=bool((temperature != 0.0).all()),
        top_k=copied_if(batch.top_k, bool(batch.top_k.np[:n].any())),
        top_p=copied_if(batch.top_p, bool((batch.top_p.np[:n] < 1.0).any())),
        min_p=copied_if(batch.min_p, bool((batch.min_p.np[:n] > 0.0).any())),
        seeds=batch.seeds.copy_to_gpu(n),
        presence_penalty=copied_if(batch.presence_penalty, not no_penalties),
        frequency_penalty=copied_if(batch.frequency_penalty, not no_penalties),
        repetition_penalty=copied_if(batch.repetition_penalty, not no_penalties),
        prompt_token_ids=None if no_penalties else make_prompt_token_ids(batch, n),
        output_token_ids=list(batch.req_output_token_ids[:n]),
        num_logprobs=num_logprobs,
        max_num_logprobs=max_num_logprobs if max_num_logprobs >= 0 else None,
        min_tokens_stop_ids={},
    )


def make_prompt_token_ids(batch: PersistentBatch, n: int) -> torch.Tensor:
    """User-prompt tokens per row, padded with vocab_size (a bin past the vocabulary,
    so padding never counts as a real token). Resumed outputs are not prompt."""
    prompt_lens = batch.num_prompt_tokens[:n]
    width = int(prompt_lens.max()) if n else 0
    prompt = batch.token_ids[:n, :width].astype(np.int64)
    prompt[np.arange(width)[None, :] >= prompt_lens[:, None]] = batch.vocab_size
    # A blocking copy: `prompt` is a temporary in pageable memory.
    return torch.from_numpy(prompt).to(batch.device)
