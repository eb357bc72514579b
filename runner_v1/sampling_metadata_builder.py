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
    bias_index, bias_values = make_logit_bias(batch, n)
    bad_words = {row: words for row, words in enumerate(batch.bad_words[:n]) if words}
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
        allowed_token_mask=make_allowed_token_mask(batch, n),
        logit_bias_index=bias_index,
        logit_bias_values=bias_values,
        bad_words=bad_words or None,
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


def _rows_using(values: list, n: int) -> list[int]:
    # a loop over requests (once per rebuild), never over their tokens
    return [row for row in range(n) if values[row] is not None]


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    # blocking: the arrays are temporaries in pageable memory
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def make_allowed_token_mask(batch: PersistentBatch, n: int) -> torch.Tensor | None:
    """bool [n, vocab] on the device, True = may be sampled; rows without allowed ids are
    all True. Built from the rows' id lists alone, so a row can only ever carry its
    current request's constraint (never a vacated row's). None when no row has any."""
    rows = _rows_using(batch.allowed_token_ids, n)
    if not rows:
        return None
    ids = [batch.allowed_token_ids[row] for row in rows]
    row_of_id = np.repeat(np.asarray(rows, dtype=np.int64), [len(a) for a in ids])
    mask = torch.ones(n, batch.vocab_size, dtype=torch.bool, device=batch.device)
    mask[_to_device(np.asarray(rows, dtype=np.int64), batch.device)] = False
    mask[_to_device(row_of_id, batch.device), _to_device(np.concatenate(ids), batch.device)] = True
    return mask


def make_logit_bias(
    batch: PersistentBatch, n: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Every row's logit_bias entries: int64 [2, K] (row; token id) and float32 [K], or
    (None, None) when no row has any. A row's ids are unique (dict keys), so no entry
    is added twice."""
    rows = _rows_using(batch.logit_bias, n)
    if not rows:
        return None, None
    entries = [batch.logit_bias[row] for row in rows]
    row_of = np.repeat(np.asarray(rows, dtype=np.int64), [len(ids) for ids, _ in entries])
    index = np.stack([row_of, np.concatenate([ids for ids, _ in entries])])
    values = np.concatenate([vals for _, vals in entries])
    return _to_device(index, batch.device), _to_device(values, batch.device)
