"""post_update on CUDA (GPU machine only): the NumPy-model test of
tests/runner_v2/test_post_update.py, run with device="cuda"."""

from __future__ import annotations

import pytest

from tests.runner_v2 import test_post_update as on_cpu

pytestmark = pytest.mark.gpu


def test_post_update_matches_numpy_model():
    on_cpu.test_post_update_matches_numpy_model("cuda")
