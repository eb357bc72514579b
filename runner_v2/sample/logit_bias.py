"""allowed_token_ids and logit_bias: per-state-row device tables and their two kernels.

Per batch row b (state row = idx_mapping[b]), on the logits in the compute dtype
(float32, float64 for fp64 logits), as tests/oracles/sampling_reference.py does:
  allowed_token_ids: every token not in the row's list gets -inf;
  logit_bias:        x[t] = x[t] + float32(bias), widened exactly to the compute dtype.
Ids >= vocab_size are ignored by both (they are kept in the table as vocab_size).

Tables (allocated on the first request that uses either built-in, or eagerly with
`ensure_allocated()`), one fixed-width row per state row:
  allowed_ids int32 [R, max_allowed]  + num_allowed int32 [R]   (0: no list)
  bias_ids    int32 [R, max_bias]     + bias_values float32 [R, max_bias] + num_bias [R]
Once the tables exist every add writes its row in full (counts, ids, values, padding).

Staging, packing and the lazy allocation follow runner_v2/sample/row_tables.py.
"""

from __future__ import annotations

import numpy as np
import torch

from runner_v2.sample.gumbel import load_logits, to_compute
from runner_v2.sample.row_tables import StagedRowTables, clamp_ids
from shared.contract.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS_TOKENS,
    SamplingParams,
)
from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton

MASK_BLOCK = 1024


class LogitBiasState(StagedRowTables):
    NUM_PARTS = 3  # allowed ids, bias ids, bias float32 bit patterns

    def __init__(
        self,
        max_num_reqs: int,
        vocab_size: int,
        device: torch.device | str,
        max_allowed: int = MAX_ALLOWED_TOKEN_IDS,
        max_bias: int = MAX_LOGIT_BIAS_TOKENS,
    ) -> None:
        super().__init__(max_num_reqs, vocab_size, device)
        self.max_allowed = max_allowed
        self.max_bias = max_bias
        self.allowed_ids: torch.Tensor | None = None
        self.num_allowed: torch.Tensor | None = None
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        self.num_bias: torch.Tensor | None = None
        # host mirrors: which stages a batch needs, decided without the device
        self.num_allowed_np = np.zeros(max_num_reqs, np.int32)
        self.num_bias_np = np.zeros(max_num_reqs, np.int32)

    @property
    def allocated(self) -> bool:
        return self.num_allowed is not None

    def ensure_allocated(self) -> None:
        if self.allocated:
            return
        r, dev = self.max_num_reqs, self.device
        self.allowed_ids = torch.full((r, self.max_allowed), -1, dtype=torch.int32, device=dev)
        self.num_allowed = torch.zeros(r, dtype=torch.int32, device=dev)
        self.bias_ids = torch.full((r, self.max_bias), -1, dtype=torch.int32, device=dev)
        self.bias_values = torch.zeros(r, self.max_bias, dtype=torch.float32, device=dev)
        self.num_bias = torch.zeros(r, dtype=torch.int32, device=dev)

    def check(self, sp: SamplingParams) -> None:
        """ValueError when the request does not fit the tables (the engine refuses such
        requests at admission; this guards a caller that did not)."""
        for name, n, cap in (
            ("allowed_token_ids", len(sp.allowed_token_ids or ()), self.max_allowed),
            ("logit_bias", len(sp.logit_bias or {}), self.max_bias),
        ):
            if n > cap:
                raise ValueError(f"{name} has {n} tokens; the V2 sampler supports at most {cap}.")

    def add_request(self, row: int, sp: SamplingParams) -> None:
        """Stage every field of `row` for a new request."""
        allowed = sp.allowed_token_ids or []
        bias = sp.logit_bias or {}
        if not (allowed or bias or self.allocated):  # the common add: nothing to stage
            self.num_allowed_np[row] = self.num_bias_np[row] = 0
            self._stage(row, False, ())
            return
        self.check(sp)
        self.num_allowed_np[row] = len(allowed)
        self.num_bias_np[row] = len(bias)
        # a float32 bias travels as its 32-bit pattern, exact
        bits = np.asarray(list(bias.values()), np.float32).view(np.int32).astype(np.int64)
        v = self.vocab_size
        self._stage(row, bool(allowed or bias), (clamp_ids(allowed, v), clamp_ids(list(bias), v),
                                                 bits))

    def write_packed(self, segment: torch.Tensor, num_rows: int) -> None:
        if num_rows == 0:
            return
        assert self.allocated and segment.dtype == torch.int64
        kept(_write_kernel)((num_rows,),
            segment, segment[num_rows * self.header_width:], self.allowed_ids,
            self.num_allowed, self.bias_ids, self.bias_values, self.num_bias,
            MAX_ALLOWED=self.max_allowed, MAX_BIAS=self.max_bias, BLOCK=1024,
        )


