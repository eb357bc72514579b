"""Gumbel-max sampling in Triton: the shared noise, per-block argmax, final reduction.

The noise's device functions come from shared/sampling/noise_kernels.py, bit-identical
to shared/sampling/noise.py (the spec is in its docstring). Every floating-point step
matches the PyTorch V1 sampler operation by operation: fp32 division with `div_rn` (a plain `/` is an
approximate division on the GPU), launches with enable_fp_fusion=False (no FMA), so
seeded tokens agree across runners, batch makeup and row order.

Per-request state is read through idx_mapping (batch row -> state row) inside the
kernels. Grids depend only on (num rows, vocab size): CUDA-graph friendly, no host sync.
"""

from __future__ import annotations

import torch

from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton
from shared.sampling.noise_kernels import NOISE_BLOCK, gumbel_noise, row_lanes


@triton.jit
def div_ieee(x, y, IS_FP64: tl.constexpr):
    """x / y correctly rounded, as torch computes it."""
    if IS_FP64:
        r = x / y
    else:
        r = tl.math.div_rn(x, y)
    return r


@triton.jit
def to_compute(x, IS_FP64: tl.constexpr):
    """Logits in the compute dtype: float32, or float64 for fp64 models (exact)."""
    if IS_FP64:
        x = x.to(tl.float64)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def load_logits(row_ptr, offs, valid, IS_FP64: tl.constexpr):
    """One block of a row in the compute dtype; lanes past the vocabulary read -inf."""
    return to_compute(tl.load(row_ptr + offs, mask=valid, other=float("-inf")), IS_FP64)


# ---- sampling -----------------------------------------------------------------------


@triton.jit
def _gumbel_sample_kernel(
    logits_ptr,  # [N, vocab_size] processed (or raw) logits, any float dtype, row stride
    logits_stride,
    idx_mapping_ptr,  # int32 [N]: batch row -> state row
    pos_ptr,  # int64 [N]: position of each logit's input token
    temperature_ptr,  # float32 [R]
    seeds_ptr,  # int64 [R]
    threshold_ptr,  # [N] compute dtype: keep scaled >= threshold (read iff HAS_THRESHOLD)
    block_max_ptr,  # float64 [N, num_blocks]
    block_arg_ptr,  # int64 [N, num_blocks]
    vocab_size,
    num_blocks,
    BLOCK: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    IS_FP64: tl.constexpr,
    ALL_GREEDY: tl.constexpr,  # every row greedy: pos_ptr, seeds, temperatures unread
):
    b = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    valid = offs < vocab_size
    x = load_logits(logits_ptr + b * logits_stride, offs, valid, IS_FP64)
    if ALL_GREEDY:  # static: the noise code is not even compiled
        score = x.to(tl.float64)
    else:
        row = tl.load(idx_mapping_ptr + b)
        temp = tl.load(temperature_ptr + row)
        if temp == 0:
            score = x.to(tl.float64)  # greedy: argmax of the processed logits, no noise
        else:
            scaled = div_ieee(x, temp.to(x.dtype), IS_FP64)
            lane_hi, lane_lo = row_lanes(tl.load(seeds_ptr + row), tl.load(pos_ptr + b))
            score = scaled.to(tl.float64) + gumbel_noise(lane_hi, lane_lo, offs)
            if HAS_THRESHOLD:
                score = tl.where(scaled >= tl.load(threshold_ptr + b), score, float("-inf"))
    score = tl.where(valid, score, float("-inf"))
    best = tl.argmax(score, 0, tie_break_left=True)
    tl.store(block_max_ptr + b * num_blocks + blk, tl.max(score, 0))
    tl.store(block_arg_ptr + b * num_blocks + blk, (blk * BLOCK + best).to(tl.int64))


@triton.jit
def _reduce_blocks_kernel(
    block_max_ptr,  # float64 [N, num_blocks]
    block_arg_ptr,  # int64 [N, num_blocks]
    out_ptr,  # int64 [N]
    num_blocks,
    BLOCK: tl.constexpr,  # >= num_blocks
):
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = tl.load(block_max_ptr + b * num_blocks + offs, mask=offs < num_blocks, other=float("-inf"))
    best = tl.argmax(m, 0, tie_break_left=True)  # lowest block: lowest id on ties
    tl.store(out_ptr + b, tl.load(block_arg_ptr + b * num_blocks + best))


def gumbel_sample(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    threshold: torch.Tensor | None,
    block: int = NOISE_BLOCK,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sampled token ids int64 [N]: greedy rows take the argmax, random rows Gumbel-max
    over scaled = logits / temperature restricted to scaled >= threshold (when given).
    positions None: the caller knows every row is greedy (no noise is drawn, so none is
    keyed; the kernel then reads no per-row parameter at all).
    workspace: (float64, int64) buffers of at least N * num_blocks elements for the
    per-block results, reused across calls (stream order keeps reuse safe); allocated
    per call without it."""
    n, vocab_size = logits.shape
    assert logits.stride(1) == 1
    assert idx_mapping.dtype == torch.int32 and idx_mapping.shape == (n,)
    all_greedy = positions is None
    if all_greedy:
        assert threshold is None, "a threshold filters random rows only"
        positions = idx_mapping  # never read
    else:
        assert positions.dtype == torch.int64 and positions.shape == (n,)
    assert temperature.dtype == torch.float32 and seeds.dtype == torch.int64
    is_fp64 = logits.dtype == torch.float64
    if threshold is not None:
        assert threshold.shape == (n,)
        assert threshold.dtype == (torch.float64 if is_fp64 else torch.float32)
    num_blocks = triton.cdiv(vocab_size, block)
    if workspace is not None and workspace[0].numel() >= n * num_blocks:
        block_max = workspace[0][: n * num_blocks].view(n, num_blocks)
        block_arg = workspace[1][: n * num_blocks].view(n, num_blocks)
    else:
        block_max = torch.empty(n, num_blocks, dtype=torch.float64, device=logits.device)
        block_arg = torch.empty(n, num_blocks, dtype=torch.int64, device=logits.device)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    kept(_gumbel_sample_kernel)((n, num_blocks),
        logits, logits.stride(0), idx_mapping, positions, temperature, seeds,
        threshold if threshold is not None else block_max, block_max, block_arg,
        vocab_size, num_blocks,
        BLOCK=block, HAS_THRESHOLD=threshold is not None, IS_FP64=is_fp64,
        ALL_GREEDY=all_greedy, enable_fp_fusion=False,
    )
    kept(_reduce_blocks_kernel)((n,),
        block_max, block_arg, out, num_blocks, BLOCK=triton.next_power_of_2(num_blocks)
    )
    return out
