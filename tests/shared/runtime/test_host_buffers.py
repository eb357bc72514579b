"""The one pinned-memory helper both runners allocate through: it pins exactly when
pinning is possible, and never raises without CUDA."""

from __future__ import annotations

import pytest
import torch

from shared.runtime.host_buffers import is_pin_memory_available, pinned_empty, pinned_zeros


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback exists only without CUDA")
def test_plain_host_tensors_without_cuda():
    assert not is_pin_memory_available()
    for make in (pinned_empty, pinned_zeros):
        t = make((3, 4), torch.int32)  # must not raise although pinning is impossible
        assert t.shape == (3, 4) and t.dtype == torch.int32 and t.device.type == "cpu"
        assert not t.is_pinned()
    assert pinned_zeros(5, torch.float32).tolist() == [0.0] * 5
