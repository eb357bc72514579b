"""StagedRowTables: what the built-in logits processors' per-row tables share.

Each built-in keeps fixed-width device tables, one row per state row, allocated on the
first request that uses it (or eagerly with `ensure_allocated()`). State rows are
reused and never cleared, so once the tables exist EVERY add stages its row in full
(a request without the built-in stages empty parts, which its write kernel turns into
zero counts and padding); before they exist nothing is staged for such a request, since
the zero-initialised counts already say "none".

An add stages a few ragged int64 parts per row; `pack_staged()` lays them out as

    headers [m, 2 + num_parts]: state row, start in the contents, each part's length
    contents:                   every staged row's parts, back to back

for SamplingStates' single host-to-device copy, and the subclass's `write_packed()`
scatters that segment into its tables with one launch.
"""

from __future__ import annotations

import numpy as np
import torch

from runner_v2.uva import async_copy_to_device


def clamp_ids(ids, vocab_size: int) -> np.ndarray:
    """Token ids as int64, those >= vocab_size (which every built-in ignores) as
    vocab_size: an arbitrarily large id must not wrap into the vocabulary in int32."""
    try:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    except OverflowError:  # an id beyond int64's range: beyond any vocabulary as well
        arr = np.asarray([min(t, vocab_size) for t in ids], np.int64)
    return np.minimum(arr, vocab_size)


class StagedRowTables:
    NUM_PARTS: int  # ragged int64 parts staged per row

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._staged: dict[int, tuple[np.ndarray, ...]] = {}  # row -> parts

    @property
    def header_width(self) -> int:
        return 2 + self.NUM_PARTS

    @property
    def allocated(self) -> bool:
        raise NotImplementedError

    def ensure_allocated(self) -> None:
        raise NotImplementedError

    def write_packed(self, segment: torch.Tensor, num_rows: int) -> None:
        """Scatter a pack_staged segment (already on the device) into the tables."""
        raise NotImplementedError

    def _stage(self, row: int, used: bool, parts: tuple[np.ndarray, ...]) -> None:
        """Stage `row`'s parts (the last add of a row before the apply wins)."""
        if not (used or self.allocated):
            self._staged.pop(row, None)  # an earlier add of the row in this step is void
            return
        self.ensure_allocated()
        assert len(parts) == self.NUM_PARTS
        self._staged[row] = parts

    def discard_staged_writes(self) -> None:
        self._staged.clear()

    def pack_staged(self) -> tuple[np.ndarray, int]:
        """(int64 segment, number of staged rows) for write_packed; clears the staging."""
        m = len(self._staged)
        if m == 0:
            return np.zeros(0, np.int64), 0
        header = np.zeros((m, self.header_width), np.int64)
        parts = [p for row_parts in self._staged.values() for p in row_parts]
        header[:, 0] = list(self._staged)
        header[:, 2:] = np.asarray([len(p) for p in parts], np.int64).reshape(m, self.NUM_PARTS)
        header[1:, 1] = np.cumsum(header[:, 2:].sum(axis=1))[:-1]
        self._staged.clear()
        return np.concatenate([header.reshape(-1), *parts]), m

    def apply_staged_writes(self) -> None:
        """Standalone use: one copy and one launch (SamplingStates ships the segment
        together with its own records instead)."""
        packed, m = self.pack_staged()
        if m:
            self.write_packed(async_copy_to_device(packed, self.device), m)
