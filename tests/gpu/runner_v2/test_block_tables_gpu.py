"""BlockTables' per-step prepare on CUDA (GPU machine only): the NumPy-model test of
tests/runner_v2/test_block_tables.py, run with device="cuda"."""

from __future__ import annotations

import pytest

from tests.runner_v2 import test_block_tables as on_cpu

pytestmark = pytest.mark.gpu


def test_prepare_matches_numpy_pads_rows_and_slots():
    on_cpu.test_prepare_matches_numpy_pads_rows_and_slots("cuda")
