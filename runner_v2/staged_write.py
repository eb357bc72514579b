"""StagedWriteTensor: a device-resident table updated by ragged diffs staged on the CPU.

The base tensor lives on the device (or in pinned host memory read through UVA, for
large tables such as all_token_ids). The CPU never copies the table; it stages
(row, start, values) writes, and `apply_write()` ships them all at once:

    pack   rows | starts | cu_lens | contents   into ONE host buffer
    copy   that buffer with ONE non_blocking H2D copy from a fresh pinned temporary
    apply  ONE Triton launch, one program per write, each copying its run of values

so a step costs one copy and one launch however many rows changed, and there is no
sync: the CPU may stage the next step's writes while this one is still in flight.

Overlapping writes within one apply are SERIALISED on the host: a write that overlaps
(or touches) a pending write on the same row is merged with it into one run whose
values are the result of applying the writes in program order (later wins). Kernel
programs therefore never write the same cell, and there is no race. The merged run
covers exactly the union of the merged writes (the intervals chain into one interval),
so no cell that was not written is ever sent, and a value a kernel advanced on the
device (which the host mirror does not see) is never overwritten by a stale mirror.

`.np` is a host mirror of every staged value (updated at stage time). It is what the
CPU reads for upper bounds; where kernels advance a field on the device, the device
copy is authoritative and the mirror is stale by design. Never write `.np` directly:
pending runs are packed from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from runner_v2.uva import device_view_of_pinned, is_uva_available
from shared.runtime.host_buffers import pinned_empty, pinned_zeros
from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton

_SUPPORTED = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}
# Metadata travels bit-cast in the contents' element width: int32 for 4-byte contents,
# int64 for 8-byte contents, so one buffer holds both.
_META_DTYPE = {4: torch.int32, 8: torch.int64}
_APPLY_BLOCK = 1024


@triton.jit
def _apply_write_kernel(
    out_ptr,  # [num_rows, row_width] (row stride = out_stride), the base tensor
    out_stride,
    meta_ptr,  # [3 * num_writes + 1]: rows[n] | starts[n] | cu_lens[n + 1] (cu_lens[0] = 0)
    contents_ptr,  # [total_len] packed values, write p owns [cu_lens[p], cu_lens[p + 1])
    num_writes,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(meta_ptr + pid).to(tl.int64)
    start = tl.load(meta_ptr + num_writes + pid).to(tl.int64)
    begin = tl.load(meta_ptr + 2 * num_writes + pid).to(tl.int64)
    end = tl.load(meta_ptr + 2 * num_writes + pid + 1).to(tl.int64)
    dst = out_ptr + row * out_stride + start
    for off in range(0, end - begin, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < end - begin
        vals = tl.load(contents_ptr + begin + offs, mask=mask)
        tl.store(dst + offs, vals, mask=mask)


def launch_apply_write(
    out: torch.Tensor, meta: torch.Tensor, contents: torch.Tensor, num_writes: int
) -> None:
    """One launch applying `num_writes` packed writes to the 2-D `out`."""
    assert out.dim() == 2 and out.stride(1) == 1, "base tensor must be row-major 2-D"
    assert meta.shape == (3 * num_writes + 1,) and meta.dtype in (torch.int32, torch.int64)
    assert contents.dtype == out.dtype and contents.dim() == 1
    assert meta.device == contents.device == out.device
    kept(_apply_write_kernel)((num_writes,),
        out, out.stride(0), meta, contents, num_writes, BLOCK=_APPLY_BLOCK
    )


# Per-row scalar tables one apply_row_scalars call can take (pointer arguments t0..t5).
MAX_SCALAR_TABLES = 6


@triton.jit
def _apply_row_scalars_kernel(
    t0, t1, t2, t3, t4, t5,  # 1-D tables (int32 / int64); unused slots repeat t0
    meta_ptr,  # int64 [2 * num_writes]: rows | table indices
    values_ptr,  # int64 [num_writes]
    num_writes,
):
    pid = tl.program_id(0)
    row = tl.load(meta_ptr + pid)
    table = tl.load(meta_ptr + num_writes + pid)
    value = tl.load(values_ptr + pid)
    # the store casts the int64 value to the table's element type
    if table == 0:
        tl.store(t0 + row, value)
    elif table == 1:
        tl.store(t1 + row, value)
    elif table == 2:
        tl.store(t2 + row, value)
    elif table == 3:
        tl.store(t3 + row, value)
    elif table == 4:
        tl.store(t4 + row, value)
    else:
        tl.store(t5 + row, value)


def apply_row_scalars(tables: Sequence[StagedWriteTensor]) -> None:
    """Ship the staged writes of several per-row scalar tables (1-D int32 / int64, in
    device memory) with ONE packed copy and ONE launch, where apply_write would take one
    of each per table: a request's admission writes all of them for its row, and on a
    model of thin layers each launch's host time shows in the step (the journal of
    2026-12-04). The values are the host mirror's, as apply_write sends them."""
    if len(tables) > MAX_SCALAR_TABLES:
        raise ValueError(f"at most {MAX_SCALAR_TABLES} tables per call, got {len(tables)}")
    rows, which, values = [], [], []
    for k, table in enumerate(tables):
        if table.row_width != 1 or table.uses_uva or table.dtype not in (torch.int32, torch.int64):
            raise ValueError("apply_row_scalars takes 1-D int32 / int64 tables in device memory")
        table_rows, table_values = table.take_scalar_writes()
        rows += table_rows
        which += [k] * len(table_rows)
        values += table_values
    if not rows:
        return
    n = len(rows)
    buf = pinned_empty(3 * n, torch.int64)
    buf.numpy()[:] = rows + which + values
    device_buf = _to_device(buf, tables[0].device)
    targets = [t.gpu for t in tables] + [tables[0].gpu] * (MAX_SCALAR_TABLES - len(tables))
    kept(_apply_row_scalars_kernel)((n,), *targets, device_buf[: 2 * n], device_buf[2 * n:], n)


