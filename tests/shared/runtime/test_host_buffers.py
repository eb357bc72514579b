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


def test_packed_copy_gives_each_array_back_with_its_dtype_and_shape():
    """Against the arrays themselves: values, dtypes and shapes (odd byte counts, an
    empty array, a 2-D one, a non-contiguous one), and nothing shared with the sources."""
    import numpy as np

    from shared.runtime.host_buffers import copy_packed_to_device

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(0)
    arrays = [np.arange(5, dtype=np.int32), rng.integers(-9, 9, (3, 4)).astype(np.int64),
              np.zeros(0, dtype=np.int64), np.array([1.5, -2.25]), np.array([7], np.int32),
              rng.integers(0, 9, (4, 6)).astype(np.int32)[:, ::2]]
    want = [a.copy() for a in arrays]
    got = copy_packed_to_device(arrays, device)
    for a in arrays:
        a[...] = 0  # the copy is independent of the sources from the call on
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.device.type == device and g.dtype == torch.from_numpy(w).dtype
        assert tuple(g.shape) == w.shape
        assert np.array_equal(g.cpu().numpy(), w)
    assert copy_packed_to_device([], device) == []
