"""V2 input prep on CUDA (GPU machine only): the mixed-batch tests of
tests/runner_v2/test_input_prep.py, on a state table built with device="cuda"."""

from __future__ import annotations

import pytest

from tests.runner_v2 import test_input_prep as on_cpu

pytestmark = pytest.mark.gpu


@pytest.fixture
def mixed():
    return on_cpu.make_mixed("cuda")


def test_mixed_batch_matches_numpy(mixed):
    on_cpu.test_mixed_batch_matches_numpy(mixed)


def test_one_launch_per_step_decode_and_mixed(mixed, monkeypatch):
    on_cpu.test_one_launch_per_step_decode_and_mixed(mixed, monkeypatch)


def test_buffers_keep_their_addresses(mixed):
    on_cpu.test_buffers_keep_their_addresses(mixed)
