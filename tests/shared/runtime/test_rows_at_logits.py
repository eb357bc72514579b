"""rows_at_logits against a NumPy gather at each request's last token (a cumulative sum of
the query lengths), on padded token tensors, decode-only and mixed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.runtime.model_executor import rows_at_logits


@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1, 1], [1], [3, 1, 1, 7], [1, 1, 2]])
def test_last_token_rows_as_numpy_gathers_them(query_lens: list[int]) -> None:
    rng = np.random.default_rng(len(query_lens))
    num_tokens = sum(query_lens)
    padded = num_tokens + 3  # graph padding: rows no request owns
    hidden = rng.standard_normal((padded, 6))
    positions = rng.integers(0, 1000, padded)
    last = np.cumsum(query_lens) - 1
    indices = torch.from_numpy(last)
    for x in (hidden, positions):
        got = rows_at_logits(torch.from_numpy(x), indices, len(query_lens), num_tokens)
        np.testing.assert_array_equal(got.numpy(), x[last])


def test_decode_step_takes_a_view_not_a_gather() -> None:
    x = torch.arange(24.0).view(8, 3)
    got = rows_at_logits(x, torch.arange(5), 5, 5)
    assert got.data_ptr() == x.data_ptr() and got.shape == (5, 3)