@triton.jit
def _write_kernel(
    header_ptr,  # int64 [m, 5]: row, start, num allowed, num bias ids, num bias values
    contents_ptr,  # int64: per staged row its allowed ids, bias ids, bias bit patterns
    allowed_ptr, num_allowed_ptr, bias_ids_ptr, bias_values_ptr, num_bias_ptr,
    MAX_ALLOWED: tl.constexpr, MAX_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    h = header_ptr + tl.program_id(0) * 5
    row = tl.load(h + 0)
    allowed_at = tl.load(h + 1)
    n_allowed = tl.load(h + 2)
    n_bias = tl.load(h + 3)
    bias_at = allowed_at + n_allowed
    tl.store(num_allowed_ptr + row, n_allowed.to(tl.int32))
    tl.store(num_bias_ptr + row, n_bias.to(tl.int32))
    # the whole width, padding included: nothing of the row's previous request survives
    for off in range(0, MAX_ALLOWED, BLOCK):
        j = off + tl.arange(0, BLOCK)
        ids = tl.load(contents_ptr + allowed_at + j, mask=j < n_allowed, other=-1)
        tl.store(allowed_ptr + row * MAX_ALLOWED + j, ids.to(tl.int32), mask=j < MAX_ALLOWED)
    for off in range(0, MAX_BIAS, BLOCK):
        j = off + tl.arange(0, BLOCK)
        ids = tl.load(contents_ptr + bias_at + j, mask=j < n_bias, other=-1)
        bits = tl.load(contents_ptr + bias_at + n_bias + j, mask=j < n_bias, other=0)
        tl.store(bias_ids_ptr + row * MAX_BIAS + j, ids.to(tl.int32), mask=j < MAX_BIAS)
        tl.store(bias_values_ptr + row * MAX_BIAS + j,
                 bits.to(tl.int32).to(tl.float32, bitcast=True), mask=j < MAX_BIAS)


# ---- apply --------------------------------------------------------------------------


@triton.jit
def _mask_kernel(
    logits_ptr,  # [N, vocab_size] raw logits, any float dtype, row stride logits_stride
    logits_stride,
    out_ptr,  # [N, vocab_size] compute dtype, contiguous
    idx_mapping_ptr,  # int32 [N]
    num_allowed_ptr,  # int32 [R]
    vocab_size,
    BLOCK: tl.constexpr,
    HAS_ALLOWED: tl.constexpr,
    IS_FP64: tl.constexpr,
):
    """out = the logits in the compute dtype, all -inf on rows with an allowed list
    (_scatter_kernel then puts the allowed tokens' logits back)."""
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < vocab_size
    x = load_logits(logits_ptr + b * logits_stride, offs, valid, IS_FP64)
    if HAS_ALLOWED:
        row = tl.load(idx_mapping_ptr + b)
        x = tl.where(tl.load(num_allowed_ptr + row) > 0, float("-inf"), x)
    tl.store(out_ptr + b * vocab_size + offs, x, mask=valid)


@triton.jit
def _scatter_kernel(
    logits_ptr,  # [N, vocab_size] raw logits, row stride logits_stride
    logits_stride,
    out_ptr,  # [N, vocab_size] compute dtype, contiguous: _mask_kernel's output
    idx_mapping_ptr,  # int32 [N]
    allowed_ptr, num_allowed_ptr,  # int32 [R, MAX_ALLOWED], [R]
    bias_ids_ptr, bias_values_ptr, num_bias_ptr,  # int32 / float32 [R, MAX_BIAS], [R]
    vocab_size,
    MAX_ALLOWED: tl.constexpr, MAX_BIAS: tl.constexpr,
    BLOCK_ALLOWED: tl.constexpr, BLOCK_BIAS: tl.constexpr,
    HAS_ALLOWED: tl.constexpr, HAS_BIAS: tl.constexpr, IS_FP64: tl.constexpr,
):
    """One program per batch row: the allowed tokens get their logits back, then each
    biased token t gets x[t] + bias (ids are distinct within a row: no write races)."""
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    out_row = out_ptr + b * vocab_size
    if HAS_ALLOWED:
        n = tl.load(num_allowed_ptr + row)
        j = tl.arange(0, BLOCK_ALLOWED)
        ids = tl.load(allowed_ptr + row * MAX_ALLOWED + j, mask=j < n, other=0)
        ok = (j < n) & (ids < vocab_size)
        x = to_compute(tl.load(logits_ptr + b * logits_stride + ids, mask=ok), IS_FP64)
        tl.store(out_row + ids, x, mask=ok)
    if HAS_ALLOWED and HAS_BIAS:
        # a biased token may be an allowed one another thread has just restored: the
        # restore must be visible before the bias reads it
        tl.debug_barrier()
    if HAS_BIAS:
        n = tl.load(num_bias_ptr + row)
        j = tl.arange(0, BLOCK_BIAS)
        ids = tl.load(bias_ids_ptr + row * MAX_BIAS + j, mask=j < n, other=0)
        ok = (j < n) & (ids < vocab_size)
        bias = tl.load(bias_values_ptr + row * MAX_BIAS + j, mask=ok, other=0.0)
        x = tl.load(out_row + ids, mask=ok, other=0.0)
        tl.store(out_row + ids, x + bias.to(x.dtype), mask=ok)


def apply_allowed_and_bias(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    state: LogitBiasState,
    has_allowed: bool,
    has_bias: bool,
    block: int = MASK_BLOCK,
) -> torch.Tensor:
    """Processed logits [N, V] in float32 (float64 for fp64 logits), a new tensor:
    allowed_token_ids, then logit_bias. Two launches; logits are not modified."""
    n, vocab_size = logits.shape
    assert logits.stride(1) == 1 and vocab_size == state.vocab_size
    assert idx_mapping.dtype == torch.int32 and idx_mapping.shape == (n,)
    assert state.allocated, "a batch with allowed_token_ids / logit_bias has the tables"
    is_fp64 = logits.dtype == torch.float64
    out = torch.empty(n, vocab_size, dtype=torch.float64 if is_fp64 else torch.float32,
                      device=logits.device)
    if n == 0:
        return out
    kept(_mask_kernel)((n, triton.cdiv(vocab_size, block)),
        logits, logits.stride(0), out, idx_mapping, state.num_allowed, vocab_size,
        BLOCK=block, HAS_ALLOWED=has_allowed, IS_FP64=is_fp64,
    )
    if has_allowed or has_bias:
        kept(_scatter_kernel)((n,),
            logits, logits.stride(0), out, idx_mapping, state.allowed_ids, state.num_allowed,
            state.bias_ids, state.bias_values, state.num_bias, vocab_size,
            MAX_ALLOWED=state.max_allowed, MAX_BIAS=state.max_bias,
            BLOCK_ALLOWED=triton.next_power_of_2(state.max_allowed),
            BLOCK_BIAS=triton.next_power_of_2(state.max_bias),
            HAS_ALLOWED=has_allowed, HAS_BIAS=has_bias, IS_FP64=is_fp64,
            enable_fp_fusion=False,
        )
    return out
