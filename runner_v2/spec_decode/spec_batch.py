"""The per-step spec-decode view of a V2 batch: which tokens' logits are sampled.

Everything here is known on the host from the scheduler's counts (how many drafts each
row was scheduled with), so it is computed in NumPy and shipped with one async copy;
the draft VALUES never come to the host (they sit in the speculator's device buffer and
reach input_ids through the input-prep kernel).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from shared.runtime.host_buffers import copy_packed_to_device


@dataclass(frozen=True)
class SpecDecodeBatch:
    num_draft_tokens_np: np.ndarray  # int32 [N], batch order
    cu_num_logits_np: np.ndarray  # int32 [N + 1]: logit rows of batch row b
    cu_num_logits: torch.Tensor  # int32 [N + 1], device
    logits_indices: torch.Tensor  # int64 [M], device: flat token of each logit row
    expanded_idx_mapping: torch.Tensor  # int32 [M], device: logit row -> state row
    draft_slot: torch.Tensor  # int64 [M], device: state row * k + local draft index
    max_num_drafts: int  # max over rows of num_draft_tokens


def ragged_arange(counts: np.ndarray) -> np.ndarray:
    """[2, 3] -> [0, 1, 0, 1, 2]."""
    counts = counts.astype(np.int64)
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def build_spec_decode_batch(
    req_ids: list[str], idx_mapping_np: np.ndarray, query_start_loc_np: np.ndarray,
    scheduled_spec_decode_tokens: Mapping[str, list[int]], k: int, device: torch.device,
) -> SpecDecodeBatch:
    """A row with d drafts samples from its last d + 1 tokens (the sampled token's and
    each draft's logits); every other row from its last token."""
    n = len(req_ids)
    num_drafts = np.fromiter(
        (len(scheduled_spec_decode_tokens.get(r, ())) for r in req_ids), dtype=np.int32, count=n
    )
    num_logits = num_drafts.astype(np.int64) + 1
    cu = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(num_logits, out=cu[1:])
    local = ragged_arange(num_logits)
    ends = query_start_loc_np[1 : n + 1].astype(np.int64)
    logits_indices = np.repeat(ends - num_logits, num_logits) + local
    rows = np.repeat(idx_mapping_np.astype(np.int64), num_logits)
    # the bonus row's draft slot is never read: clamp it into the row's own slots
    draft_slot = rows * k + np.minimum(local, k - 1)
    # one pinned copy for the four (it is on the step's critical path: the verify forward
    # waits behind this input prep)
    cu_dev, indices_dev, rows_dev, slot_dev = copy_packed_to_device(
        [cu, logits_indices, rows.astype(np.int32), draft_slot], device)
    return SpecDecodeBatch(
        num_draft_tokens_np=num_drafts,
        cu_num_logits_np=cu,
        cu_num_logits=cu_dev,
        logits_indices=indices_dev,
        expanded_idx_mapping=rows_dev,
        draft_slot=slot_dev,
        max_num_drafts=int(num_drafts.max()) if n else 0,
    )
