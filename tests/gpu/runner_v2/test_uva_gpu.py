"""UVA helpers on the GPU machine: the zero-copy device view of pinned host memory. The
CPU fallbacks are in tests/runner_v2/test_uva.py."""

from __future__ import annotations

import pytest
import torch

from runner_v2.uva import device_view_of_pinned, is_uva_available
from shared.runtime.host_buffers import pinned_empty

pytestmark = pytest.mark.gpu


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
