"""The pinned-memory helper with CUDA (GPU machine only): it pins. Without CUDA:
tests/shared/runtime/test_host_buffers.py."""

from __future__ import annotations

import pytest
import torch

from shared.runtime.host_buffers import is_pin_memory_available, pinned_empty, pinned_zeros

pytestmark = pytest.mark.gpu


def test_pinned_with_cuda():
    assert is_pin_memory_available()
    assert pinned_empty((2, 3), torch.int64).is_pinned()
    zeros = pinned_zeros(7, torch.int32)
    assert zeros.is_pinned() and zeros.tolist() == [0] * 7
