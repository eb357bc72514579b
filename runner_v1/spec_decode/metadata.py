"""V1 spec-decode metadata: which flat tokens' logits a drafted step samples from, built
in NumPy on the host (vLLM V1's way), and the vectorised append of accepted runs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runner_v1.persistent_batch import PersistentBatch
from shared.runtime.host_buffers import copy_packed_to_device


@dataclass(frozen=True)
class SpecDecodeMetadata:
    """One step's spec-decode view, rows = the batch's rows [:num_reqs]."""

    num_draft_tokens: np.ndarray  # int32 [N]: drafts scheduled per row (0 for most rows)
    cu_num_logits: np.ndarray  # int32 [N + 1]: logit rows of row b are [cu[b], cu[b+1])
    logits_indices_np: np.ndarray  # int64 [M]: flat token of each logit row
    logits_indices: torch.Tensor  # int64 [M], device
    draft_token_ids: torch.Tensor  # int64 [sum drafts], device, row order


def build_spec_decode_metadata(
    num_draft_tokens: np.ndarray, query_start_loc_np: np.ndarray, draft_token_ids: np.ndarray,
    device: torch.device, device_draft_token_ids: torch.Tensor | None = None,
) -> SpecDecodeMetadata:
    """A row with d drafts samples from its last d + 1 tokens: [end - d - 1, end). All
    vectorised: the logit rows' offsets are a global arange minus each row's start.
    device_draft_token_ids: the drafts already on the device (a draft model's), which
    replace the host's draft_token_ids (placeholders under async scheduling)."""
    n = num_draft_tokens.shape[0]
    num_logits = num_draft_tokens.astype(np.int64) + 1
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(num_logits, out=cu[1:])
    ends = query_start_loc_np[1 : n + 1].astype(np.int64)
    first = np.repeat(ends - num_logits, num_logits)
    logits_indices_np = first + ragged_arange(num_logits)
    # one pinned copy for both (input prep: on the critical path before the verify)
    if device_draft_token_ids is None:
        logits_indices, draft_ids = copy_packed_to_device(
            [logits_indices_np, draft_token_ids.astype(np.int64)], device)
    else:
        (logits_indices,) = copy_packed_to_device([logits_indices_np], device)
        draft_ids = device_draft_token_ids
    return SpecDecodeMetadata(
        num_draft_tokens=num_draft_tokens,
        cu_num_logits=cu.astype(np.int32),
        logits_indices_np=logits_indices_np,
        logits_indices=logits_indices,
        draft_token_ids=draft_ids,
    )


def to_device(x: np.ndarray, device: torch.device) -> torch.Tensor:
    """Through pinned memory, non_blocking: a pageable copy waits for the stream."""
    t = torch.from_numpy(np.ascontiguousarray(x))
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def append_accepted(
    batch: PersistentBatch, rows: np.ndarray, tokens: np.ndarray, counts: np.ndarray
) -> None:
    """Append counts[i] tokens of tokens[i] to row rows[i] of the token table, vectorised."""
    if rows.size == 0:
        return
    within = ragged_arange(counts)
    starts = np.repeat(batch.num_tokens[rows].astype(np.int64), counts)
    values = tokens[np.repeat(np.arange(rows.size), counts), within]
    batch.token_ids[np.repeat(rows, counts), starts + within] = values
    batch.num_tokens[rows] += counts.astype(batch.num_tokens.dtype)


def ragged_arange(counts: np.ndarray) -> np.ndarray:
    """[2, 3] -> [0, 1, 0, 1, 2]: each entry's offset inside its run."""
    counts = counts.astype(np.int64)
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
