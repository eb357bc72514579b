"""V2 rejection sampler: speculative-decoding verification in Triton.

Computes the function of tests/oracles/rejection_reference.py (its docstring is the
spec), as V1's PyTorch sampler does for "standard" and "synthetic"; "block" (block
verification, Sun et al. 2024) is V2's alone. Per-request parameters are read through
expanded_idx_mapping (logit row -> state row), so a request's rows share its state row
without copies. The "sample from p" token of every row comes from the normal sampler's
kernels (compute_thresholds, gumbel_sample) on the expanded mapping, so a request
without drafts gets exactly the token normal sampling gives. Kernels:
rejection_kernels.py. The stage decision reads host mirrors only: no host sync, and
every grid depends on (N, max_k, vocab size) alone.
"""

from __future__ import annotations

import numpy as np
import torch

from runner_v2.sample.gumbel import gumbel_sample
from runner_v2.sample.states import SamplingStates
from runner_v2.sample.top_k_top_p import compute_thresholds
from runner_v2.spec_decode import rejection_kernels as K
from shared.contract.sampler_output import RejectionOutput
from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import triton
from shared.sampling.noise_kernels import NOISE_BLOCK

METHODS = {"standard": K.STANDARD.value, "synthetic": K.SYNTHETIC.value,
           "block": K.BLOCK_VERIFY.value}


def _check_inputs(logits, expanded_idx_mapping, cu_num_logits, positions, draft_token_ids,
                  draft_probs, method, synthetic_rates, max_k) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown rejection sample method {method!r}; V2 supports "
                         f"{tuple(METHODS)}")
    m, vocab = logits.shape
    assert logits.stride(1) == 1
    assert expanded_idx_mapping.dtype == torch.int32 and expanded_idx_mapping.shape == (m,)
    assert cu_num_logits.dtype == torch.int32 and cu_num_logits.dim() == 1
    assert positions.dtype == torch.int64 and positions.shape == (m,)
    assert draft_token_ids.dtype == torch.int64 and draft_token_ids.shape == (m,)
    assert max_k >= 0
    if draft_probs is not None:
        assert draft_probs.dtype == torch.float64 and draft_probs.shape == (m, vocab)
        assert draft_probs.is_contiguous()
    if method == "synthetic" and (synthetic_rates is None or synthetic_rates.dtype != torch.float64
                                  or synthetic_rates.shape[0] < max_k):
        raise ValueError("synthetic rejection sampling needs synthetic_rates, float64 [k] with "
                         f"k >= max_k = {max_k}")


def _check_supported(states: SamplingStates, idx_mapping_np: np.ndarray | None) -> None:
    if idx_mapping_np is None:
        return  # without the batch's rows the flags would also count stale rows
    flags = states.batch_flags(idx_mapping_np)
    unsupported = [name for name, used in (
        ("penalties", flags.any_penalties), ("min_tokens", flags.any_min_tokens),
        ("logprobs", flags.max_num_logprobs is not None),
        ("allowed_token_ids / logit_bias / bad words", flags.any_builtins),
    ) if used]
    if unsupported:
        raise ValueError(f"speculative decoding does not support {', '.join(unsupported)}")


