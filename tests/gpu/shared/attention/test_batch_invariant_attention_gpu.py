"""The batch-invariant attention on the GPU (issue 26): the CPU test's needle, a token
computed as a decode row alone, at several positions of decode batches, and inside prefill
chunks of several lengths, bitwise the same in bf16 and float32 (tensor-core and "ieee"
dots), with its KV splits folded by the reduction kernel or inside the programs; and with
the mode off the same comparison finds a difference (the split count follows the batch,
and the two mappings have different tiles).
"""

from __future__ import annotations

import pytest
import torch

from shared.attention import triton_backend
from tests.shared.attention.test_batch_invariant_attention import World, needle_rows

pytestmark = pytest.mark.gpu


# Splits of 64 keys (the needle's 150 keys in three, the last partial) and of 256 (one);
# the GPU's SM count sends the decode rows to split programs folded by the reduction,
# one "SM" to programs that fold their row's splits themselves.
@pytest.mark.parametrize("num_sms", [None, 1])
@pytest.mark.parametrize("split_tokens", [64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_token_is_bitwise_the_same_in_every_scheduling(kernel_opts, monkeypatch, dtype,
                                                         split_tokens, num_sms):
    if num_sms is not None:
        monkeypatch.setattr(triton_backend, "_num_sms", lambda device: num_sms)
    kernel_opts(batch_invariant=True, invariant_split_tokens=split_tokens)
    rows = needle_rows(World(7, dtype, device="cuda"))
    alone = rows.pop("alone")
    assert not alone.isnan().any()
    differing = [name for name, row in rows.items() if not torch.equal(row, alone)]
    assert not differing, differing


def test_without_the_mode_a_scheduling_differs():
    rows = needle_rows(World(7, torch.bfloat16, device="cuda"))
    alone = rows.pop("alone")
    assert any(not torch.equal(row, alone) for row in rows.values())
