"""UVA helpers: the CPU fallbacks (the zero-copy device view on the GPU machine:
tests/gpu/runner_v2/test_uva_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner_v2.uva import (
    async_copy_to_device,
    device_view_of_pinned,
    is_uva_available,
)
from shared.runtime.host_buffers import pinned_empty


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallbacks exist only without CUDA")
def test_cpu_fallbacks_without_cuda():
    assert not is_uva_available()
    t = pinned_empty((3, 4), torch.int32)  # must not raise although pinning is impossible
    assert t.shape == (3, 4) and not t.is_pinned()
    assert device_view_of_pinned(t) is t  # the device is the CPU
    src = np.arange(5, dtype=np.int64)
    out = torch.zeros(5, dtype=torch.int64)
    async_copy_to_device(src, "cpu", out=out)
    src[:] = -1  # the copy is independent of the source afterwards
    assert out.tolist() == [0, 1, 2, 3, 4]
