"""Warm the L2 cache with a weight while the memory bus is idle.

At batch 1 a decoder layer streams its weights, except between the qkv projection and the
output projection: the KV write, the attention kernel and its split reduce read a few MB
and are bound by latency, so HBM idles for several microseconds. A kernel on a side stream
can spend that time pulling the output projection's weight (33.5 MB for Llama-3-8B; the
H200's L2 holds 50 MB) into L2, so the projection then reads it from there.

One thread issues one bulk prefetch (cp.async.bulk.prefetch.L2, sm_90+: the copy engine
fetches CHUNK bytes, no registers, nothing to wait for). Nothing is written: the kernel
cannot change a result, only the time of the kernels after it.
"""

from __future__ import annotations

import torch

from shared.triton_utils import INTERPRET, _capability, tl, triton

CHUNK = 4096  # bytes per prefetch instruction (a multiple of 16)
BLOCK = 128  # prefetches per program: one per thread of 4 warps


@triton.jit
def _l2_prefetch_kernel(base_ptr, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # the last program's spare lanes fetch the tensor's first chunk again (harmless)
    idx = tl.where(idx < num_chunks, idx, 0)
    ptrs = base_ptr + idx.to(tl.int64) * CHUNK
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r", [ptrs, tl.full([BLOCK], CHUNK, tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1,
    )


def supported(t: torch.Tensor) -> bool:
    return t.is_cuda and not INTERPRET and _capability(t.device) >= (9, 0)


def l2_prefetch(t: torch.Tensor) -> None:
    """Start pulling a contiguous tensor into L2 (whole CHUNKs: the tail past the last
    whole one is left out). A no-op where unsupported."""
    if not supported(t):
        return
    assert t.is_contiguous()
    num_chunks = t.numel() * t.element_size() // CHUNK
    if num_chunks == 0:
        return
    # the chunk addresses must be 16-byte aligned: CHUNK is, and so is a CUDA allocation
    assert t.data_ptr() % 16 == 0
    _l2_prefetch_kernel[(triton.cdiv(num_chunks, BLOCK),)](
        t.view(torch.uint8), num_chunks, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=BLOCK // 32)
