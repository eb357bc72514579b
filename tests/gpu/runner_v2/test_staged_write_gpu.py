"""StagedWriteTensor on CUDA (GPU machine only): a UVA-backed table written by the kernel
through its device view, and a device table. The NumPy-model tests are in
tests/runner_v2/test_staged_write.py."""

from __future__ import annotations

import pytest
import torch

from runner_v2.staged_write import StagedWriteTensor

pytestmark = pytest.mark.gpu


def test_uva_table_on_cuda():
    t = StagedWriteTensor((8, 32), torch.int32, "cuda", uva_instead_of_gpu=True)
    assert t.uses_uva and t.gpu.is_cuda
    t.stage_write(3, 4, list(range(10)))
    t.apply_write()
    torch.cuda.synchronize()
    # The kernel wrote pinned host memory through the UVA view.
    assert t._host_base[3, 4:14].tolist() == list(range(10))
    assert t.gpu.data_ptr() == t._host_base.data_ptr()


def test_device_table_on_cuda():
    t = StagedWriteTensor((8, 32), torch.float32, "cuda")
    t.stage_write(2, 1, [1.5, 2.5])
    t.apply_write()
    assert t.gpu[2, :4].cpu().tolist() == [0.0, 1.5, 2.5, 0.0]
