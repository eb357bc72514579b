"""The top-k token ids of logprob rows, with ties broken the same way in every batch.

torch.topk leaves the order among equal values to its algorithm, which follows the shape:
in bf16, where a row of logits holds many exact ties, a token's top-k set could change
with its batch (measured on the H200: a solo run and the batch kept different ids of two
equal logprobs). In batch-invariant mode the ids come from a stable descending sort
instead, so among equal values the lower token id comes first, whatever the batch. It
costs a full sort of each row that asks for logprobs, so only that mode pays it.
"""

from __future__ import annotations

import torch

from shared.runtime.kernel_options import kernel_options


def top_ids(raw: torch.Tensor, k: int) -> torch.Tensor:
    """[R, V] -> [R, k] int64: the ids of each row's k largest values."""
    if kernel_options().batch_invariant:
        return torch.sort(raw, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.topk(raw, k, dim=-1).indices
