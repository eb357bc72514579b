"""V1's block table: one row per batch row, kept on the host and copied to the device.

Row = batch position (not a permanent request slot as in V2), so rows move when the
persistent batch condenses or reorders. Invariant kept by every method: entries past
`num_blocks_per_row[row]` are 0, and rows nobody occupies are all 0 (a padded row of a
CUDA-graph batch must never name a live block).
"""

from __future__ import annotations

import numpy as np
import torch

from runner_v1.buffers import CpuGpuBuffer
from shared.attention.metadata import PAD_SLOT_ID


class BlockTable:
    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        block_size: int,
        device: torch.device | str,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.block_table = CpuGpuBuffer(
            max_num_reqs, max_num_blocks_per_req, dtype=torch.int32, device=device
        )
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.slot_mapping = CpuGpuBuffer(max_num_batched_tokens, dtype=torch.int64, device=device)
        # Device rows [0, _num_committed_rows) may hold blocks; all later rows are zero.
        self._num_committed_rows = 0

    @property
    def np(self) -> np.ndarray:
        return self.block_table.np

    # ---- row edits (host side) ----------------------------------------------------

    def append_row(self, block_ids: list[int], row: int) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"block table row {row} would hold {end} blocks; the maximum per request "
                f"is {self.max_num_blocks_per_req} (max_model_len / block_size)"
            )
        self.block_table.np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def add_row(self, block_ids: list[int], row: int) -> None:
        """Replace the row's blocks (a new request at this row)."""
        self.clear_row(row)
        self.append_row(block_ids, row)

    def clear_row(self, row: int) -> None:
        n = self.num_blocks_per_row[row]
        self.block_table.np[row, :n] = 0
        self.num_blocks_per_row[row] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Copy src's blocks to tgt, then zero src: src becomes an empty (possibly padded)
        row, and a padded row must not point at blocks that now belong to tgt."""
        table = self.block_table.np
        n_src = self.num_blocks_per_row[src]
        n_tgt = self.num_blocks_per_row[tgt]
        table[tgt, :n_src] = table[src, :n_src]
        if n_tgt > n_src:
            table[tgt, n_src:n_tgt] = 0  # keep "zero past the count" for tgt
        self.num_blocks_per_row[tgt] = n_src
        table[src, :n_src] = 0
        self.num_blocks_per_row[src] = 0

    def swap_row(self, a: int, b: int) -> None:
        # Fancy indexing on the right makes a copy first; a tuple swap of row views would
        # leave both rows equal to the old row b.
        table = self.block_table.np
        n = max(self.num_blocks_per_row[a], self.num_blocks_per_row[b])
        table[[a, b], :n] = table[[b, a], :n]
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]

    # ---- per-step device work -----------------------------------------------------

    def commit(self, num_reqs: int) -> torch.Tensor:
        """Copy the live prefix host -> device (non_blocking); returns the device table.

        The runner issues this first in input prep so the copy overlaps the NumPy work.
        Only rows [0, num_reqs) travel; rows that were live at the last commit but are not
        now are zeroed on the device, so every row past num_reqs stays 0 there too.
        """
        self.block_table.copy_to_gpu(num_reqs)
        if self._num_committed_rows > num_reqs:
            self.block_table.gpu[num_reqs : self._num_committed_rows].zero_()
        self._num_committed_rows = num_reqs
        return self.block_table.gpu

    def compute_slot_mapping(
        self, req_indices_np: np.ndarray, positions_np: np.ndarray, num_tokens_padded: int
    ) -> torch.Tensor:
        """slot = block_table[req, pos // block_size] * block_size + pos % block_size, for
        each scheduled token; PAD_SLOT_ID from the real token count to the end of the
        buffer, so the KV write skips padded tokens of a graph batch. Issues the
        non_blocking copy of the first `num_tokens_padded` entries; returns that view."""
        num_tokens = positions_np.shape[0]
        if not num_tokens <= num_tokens_padded <= self.max_num_batched_tokens:
            raise ValueError(
                f"num_tokens_padded={num_tokens_padded} must lie in [num_tokens={num_tokens}, "
                f"max_num_batched_tokens={self.max_num_batched_tokens}]"
            )
        block_size = self.block_size
        # Index the flattened table: one 1-D gather instead of a 2-D fancy index.
        flat_index = (
            req_indices_np.astype(np.int64) * self.max_num_blocks_per_req
            + positions_np // block_size
        )
        block_numbers = self.block_table.np.reshape(-1)[flat_index]
        out = self.slot_mapping.np
        # int64 arithmetic: block number * block_size may pass int32 on a large cache.
        np.multiply(block_numbers, np.int64(block_size), out=out[:num_tokens])
        out[:num_tokens] += positions_np % block_size
        out[num_tokens:] = PAD_SLOT_ID
        return self.slot_mapping.copy_to_gpu(num_tokens_padded)