def _to_device(packed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`packed` is a fresh pinned temporary: one non_blocking H2D copy (nothing reuses it
    while the copy is in flight). On the CPU it is used in place (nothing else holds it)."""
    return packed if device.type == "cpu" else packed.to(device, non_blocking=True)


class StagedWriteTensor:
    """A [num_rows, row_width] (or [num_rows]) table written only through staged diffs.

    uva_instead_of_gpu: keep the base in pinned host memory that kernels address
    through UVA (no device memory used); falls back to device memory without UVA.
    """

    def __init__(
        self,
        shape: int | tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
        uva_instead_of_gpu: bool = False,
    ):
        if dtype not in _SUPPORTED:
            raise ValueError(
                f"StagedWriteTensor dtype must be one of {list(_SUPPORTED)}, got {dtype}"
            )
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if len(shape) not in (1, 2):
            raise ValueError(f"shape must be (num_rows,) or (num_rows, row_width), got {shape}")
        self.shape = shape
        self.num_rows = shape[0]
        self.row_width = shape[1] if len(shape) == 2 else 1
        self.dtype = dtype
        self.device = torch.device(device)
        self.uses_uva = uva_instead_of_gpu and is_uva_available()
        if self.uses_uva:
            self._host_base = pinned_zeros(shape, dtype)  # keeps the memory alive
            self.gpu = device_view_of_pinned(self._host_base)
        else:
            self.gpu = torch.zeros(shape, dtype=dtype, device=self.device)
        self._base2d = self.gpu.view(self.num_rows, self.row_width)
        self.np = np.zeros(shape, dtype=_SUPPORTED[dtype])
        self._np2d = self.np.reshape(self.num_rows, self.row_width)
        # row -> disjoint, non-touching [start, end) runs pending for the next apply
        self._pending: dict[int, list[list[int]]] = {}

    # ---- staging -------------------------------------------------------------------

    def stage_write(self, row: int, start: int, values: Sequence | np.ndarray) -> None:
        """Stage values[...] into row `row` at columns start..start+len-1 (empty: no-op)."""
        values = np.asarray(values, dtype=self.np.dtype).reshape(-1)
        n = values.shape[0]
        if n == 0:
            return
        if not (0 <= row < self.num_rows):
            raise IndexError(f"row {row} out of range [0, {self.num_rows})")
        if start < 0 or start + n > self.row_width:
            raise IndexError(
                f"write [{start}, {start + n}) does not fit a row of width {self.row_width}"
            )
        self._np2d[row, start : start + n] = values
        self._add_run(row, start, start + n)

    def stage_write_elem(self, row: int, value: int | float) -> None:
        """Stage one value at column 0 of `row` (per-row scalar fields). A table of one
        column takes a shortcut: its only run on a row is [0, 1), so it needs no merge
        (an admission stages several of these per request)."""
        if self.row_width != 1:
            self.stage_write(row, 0, [value])
            return
        if not (0 <= row < self.num_rows):
            raise IndexError(f"row {row} out of range [0, {self.num_rows})")
        self._np2d[row, 0] = value
        self._pending[row] = [[0, 1]]

    def _add_run(self, row: int, start: int, end: int) -> None:
        # Merge with every pending run it overlaps or touches: the mirror already holds
        # the later values, so the merged run carries the program-order result.
        runs = self._pending.setdefault(row, [])
        kept = []
        for run in runs:
            if run[1] < start or run[0] > end:
                kept.append(run)
            else:
                start, end = min(start, run[0]), max(end, run[1])
        kept.append([start, end])
        self._pending[row] = kept

    def take_scalar_writes(self) -> tuple[list[int], list[int | float]]:
        """A per-row scalar table's staged writes as (rows, values from the mirror), now
        unstaged: for apply_row_scalars, which ships several tables' at once."""
        assert self.row_width == 1, "a per-row scalar table has one column"
        rows = list(self._pending)  # one [0, 1) run per row
        self._pending = {}
        return rows, [self.np[row].item() for row in rows]

    @property
    def num_pending_writes(self) -> int:
        return sum(len(runs) for runs in self._pending.values())

    def discard_staged_writes(self) -> None:
        """Drop the staged writes unshipped. The host mirror keeps them: it is exact again
        only for rows written anew (every add overwrites its row)."""
        self._pending = {}

    # ---- applying ------------------------------------------------------------------

    def apply_write(self) -> None:
        """Ship every staged write: one packed H2D copy, one kernel launch (none if empty)."""
        if not self._pending:
            return
        rows, starts, ends = [], [], []
        for row, runs in self._pending.items():
            for start, end in runs:
                rows.append(row)
                starts.append(start)
                ends.append(end)
        self._pending = {}
        packed, num_writes = self._pack(rows, starts, ends)
        device_buf = _to_device(packed, self.device)
        meta_len = 3 * num_writes + 1
        meta = device_buf[:meta_len]
        contents = device_buf[meta_len:].view(self.dtype)
        launch_apply_write(self._base2d, meta, contents, num_writes)

    def _pack(self, rows: list, starts: list, ends: list) -> tuple[torch.Tensor, int]:
        """rows | starts | cu_lens | contents in one host buffer (pinned when possible)."""
        num_writes = len(rows)
        rows_np = np.asarray(rows, dtype=np.int64)
        starts_np = np.asarray(starts, dtype=np.int64)
        lens = np.asarray(ends, dtype=np.int64) - starts_np
        cu_lens = np.zeros(num_writes + 1, dtype=np.int64)
        np.cumsum(lens, out=cu_lens[1:])
        total = int(cu_lens[-1])
        meta_dtype = _META_DTYPE[self.np.dtype.itemsize]
        meta_len = 3 * num_writes + 1
        # The fresh temporary IS the pinned staging buffer: packing straight into it
        # saves a host copy, and nothing reuses it while the H2D copy is in flight.
        buf = pinned_empty(meta_len + total, meta_dtype)
        buf_np = buf.numpy()
        buf_np[:num_writes] = rows_np
        buf_np[num_writes : 2 * num_writes] = starts_np
        buf_np[2 * num_writes : meta_len] = cu_lens
        contents = buf_np[meta_len:].view(self.np.dtype)
        for i in range(num_writes):  # one slice copy per write, never per token
            contents[cu_lens[i] : cu_lens[i + 1]] = self._np2d[rows[i], starts[i] : ends[i]]
        return buf, num_writes
