"""Batch-invariant mode: what it turns on, what it refuses, what it cannot make invariant.

A row's result depends on how many other rows share its kernels: cuBLAS and the GEMV path
pick their algorithm (split-K, tiles) by the token count, the split-KV decode attention
picks its split count from the batch, and a decode row and a prefill row go through
attention programs with different tiles. So the same request gives bitwise different
logits alone and inside a batch, and near-ties split V1 from V2 in bf16. With the mode on
(`EngineArgs.batch_invariant`, `--batch-invariant`, RUNNERLAB_BATCH_INVARIANT=1) the
engine's KernelOptions carry `batch_invariant=True` and every kernel launcher on the step's
path takes its invariant form (shared/model/kernels/batch_invariant_matmul.py for every
linear layer and the LM head, fixed-size KV splits and one launch config for both
mappings of the TRITON attention). Vectorised per-row ops (RMSNorm, RoPE, SiLU-and-mul, the samplers'
softmax and top-k over the vocabulary) are already computed one row at a time.

What the mode cannot make invariant is listed, never silently ignored: it is in
`BatchInvariance.not_invariant`, logged as a warning at engine start and shown by
`explain`. A backend that cannot honour the mode at all is refused by name.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Backends whose kernels choose their work split from the batch, with no invariant form.
REFUSED_BACKENDS = {
    "FLASH_ATTN": "flash-attn chooses its KV split count from the batch (num_splits=0 "
                  "heuristics) and has no fixed-split mode here",
}


class BatchInvariance(BaseModel):
    """The resolved mode: on or off, and what stays batch-variant under this config."""

    model_config = ConfigDict(frozen=True)

    enabled: bool = False
    not_invariant: tuple[str, ...] = ()


def resolve_batch_invariance(enabled: bool, *, attention_backend: str,
                             tensor_parallel_size: int) -> BatchInvariance:
    """Check the mode against the resolved backend and parallel sizes. Raises ValueError
    for a backend that cannot honour it; lists what stays variant."""
    if not enabled:
        return BatchInvariance()
    if attention_backend in REFUSED_BACKENDS:
        raise ValueError(
            f"batch_invariant=True with attention_backend={attention_backend!r}: "
            f"{REFUSED_BACKENDS[attention_backend]}; accepted: attention_backend='TRITON' "
            "(or 'TORCH' on CPU), or batch_invariant=False")
    variant: list[str] = []
    if attention_backend == "TORCH":
        variant.append(
            "attention on the TORCH backend is invariant to the batch (each request alone) "
            "but not to chunking: a token's scores are a matmul whose shape follows its "
            "request's query length, so the same token differs between a prefill chunk and "
            "a decode step (attention_backend='TRITON' computes both in one order)")
    if tensor_parallel_size > 1:
        variant.append(
            f"the tensor-parallel all-reduces (tensor_parallel_size={tensor_parallel_size}): "
            "the collective library picks its reduction algorithm and order by message size, "
            "which grows with the batch")
    return BatchInvariance(enabled=True, not_invariant=tuple(variant))
