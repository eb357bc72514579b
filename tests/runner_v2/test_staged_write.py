"""StagedWriteTensor vs a NumPy model: ragged writes, several applies, one launch each."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import runner_v2.staged_write as sw
from runner_v2.staged_write import StagedWriteTensor


class _LaunchCounter:
    """Stands in for the @triton.jit kernel: counts `kernel[grid](...)` launches."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.grids: list[tuple] = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch):
    counter = _LaunchCounter(sw._apply_write_kernel)
    monkeypatch.setattr(sw, "_apply_write_kernel", counter)
    return counter


_NP = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
def test_ragged_writes_match_numpy_model(dtype, launches):
    rng = np.random.default_rng(0)
    num_rows, width = 37, 300
    t = StagedWriteTensor((num_rows, width), dtype, "cpu")
    model = np.zeros((num_rows, width), dtype=_NP[dtype])
    for apply_round in range(4):
        # Distinct rows per round so writes never overlap here (overlap: its own test).
        rows = rng.choice(num_rows, size=rng.integers(1, 20), replace=False)
        for row in rows:
            n = int(rng.integers(0, width + 1))  # includes empty and full-width writes
            start = int(rng.integers(0, width - n + 1))
            vals = rng.integers(-(2**30), 2**30, size=n).astype(_NP[dtype])
            if dtype == torch.float32:
                vals = vals / 7.0
            t.stage_write(int(row), start, vals.tolist() if row % 2 else vals)
            model[row, start : start + n] = vals
        t.apply_write()
        np.testing.assert_array_equal(t.gpu.numpy(), model)
        np.testing.assert_array_equal(t.np, model)
        assert len(launches.grids) == apply_round + 1  # exactly one launch per apply
    # Large values survive the bit-cast packing of int64 contents.
    if dtype == torch.int64:
        t.stage_write(0, 0, [2**40 + 3, -(2**50)])
        t.apply_write()
        assert t.gpu[0, :2].tolist() == [2**40 + 3, -(2**50)]


def test_empty_apply_launches_nothing(launches):
    t = StagedWriteTensor((4, 8), torch.int32, "cpu")
    t.stage_write(1, 0, [])
    t.apply_write()
    assert launches.grids == []
    assert t.gpu.abs().sum() == 0


def test_one_dim_table_and_stage_write_elem(launches):
    t = StagedWriteTensor(10, torch.int32, "cpu")
    for row in (3, 7, 0):
        t.stage_write_elem(row, row * 11 + 1)
    t.apply_write()
    expected = np.zeros(10, dtype=np.int32)
    expected[[3, 7, 0]] = [34, 78, 1]
    np.testing.assert_array_equal(t.gpu.numpy(), expected)
    assert launches.grids == [(3,)]  # one program per write


def test_overlapping_writes_serialise_in_program_order(launches):
    rng = np.random.default_rng(1)
    num_rows, width = 5, 64
    t = StagedWriteTensor((num_rows, width), torch.int64, "cpu")
    model = np.zeros((num_rows, width), dtype=np.int64)
    for _ in range(3):
        for _ in range(40):  # many overlapping writes into few rows
            row = int(rng.integers(num_rows))
            n = int(rng.integers(1, 12))
            start = int(rng.integers(0, width - n + 1))
            vals = rng.integers(1, 1000, size=n)
            t.stage_write(row, start, vals)
            model[row, start : start + n] = vals  # later writes win
        # Merged runs on one row never overlap or touch: no two programs share a cell.
        for runs in t._pending.values():
            runs = sorted(runs)
            assert all(a[1] < b[0] for a, b in zip(runs, runs[1:]))
        t.apply_write()
        np.testing.assert_array_equal(t.gpu.numpy(), model)
    assert len(launches.grids) == 3


def test_merge_never_overwrites_unwritten_gap_cells():
    # A device-side update (as post_update does) that the host mirror does not see must
    # survive a later apply whose writes do not cover it, even when they sit around it.
    t = StagedWriteTensor((2, 16), torch.int32, "cpu")
    t.gpu[0, 5] = 99  # "kernel" advanced this cell on the device
    t.stage_write(0, 0, [1, 2, 3])  # [0, 3)
    t.stage_write(0, 7, [4, 5])  # [7, 9)
    t.stage_write(0, 2, [6, 7])  # [2, 4): merges with [0, 3) only
    t.apply_write()
    assert t.gpu[0, :9].tolist() == [1, 2, 6, 7, 0, 99, 0, 4, 5]


def test_out_of_bounds_and_bad_dtype_raise():
    t = StagedWriteTensor((3, 4), torch.int32, "cpu")
    with pytest.raises(IndexError):
        t.stage_write(3, 0, [1])
    with pytest.raises(IndexError):
        t.stage_write(0, 2, [1, 2, 3])
    scalars = StagedWriteTensor(3, torch.int32, "cpu")  # stage_write_elem's own path
    for row in (3, -1):
        with pytest.raises(IndexError):
            scalars.stage_write_elem(row, 1)
    assert scalars.num_pending_writes == 0
    with pytest.raises(ValueError):
        StagedWriteTensor((3, 4), torch.float16, "cpu")


def test_row_scalars_of_several_tables_in_one_launch(monkeypatch):
    """apply_row_scalars against a NumPy model of the tables: rows written once, twice
    (the last value wins) or not at all, int32 and int64 tables (an int64 value beyond
    int32 stays whole in its table), a table with nothing staged; one launch per apply,
    none when nothing is staged, and the writes never leak into another table."""
    counter = _LaunchCounter(sw._apply_row_scalars_kernel)
    monkeypatch.setattr(sw, "_apply_row_scalars_kernel", counter)
    rng = np.random.default_rng(3)
    dtypes = [torch.int32, torch.int32, torch.int64, torch.int32, torch.int64]
    tables = [StagedWriteTensor(23, d, "cpu") for d in dtypes]
    models = [np.zeros(23, dtype=_NP[d]) for d in dtypes]
    for step in range(6):
        for k, (t, m) in enumerate(zip(tables, models)):
            if k == step % 5:
                continue  # one table stages nothing this step
            for row in rng.choice(23, size=rng.integers(0, 6), replace=True):
                big = dtypes[k] == torch.int64 and rng.random() < 0.5
                value = int(rng.integers(2**40, 2**50)) if big else int(rng.integers(-99, 99))
                t.stage_write_elem(int(row), value)
                m[row] = value
        staged = sum(t.num_pending_writes for t in tables)
        before = len(counter.grids)
        sw.apply_row_scalars(tables)
        assert counter.grids[before:] == ([(staged,)] if staged else [])
        for t, m in zip(tables, models):
            np.testing.assert_array_equal(t.gpu.numpy(), m)
            assert t.num_pending_writes == 0
    n = len(counter.grids)
    sw.apply_row_scalars(tables)  # nothing staged: no launch
    assert len(counter.grids) == n > 0


def test_row_scalars_refuse_tables_they_cannot_take():
    with pytest.raises(ValueError, match="1-D int32 / int64"):
        sw.apply_row_scalars([StagedWriteTensor((4, 2), torch.int32, "cpu")])
    with pytest.raises(ValueError, match="1-D int32 / int64"):
        sw.apply_row_scalars([StagedWriteTensor(4, torch.float32, "cpu")])
    with pytest.raises(ValueError, match="at most"):
        sw.apply_row_scalars([StagedWriteTensor(4, torch.int32, "cpu")] * 7)
