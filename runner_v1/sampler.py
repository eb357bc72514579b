"""V1 sampler: the shared sampling semantics in vectorised PyTorch over batch rows.

The semantics (built-in logits processors, penalties, min_tokens, greedy, temperature,
min_p, top_k, top_p, Gumbel-max with the shared noise, raw logprobs) are spelled out in
tests/oracles/sampling_reference.py; the noise in shared/sampling/noise.py. V2's Triton
sampler computes exactly the same function, so every floating-point step below is
written as the same sequence of IEEE operations as the Triton kernels: a plain
division (never a multiply by the reciprocal), no fused multiply-add, thresholds
compared in float64.
"""

from __future__ import annotations

import functools
import math

import torch

from runner_v1.builtin_processors import (
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
)
from runner_v1.logits_processor import V1LogitsProcessors
from runner_v1.sampling_metadata import SamplingMetadata
from shared.contract.sampler_output import SamplerOutput
from shared.sampling.noise import gumbel_noise
from shared.sampling.top_ids import top_ids


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


class Sampler:
    def __init__(self, logits_processors: V1LogitsProcessors | None = None) -> None:
        # custom processors run last, on the processed logits, before temperature
        self.logits_processors = logits_processors

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, positions: torch.Tensor | None
    ) -> SamplerOutput:
        """positions: each logit's input position (it keys a random row's noise); may be
        None when every row is greedy."""
        processors = self.logits_processors
        assert logits.dim() == 2 and logits.shape[0] == metadata.num_reqs
        # greedy rows never read their positions (sample() returns before the noise)
        assert metadata.all_greedy or (positions is not None
                                       and positions.shape == (logits.shape[0],))
        if (metadata.repetition_penalty is None and not metadata.min_tokens_stop_ids
                and metadata.max_num_logprobs is None
                and not metadata.uses_builtin_processors and not processors):
            # Nothing reads a compute-dtype copy of the logits: sample() takes them as they
            # are (an all-greedy batch: their argmax; otherwise it divides them by the
            # temperature in the compute dtype, promotion widening exactly as the copy
            # would), which saves a [N, vocab] pass over the logits.
            return SamplerOutput(sample(logits, metadata, positions), None, None, None)
        raw = logits.to(compute_dtype(logits))  # may be logits itself: never written
        x = process_logits(raw, metadata)
        if processors:
            # processors may write in place: never into the raw logits (logprobs read them)
            x = processors.apply(x.clone() if x is raw or x is logits else x,
                                 metadata.all_greedy)
        tokens = sample(x, metadata, positions)
        if metadata.max_num_logprobs is None:
            return SamplerOutput(tokens, None, None, None)
        ids, lps, ranks = compute_logprobs(raw, tokens, metadata.max_num_logprobs)
        return SamplerOutput(tokens, ids, lps, ranks)


