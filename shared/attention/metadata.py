"""CommonAttentionMetadata: what every backend needs about one step, built once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

# Slot id for a token that must not be written to the KV cache (padding). Every KV
# write skips negative slots; NumPy/PyTorch would otherwise read -1 as "the last row".
PAD_SLOT_ID = -1


def count_leading_decodes(num_scheduled: np.ndarray) -> int:
    """Rows with query length 1 at the front of a batch both runners order decodes-first:
    the `num_decodes` of the metadata."""
    not_decode = np.flatnonzero(num_scheduled != 1)
    return int(not_decode[0]) if not_decode.size else int(num_scheduled.shape[0])


class StepBatch(Protocol):
    """What both runners' per-step input batches carry under the same names."""

    query_start_loc: torch.Tensor  # int32 [R + 1], device
    seq_lens: torch.Tensor  # int32 [R], device
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_decode_tokens: int


@dataclass
class CommonAttentionMetadata:
    """One flat ragged batch. Shapes use R = rows (padded), T = tokens (padded).

    Padding rules every producer must keep (CUDA graphs replay over padded sizes):
    - query_start_loc past the real rows repeats the last real value (non-decreasing),
    - seq_lens past the real rows is 0 (a padded row attends to nothing),
    - block_table rows past the real rows are 0,
    - slot_mapping from num_actual_tokens to the end is PAD_SLOT_ID.
    """

    query_start_loc: torch.Tensor  # int32 [R + 1], device
    seq_lens: torch.Tensor  # int32 [R], device: num_computed + num_scheduled
    block_table: torch.Tensor  # int32 [R, max_num_blocks_per_req], device
    slot_mapping: torch.Tensor  # int64 [T], device
    num_reqs: int  # real rows
    num_actual_tokens: int  # real tokens
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # rows with query length 1 (ordered first)
    num_prefills: int  # the other rows
    num_decode_tokens: int
    block_size: int
    # Host copies for backends that need them (the TORCH oracle). V2 passes upper
    # bounds here only where exact values live on the device; both are optional.
    query_start_loc_cpu: torch.Tensor | None = None  # int32 [R + 1]
    seq_lens_cpu: torch.Tensor | None = None  # int32 [R]

    @property
    def num_reqs_padded(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def for_batch(
        cls,
        batch: StepBatch,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        query_start_loc_cpu: torch.Tensor | None = None,
        seq_lens_cpu: torch.Tensor | None = None,
    ) -> CommonAttentionMetadata:
        """A runner's step batch plus its block table and slot mapping (both padded, as
        the class docstring requires); decodes come first, so the rest are prefills."""
        return cls(
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            num_reqs=batch.num_reqs,
            num_actual_tokens=batch.num_tokens,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            num_decodes=batch.num_decodes,
            num_prefills=batch.num_reqs - batch.num_decodes,
            num_decode_tokens=batch.num_decode_tokens,
            block_size=block_size,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
