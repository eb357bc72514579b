"""FLASH_ATTN backend: what a machine without flash-attn sees, and its block-size rule.
(Its numerics are checked against TORCH in tests/gpu/shared/attention/test_attention_gpu.py,
where flash-attn is importable.)"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from shared.attention.selector import AttentionBackendError, get_attn_backend
from tests.oracles.paged_attention import make_batch

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


@pytest.mark.skipif(HAS_FLASH_ATTN, reason="flash-attn is installed here")
def test_missing_flash_attn_is_a_clear_error():
    with pytest.raises(AttentionBackendError) as info:
        get_attn_backend("FLASH_ATTN", torch.device("cpu"))
    message = str(info.value)
    assert "not installed" in message
    assert "pip install flash-attn --no-build-isolation" in message
    assert "CUDA" in message and "'TRITON'" in message and "'TORCH'" in message


def test_block_size_must_be_a_multiple_of_256(monkeypatch):
    from shared.attention import flash_attn_backend

    # Build the metadata without flash-attn: the block-size check happens before any
    # kernel is needed.
    monkeypatch.setattr(flash_attn_backend, "_import_flash_attn", lambda: (None, None))
    builder = flash_attn_backend.FlashAttnBackend().make_builder(torch.device("cpu"))
    with pytest.raises(AttentionBackendError, match="multiple of 256"):
        builder.build(make_batch([1, 2], [5, 9], 4, 2, 16, 16).common)
    metadata = builder.build(make_batch([1, 2], [5, 9], 4, 2, 16, 256, pad_reqs=1).common)
    assert metadata.cu_seqlens_k.tolist() == [0, 5, 14, 14]  # padded row adds no keys
    assert metadata.cu_seqlens_k.dtype == torch.int32 and not metadata.uniform_decode