def process_logits(raw: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The oracle's processed_logits on the compute-dtype logits, in its order; each step
    returns a new tensor (or its input, when no row uses it), so raw stays unchanged."""
    x = apply_allowed_token_ids(raw, metadata)
    x = apply_logit_bias(x, metadata)
    x = apply_penalties(x, metadata)
    x = apply_min_tokens(x, metadata)
    return apply_bad_words(x, metadata)


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [N, V] occurrence counts; token_ids [N, L] padded with vocab_size, whose
    bin (column V) is cut off, so the padding counts for nothing."""
    n = token_ids.shape[0]
    bins = torch.zeros(n, vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    bins.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return bins[:, :vocab_size]


def _output_token_tensor(metadata: SamplingMetadata, vocab_size: int, device) -> torch.Tensor:
    outs = metadata.output_token_ids
    width = max((len(o) for o in outs), default=0)
    padded = torch.full((len(outs), max(width, 1)), vocab_size, dtype=torch.int64)
    for i, o in enumerate(outs):  # per request, not per token: the copy is vectorised
        if o:
            padded[i, : len(o)] = torch.tensor(o, dtype=torch.int64)
    return padded.to(device, non_blocking=True)


def apply_penalties(x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition on prompt ∪ outputs, then frequency, then presence. Rows without
    penalties get r = 1, f = p = 0, which leave their logits bit-for-bit unchanged."""
    if metadata.repetition_penalty is None:
        return x
    n, v = x.shape
    out_counts = _bin_counts(_output_token_tensor(metadata, v, x.device), v)
    in_output = out_counts > 0
    seen = in_output
    if metadata.prompt_token_ids is not None:
        seen = seen | (_bin_counts(metadata.prompt_token_ids.to(x.device), v) > 0)
    rep = metadata.repetition_penalty.to(x.dtype)[:, None]
    freq = metadata.frequency_penalty.to(x.dtype)[:, None]
    pres = metadata.presence_penalty.to(x.dtype)[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    # separate multiply and subtract (no addcmul): the Triton kernel runs without FMA
    x = x - freq * out_counts.to(x.dtype)
    return x - pres * in_output.to(x.dtype)


def apply_min_tokens(x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    stop = metadata.min_tokens_stop_ids
    if not stop:
        return x
    v = x.shape[1]
    rows = [r for r, ids in stop.items() for t in ids if t < v]
    cols = [t for ids in stop.values() for t in ids if t < v]
    if not rows:
        return x
    x = x.clone()
    idx = torch.tensor([rows, cols], dtype=torch.int64).to(x.device, non_blocking=True)
    x[idx[0], idx[1]] = float("-inf")
    return x


@functools.cache
def _chunk_size(vocab_size: int) -> int:
    """The smallest divisor of vocab_size not below its square root (vocab_size itself
    when prime: one chunk, a plain argmax)."""
    below = max(d for d in range(1, math.isqrt(vocab_size) + 1) if vocab_size % d == 0)
    return vocab_size // below


def greedy_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), the first maximum of each row, in two parallel stages. On CUDA,
    torch reduces one row into one output with a single 512-thread block, slow for
    llama's 128256 logits on the H200
    (docs/results/raw/5251427/h200_profile_llama3_8b_b1_v1_sampler.txt). Here each
    row is viewed as [B, C] chunks (C divides the vocabulary, so no copy): the max of
    every chunk (B outputs per row, in parallel), then the first chunk holding the row's
    max and the first index inside it: the same first maximum."""
    n, v = x.shape
    c = _chunk_size(v)
    values, index = x.view(n, v // c, c).max(dim=-1)  # first max per chunk
    chunk = values.argmax(dim=-1, keepdim=True)  # first chunk with the row max
    return torch.add(index.gather(1, chunk), chunk, alpha=c).squeeze(1)


def sample(x: torch.Tensor, metadata: SamplingMetadata,
           positions: torch.Tensor | None) -> torch.Tensor:
    """Greedy rows: argmax of x. Random rows: Gumbel-max over the filtered x / T (positions,
    which key their noise, may be None when every row is greedy)."""
    greedy = greedy_argmax(x) if not metadata.all_random else None
    if metadata.all_greedy:
        return greedy
    # x may still be in the model dtype (bf16 / fp16): the division promotes it to the
    # compute dtype of the temperature, exactly as widening x first would
    temp = metadata.temperature.to(compute_dtype(x))
    # greedy rows divide by 1; their result is replaced by the greedy token below
    scaled = x / torch.where(temp == 0, torch.ones_like(temp), temp)[:, None]
    # In place on the fresh float64 noise: the same sum (scaled widens exactly, the add is
    # commutative) without another [N, vocab] float64 tensor, which at a large batch is
    # a sizeable share of the step's memory traffic.
    scores = gumbel_noise(metadata.seeds, positions.to(torch.int64), x.shape[1]).add_(scaled)
    threshold = filter_threshold(scaled, metadata)
    if threshold is not None:
        scores.masked_fill_(scaled < threshold[:, None], float("-inf"))
    random = scores.argmax(dim=-1)  # first maximum: lowest id on ties
    if greedy is None:
        return random
    return torch.where(temp == 0, greedy, random)


def filter_threshold(scaled: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor | None:
    """Per row, the smallest scaled a token may have to survive min_p, top_k and top_p.

    Each filter keeps an upper set of scaled, so their composition is one threshold:
    max(min_p's, k-th largest scaled, top_p's). [N] in scaled's dtype, -inf = keep all."""
    if metadata.min_p is None and metadata.top_k is None and metadata.top_p is None:
        return None
    n, v = scaled.shape
    lmax = scaled.max(dim=-1).values
    thr = torch.full_like(lmax, float("-inf"))
    if metadata.min_p is not None:
        log_min_p = torch.log(metadata.min_p.to(scaled.device, torch.float64))
        ok = (scaled.to(torch.float64) - lmax.to(torch.float64)[:, None]) >= log_min_p[:, None]
        thr = torch.maximum(thr, scaled.masked_fill(~ok, float("inf")).min(dim=-1).values)
    if metadata.top_k is None and metadata.top_p is None:
        return thr
    s = scaled.sort(dim=-1, descending=True).values
    if metadata.top_k is not None:
        k = metadata.top_k.to(scaled.device, torch.int64)
        k = torch.where((k <= 0) | (k > v), v, k)
        thr = torch.maximum(thr, s.gather(1, (k - 1)[:, None])[:, 0])
    if metadata.top_p is not None:
        thr = torch.maximum(thr, _top_p_threshold(s, lmax, thr, metadata.top_p.to(scaled.device)))
    return thr


def _top_p_threshold(
    s: torch.Tensor, lmax: torch.Tensor, thr: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """s: scaled sorted descending. Keep i iff the mass of survivors with scaled > scaled_i is below
    top_p * Z; returns the smallest kept scaled per row (-inf where top_p == 1: off)."""
    e = torch.exp(s.to(torch.float64) - lmax.to(torch.float64)[:, None])
    e = e.masked_fill(s < thr[:, None], 0.0)  # non-survivors carry no mass
    limit = top_p.to(torch.float64) * e.sum(dim=-1)
    cum = e.cumsum(dim=-1)
    # number of entries strictly greater than s[k] = first index of s[k]'s tie group
    num_greater = torch.searchsorted(-s, -s, right=False)
    above = torch.where(
        num_greater > 0, cum.gather(1, (num_greater - 1).clamp(min=0)), torch.zeros_like(cum)
    )
    num_kept = (above < limit[:, None]).sum(dim=-1)  # a prefix of the sorted row
    kept_min = s.gather(1, (num_kept - 1).clamp(min=0)[:, None])[:, 0]
    return torch.where(top_p < 1.0, kept_min, torch.full_like(kept_min, float("-inf")))


def compute_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, max_num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw logprobs of the sampled token and the top max_num_logprobs, plus the rank.

    The logsumexp and the subtraction run in float64 and are rounded to raw's dtype
    once, as V2 does, so the two runners agree to the last bit almost always."""
    lse = torch.logsumexp(raw.to(torch.float64), dim=-1, keepdim=True)
    ids = tokens[:, None]
    if max_num_logprobs > 0:
        top = top_ids(raw, max_num_logprobs)
        ids = torch.cat([ids, top], dim=1)
    logprobs = (raw.gather(1, ids).to(torch.float64) - lse).to(raw.dtype)
    ranks = (raw > raw.gather(1, tokens[:, None])).sum(dim=-1) + 1
    return ids, logprobs, ranks
