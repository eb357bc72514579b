"""The KV-split merge done by the decode attention's last split, in place of
`reduce_splits_kernel`: one kernel boundary fewer on the batch-1 critical path.

Each split program of a (row, KV head) stores its partials as before, then counts itself
in on an int32 counter (one atomic, acquire-release at GPU scope, after a CTA barrier so
every thread's stores precede it). The program that counts last reads every split's
partials of the KV head's GROUP query heads back from L2 and merges them: the maxima and
sums as one [GROUP, splits] load, the outputs in chunks of [GROUP, S_CHUNK, D]. It then
zeroes the counter for the next launch. The merge is the reduce kernel's formula
(weights exp2(m_s - max m), output sum w_s acc_s / sum w_s l_s); only the order of the
summation over splits can differ.

The counters live in one buffer per device, allocated once and never moved (a captured
graph keeps its pointer) and zero between launches. Layers share it: a layer's attention
kernel completes before the next layer's touches a counter (each waits on the kernel before
it, and that chain passes through the previous attention).
"""

from __future__ import annotations

import torch

from shared.triton_utils import tl, triton

# (row, KV head) pairs one buffer can count: a fused decode launch has fewer pairs than
# the GPU has SMs (triton_backend.FUSED_DECODE_KV_WRITE), so this is never the limit.
MAX_COUNTERS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed int32 counters, allocated on first use. That first use must not
    be inside a CUDA-graph capture (the buffer would belong to the graph's pool): the
    runners run every batch shape eagerly before they capture it."""
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "decode attention split join: the counters were first needed inside a "
                "CUDA-graph capture; run the batch eagerly once before capturing it")
        _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


@triton.jit
def join_splits(output_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, count_ptr, num_used,
                part0, token, head0, stride_ot, stride_oh, stride_od,
                GROUP: tl.constexpr, GROUP_P2: tl.constexpr, NUM_SPLITS: tl.constexpr,
                BLOCK_S: tl.constexpr, S_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Count this split in; the last of the num_used splits merges the partials of query
    heads head0 .. head0 + GROUP - 1 (partial index part0 + g * NUM_SPLITS + s) into
    output[token]."""
    tl.debug_barrier()  # every thread's partial stores, then the one release below
    if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == num_used - 1:
        tl.atomic_xchg(count_ptr, 0)
        offs_g = tl.arange(0, GROUP_P2)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        g_valid = offs_g < GROUP
        d_valid = offs_d < HEAD_DIM
        first = part0 + offs_g * NUM_SPLITS  # [GROUP_P2]: each head's split 0
        used = g_valid[:, None] & (offs_s < num_used)[None, :]
        # .cg: from L2, where the other programs' stores are (L1 is per SM, not coherent)
        m = tl.load(part_max_ptr + first[:, None] + offs_s[None, :], mask=used,
                    other=float("-inf"), cache_modifier=".cg")
        lsum = tl.load(part_sum_ptr + first[:, None] + offs_s[None, :], mask=used, other=0.0,
                       cache_modifier=".cg")
        m_max = tl.where(g_valid, tl.max(m, 1), 0.0)  # padded heads: no -inf - -inf
        denom = tl.sum(tl.where(used, tl.math.exp2(m - m_max[:, None]), 0.0) * lsum, 1)
        out = tl.zeros([GROUP_P2, BLOCK_D], dtype=part_out_ptr.dtype.element_ty)
        for c in range(0, num_used, S_CHUNK):
            offs_c = c + tl.arange(0, S_CHUNK)
            in_chunk = g_valid[:, None] & (offs_c < num_used)[None, :]
            m_c = tl.load(part_max_ptr + first[:, None] + offs_c[None, :], mask=in_chunk,
                          other=float("-inf"), cache_modifier=".cg")
            w_c = tl.where(in_chunk, tl.math.exp2(m_c - m_max[:, None]), 0.0)
            part = first[:, None] + offs_c[None, :]  # [GROUP_P2, S_CHUNK]
            acc_c = tl.load(
                part_out_ptr + part[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                mask=in_chunk[:, :, None] & d_valid[None, None, :], other=0.0,
                cache_modifier=".cg")
            out += tl.sum(acc_c * w_c[:, :, None], 1)
        denom = tl.where(g_valid, denom, 1.0)
        tl.store(output_ptr + token * stride_ot + (head0 + offs_g)[:, None] * stride_oh
                 + offs_d[None, :] * stride_od,
                 (out / denom[:, None]).to(output_ptr.dtype.element_ty),
                 mask=g_valid[:, None] & d_valid[None, :])
