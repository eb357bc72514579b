"""top_ids in batch-invariant mode against a NumPy oracle: the k largest values of a row,
ties broken towards the lower token id, on rows full of exact ties (bf16-like logits), the
same for a row alone and inside a batch."""

from __future__ import annotations

import numpy as np
import torch

from shared.sampling.top_ids import top_ids


def _oracle(row: np.ndarray, k: int) -> list[int]:
    # lexsort: last key primary -> by value descending, then by id ascending
    return list(np.lexsort((np.arange(row.size), -row))[:k])


def test_ties_break_to_the_lower_id_alone_and_in_a_batch(kernel_opts):
    kernel_opts(batch_invariant=True)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 6, size=(9, 300)).astype(np.float32)  # ~50 copies of each value
    got = top_ids(torch.from_numpy(rows), 20)
    for i, row in enumerate(rows):
        assert got[i].tolist() == _oracle(row, 20)
        assert top_ids(torch.from_numpy(rows[i: i + 1]), 20)[0].tolist() == got[i].tolist()


def test_without_the_mode_the_values_are_still_the_top_k():
    rows = torch.randn(4, 100)
    got = top_ids(rows, 5)
    torch.testing.assert_close(rows.gather(1, got), rows.topk(5).values)
