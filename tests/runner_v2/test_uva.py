"""UVA helpers: CPU fallbacks here, the zero-copy device view on the GPU machine."""

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


@pytest.mark.gpu
def test_device_view_is_zero_copy_and_coherent_both_ways():
    assert is_uva_available()
    host = pinned_empty((4, 8), torch.int64)
    assert host.is_pinned()
    host.copy_(torch.arange(32).view(4, 8))
    view = device_view_of_pinned(host)
    assert view.is_cuda and view.data_ptr() == host.data_ptr()
    assert view.sum().item() == sum(range(32))  # device reads host memory
    view[1].fill_(-1)  # device writes host memory
    torch.cuda.synchronize()
    assert host[1].tolist() == [-1] * 8
    del host  # the view keeps the pinned memory alive
    assert view[1].sum().item() == -8
