"""Raw logprobs of the sampled token (and the top-n) with its rank, from raw logits.

"Raw" = log_softmax of the unprocessed logits (vLLM's raw mode): penalties,
temperature and filters do not change what is reported. A Triton kernel computes each
row's logsumexp (in float64, like V1, so that the rounded logprobs agree to the last
bit almost always) and the sampled token's rank (1 + number of tokens with a strictly
larger logit) in two passes over the row; the top-n ids come from torch.topk. Only
the selected ids are turned into logprobs: column 0 is the sampled token.
"""

from __future__ import annotations

import torch

from runner_v2.sample.gumbel import load_logits, to_compute
from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton
from shared.sampling.top_ids import top_ids

LOGPROBS_BLOCK = 1024


@triton.jit
def _lse_rank_kernel(
    logits_ptr,  # [N, vocab_size] raw logits, any float dtype, row stride logits_stride
    logits_stride,
    sampled_ptr,  # int64 [N]
    lse_ptr,  # float64 [N]
    rank_ptr,  # int64 [N]
    vocab_size,
    BLOCK: tl.constexpr,
    IS_FP64: tl.constexpr,
):
    b = tl.program_id(0)
    row_ptr = logits_ptr + b * logits_stride
    x_tok = to_compute(tl.load(row_ptr + tl.load(sampled_ptr + b)), IS_FP64)
    m = x_tok  # any value of the row is a valid start for the max
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.max(load_logits(row_ptr, offs, offs < vocab_size, IS_FP64), 0))
    m64 = m.to(tl.float64)
    total = tl.zeros([], tl.float64)
    greater = tl.zeros([], tl.int64)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = load_logits(row_ptr, offs, offs < vocab_size, IS_FP64)
        total += tl.sum(tl.exp(x.to(tl.float64) - m64), 0)  # masked lanes: exp(-inf) = 0
        greater += tl.sum((x > x_tok).to(tl.int64), 0)
    tl.store(lse_ptr + b, m64 + tl.log(total))
    tl.store(rank_ptr + b, greater + 1)


def compute_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, max_num_logprobs: int, block: int = LOGPROBS_BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (token ids int64 [N, 1 + n], logprobs [N, 1 + n] compute dtype, ranks int64 [N])."""
    n, vocab_size = logits.shape
    assert logits.stride(1) == 1
    assert sampled.dtype == torch.int64 and sampled.shape == (n,)
    assert max_num_logprobs >= 0
    is_fp64 = logits.dtype == torch.float64
    cdt = torch.float64 if is_fp64 else torch.float32
    lse = torch.empty(n, dtype=torch.float64, device=logits.device)
    ranks = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n > 0:
        kept(_lse_rank_kernel)((n,),
            logits, logits.stride(0), sampled, lse, ranks, vocab_size,
            BLOCK=block, IS_FP64=is_fp64,
        )
    raw = logits.to(cdt)  # no copy for float32 / float64 logits
    ids = sampled[:, None]
    if max_num_logprobs > 0:
        # topk on the compute dtype, as V1 does, so ties break the same way
        ids = torch.cat([ids, top_ids(raw, max_num_logprobs)], dim=1)
    logprobs = (raw.gather(1, ids).to(torch.float64) - lse[:, None]).to(cdt)
    return ids, logprobs, ranks