def rejection_sample(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    cu_num_logits: torch.Tensor,
    positions: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    states: SamplingStates,
    method: str,
    synthetic_rates: torch.Tensor | None,
    max_k: int,
    idx_mapping_np: np.ndarray | None = None,
) -> RejectionOutput:
    """Verify each request's drafts against its target logits.

    logits [M, V]; expanded_idx_mapping int32 [M] (logit row -> state row);
    cu_num_logits int32 [N + 1] on the device (request b owns rows cu[b] .. cu[b+1] - 1,
    k_b + 1 of them, k_b <= max_k); positions int64 [M] (input position of each row);
    draft_token_ids int64 [M] (entry j: the draft row j verifies; ignored on each
    request's last row); draft_probs float64 [M, V] aligned the same way, or None
    (one-hot drafts, e.g. ngram); method "standard", "synthetic" or "block";
    synthetic_rates float64 [>= max_k] (synthetic only); idx_mapping_np: the batch's
    state rows on the host, when the caller has them: then penalties, min_tokens,
    logprobs and the built-in logits processors are refused (ValueError), and the
    filter stage is decided on them alone."""
    _check_inputs(logits, expanded_idx_mapping, cu_num_logits, positions, draft_token_ids,
                  draft_probs, method, synthetic_rates, max_k)
    _check_supported(states, idx_mapping_np)
    m, vocab = logits.shape
    n = cu_num_logits.shape[0] - 1
    dev = logits.device
    is_fp64 = logits.dtype == torch.float64
    st = states
    threshold = None
    if st.batch_flags(idx_mapping_np).any_filter:
        threshold = compute_thresholds(logits, expanded_idx_mapping, st.temperature, st.top_k,
                                       st.top_p, st.min_p)
    target = gumbel_sample(logits, expanded_idx_mapping, positions, st.temperature, st.seeds,
                           threshold)
    width = max_k + 1
    out = torch.empty(n, width, dtype=torch.int64, device=dev)
    num_sampled = torch.empty(n, dtype=torch.int32, device=dev)
    if n == 0:
        return RejectionOutput(out, num_sampled)
    # zeros: greedy rows leave them unwritten, and the lanes that read them are discarded
    f64 = [torch.zeros(m, dtype=torch.float64, device=dev) for _ in range(6)]
    lmax, z, p_d, q_d, w, s = f64
    out_row = torch.empty(n, dtype=torch.int32, device=dev)
    need = torch.empty(n, dtype=torch.int32, device=dev)
    w_res = torch.empty(n, dtype=torch.float64, device=dev)
    has_q = draft_probs is not None
    q = draft_probs if has_q else lmax  # a placeholder pointer, never read
    thr = threshold if threshold is not None else lmax
    common = dict(BLOCK=NOISE_BLOCK, HAS_Q=has_q, HAS_THRESHOLD=threshold is not None,
                  IS_FP64=is_fp64, enable_fp_fusion=False)
    if method != "synthetic":
        kept(K._row_stats_kernel)((n, width),
            logits, logits.stride(0), expanded_idx_mapping, cu_num_logits, draft_token_ids, q,
            st.temperature, thr, lmax, z, p_d, q_d, vocab, **common)
    if method == "block":
        kept(K._block_weights_kernel)((n,), expanded_idx_mapping, cu_num_logits, st.temperature,
                                      p_d, q_d, w, max_k, enable_fp_fusion=False)
        kept(K._block_mass_kernel)((n, width),
            logits, logits.stride(0), expanded_idx_mapping, cu_num_logits, draft_token_ids, q,
            st.temperature, thr, lmax, z, w, s, vocab, **common)
    rates = synthetic_rates if method == "synthetic" else lmax
    kept(K._decide_kernel)((n,),
        expanded_idx_mapping, cu_num_logits, positions, draft_token_ids, target,
        st.temperature, st.seeds, rates, p_d, q_d, w, s,
        out, num_sampled, out_row, need, w_res, width,
        METHOD=METHODS[method], BLOCK_K=max(2, triton.next_power_of_2(width)),
        enable_fp_fusion=False)
    num_blocks = triton.cdiv(vocab, NOISE_BLOCK)
    block_max = torch.empty(n, num_blocks, dtype=torch.float64, device=dev)
    block_arg = torch.empty(n, num_blocks, dtype=torch.int64, device=dev)
    if method != "synthetic":
        kept(K._residual_kernel)((n, num_blocks),
            logits, logits.stride(0), expanded_idx_mapping, positions, draft_token_ids, q,
            st.temperature, st.seeds, thr, lmax, z, out_row, need, w_res,
            block_max, block_arg, vocab, num_blocks, **common)
    kept(K._finish_kernel)((n,),
        block_max, block_arg, out_row, num_sampled, target, out, width, num_blocks,
        HAS_RESIDUAL=method != "synthetic", BLOCK=max(2, triton.next_power_of_2(num_blocks)))
    return RejectionOutput(out, num_sampled)
