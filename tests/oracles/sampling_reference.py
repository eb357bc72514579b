"""Plain NumPy reference of the whole sampling pipeline, one row at a time.

This is the test oracle for both samplers (runner_v1/sampler.py, runner_v2/sample/).
It is written for reading, not speed: loops and O(V**2) sums are fine here.

Per row, on the logits converted to float32 (float64 when the model runs in float64):
1. raw logprobs = log_softmax(unprocessed logits); returned logprobs use these.
2. built-ins and penalties, in this order: allowed_token_ids (every other token -inf),
   logit_bias (x += float32(bias)), then repetition r on tokens in prompt ∪ outputs (x > 0 ? x / r : x * r), then
   frequency x -= f * count_in_outputs, then presence x -= p * (count > 0). The prompt
   is the user prompt; outputs are every generated token (also those generated before
   a preemption).
3. min_tokens: while pos + 1 - prompt_len < min_tokens, the stop ids and EOS (unless
   ignore_eos) get -inf; then bad words: for each word w of bad_words_token_ids, w[-1]
   gets -inf when the outputs end with w[:-1] (always for a one-token word).
4. greedy rows (temperature == 0): argmax of the processed logits, lowest id on ties.
5. random rows: scaled = x / temperature (in the compute dtype);
   min_p keeps i iff float64(scaled_i) - float64(max scaled) >= log(float64(min_p)) (the same as
   softmax(scaled)_i >= min_p * max softmax(scaled), without exponentials);
   top_k keeps survivors with scaled >= the k-th largest surviving scaled (ties all kept);
   top_p (only when top_p < 1): with e_j = exp(float64(scaled_j) - float64(max scaled)) over the
   survivors and Z = sum e_j, keep i iff sum of e_j over survivors with scaled_j > scaled_i is
   < float64(top_p) * Z ("more probable" is decided on scaled, ties all kept);
   token = argmax over survivors of float64(scaled_i) + noise(seed, pos, i), lowest id on ties.
6. logprobs: the sampled token's raw logprob, its rank (1 + number of tokens with a
   strictly larger raw logit) and the top-n raw logprobs; log_softmax is computed in
   float64 and rounded once to the compute dtype.

The noise here is an independent NumPy (uint64) implementation of the definition in
shared/sampling/noise.py, so the tests compare three implementations of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from shared.contract.sampling_params import SamplingParams

_M32 = np.uint64(0xFFFFFFFF)


def _fmix32(h: np.ndarray) -> np.ndarray:
    # uint64 holds a 32-bit word; the product of two words fits in 64 bits exactly.
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x85EBCA6B)) & _M32
    h = h ^ (h >> np.uint64(13))
    h = (h * np.uint64(0xC2B2AE35)) & _M32
    return h ^ (h >> np.uint64(16))


def reference_noise(seed: int, pos: int, vocab_ids: np.ndarray) -> np.ndarray:
    """Gumbel noise float64 for one row; see shared/sampling/noise.py for the spec."""
    return -reference_nlog(-reference_nlog(reference_uniform(seed, pos, vocab_ids)))


def reference_uniform(seed: int, pos: int, vocab_ids: np.ndarray) -> np.ndarray:
    """The noise's u in (0, 1), float64, for one row (the step before the logs)."""
    ids = np.asarray(vocab_ids, dtype=np.uint64)
    seed_lo = np.full(1, seed & 0xFFFFFFFF, dtype=np.uint64)
    seed_hi = np.full(1, seed >> 32, dtype=np.uint64)
    pos32 = np.full(1, pos & 0xFFFFFFFF, dtype=np.uint64)

    def word(key: int) -> np.ndarray:
        h = _fmix32(np.uint64(key) ^ seed_lo)
        h = _fmix32(h ^ seed_hi)
        h = _fmix32(h ^ pos32)
        return _fmix32(h ^ ids)

    m = (word(0x9E3779B9) << np.uint64(20)) | (word(0x7F4A7C15) >> np.uint64(12))
    return (2 * m + 1).astype(np.float64) * 2.0**-53


def reference_nlog(x: np.ndarray) -> np.ndarray:
    """The noise's log (spec in shared/sampling/noise.py) in NumPy float64 operations."""
    bits = np.asarray(x, dtype=np.float64).view(np.int64)
    f = bits & ((1 << 52) - 1)
    big = f >= 0x6A09E667F3BCD
    m = (f | np.where(big, 0x3FE0000000000000, 0x3FF0000000000000)).view(np.float64)
    e = ((bits >> 52) - 1023 + big).astype(np.float64)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    p = np.full_like(z, 1.0 / 21)
    for k in range(9, -1, -1):
        p = p * z
        p = p + 1.0 / (2 * k + 1)
    t = s * p
    return e * np.log(2.0) + (t + t)


@dataclass
class RowSample:
    token_id: int
    logprob: float | None = None  # raw logprob of token_id
    rank: int | None = None
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


def raw_logprobs(x: np.ndarray) -> np.ndarray:
    """log_softmax computed in float64, rounded once to x's dtype."""
    x64 = x.astype(np.float64)
    m = x64.max()
    return (x64 - (m + np.log(np.exp(x64 - m).sum()))).astype(x.dtype)


def processed_logits(
    x: np.ndarray,
    params: SamplingParams,
    pos: int,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    eos_token_id: int | None,
) -> np.ndarray:
    """Steps 2 and 3: built-ins, penalties, the min_tokens mask, bad words. x is not
    modified."""
    x = x.copy()
    dt = x.dtype.type
    if params.allowed_token_ids is not None:
        allowed = np.zeros(len(x), dtype=bool)
        allowed[[t for t in params.allowed_token_ids if t < len(x)]] = True
        x[~allowed] = -np.inf
    for t, b in (params.logit_bias or {}).items():
        if t < len(x):
            x[t] = x[t] + dt(np.float32(b))
    counts: dict[int, int] = {}
    for t in output_token_ids:
        counts[t] = counts.get(t, 0) + 1
    if params.repetition_penalty != 1.0:
        r = dt(np.float32(params.repetition_penalty))
        for t in set(prompt_token_ids) | set(counts):
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
    f = dt(np.float32(params.frequency_penalty))
    p = dt(np.float32(params.presence_penalty))
    for t, c in counts.items():
        x[t] = x[t] - f * dt(c)
        x[t] = x[t] - p
    if pos + 1 - len(prompt_token_ids) < params.min_tokens:
        banned = list(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            banned.append(eos_token_id)
        for t in banned:
            if t < len(x):
                x[t] = -np.inf
    outputs = list(output_token_ids)
    for word in params.bad_words_token_ids or []:
        prefix = list(word[:-1])
        if not prefix or outputs[len(outputs) - len(prefix):] == prefix:
            if word[-1] < len(x):
                x[word[-1]] = -np.inf
    return x


def keep_mask(scaled: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Step 5's filters on scaled = x / temperature: min_p, then top_k, then top_p."""
    l64 = scaled.astype(np.float64)
    lmax = l64.max()
    keep = np.ones(len(scaled), dtype=bool)
    if params.min_p > 0.0:
        keep &= (l64 - lmax) >= np.log(np.float64(np.float32(params.min_p)))
    if 0 < params.top_k < len(scaled):
        survivors = np.sort(scaled[keep])[::-1]
        if len(survivors) >= params.top_k:
            keep &= scaled >= survivors[params.top_k - 1]
    if params.top_p < 1.0:
        e = np.where(keep, np.exp(l64 - lmax), 0.0)
        limit = np.float64(np.float32(params.top_p)) * e.sum()
        above = np.array([e[keep & (scaled > scaled[i])].sum() for i in range(len(scaled))])
        keep &= above < limit
    return keep


def reference_sample_row(
    logits: np.ndarray,
    params: SamplingParams,
    seed: int,
    pos: int,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    eos_token_id: int | None = None,
) -> RowSample:
    """The whole pipeline for one row. logits: [V] in any float dtype."""
    dtype = np.float64 if logits.dtype == np.float64 else np.float32
    raw = np.asarray(logits, dtype=dtype)
    x = processed_logits(raw, params, pos, prompt_token_ids, output_token_ids, eos_token_id)
    if params.temperature == 0.0:
        token = int(np.argmax(x))  # first maximum
    else:
        scaled = x / dtype(np.float32(params.temperature))
        scores = scaled.astype(np.float64) + reference_noise(seed, pos, np.arange(len(scaled)))
        scores[~keep_mask(scaled, params)] = -np.inf
        token = int(np.argmax(scores))
    out = RowSample(token_id=token)
    if params.logprobs is not None:
        lp = raw_logprobs(raw)
        out.logprob = float(lp[token])
        out.rank = int((raw > raw[token]).sum()) + 1
        top = np.argsort(-raw, kind="stable")[: params.logprobs]
        out.top_token_ids = [int(t) for t in top]
        out.top_logprobs = [float(lp[t]) for t in top]
    return out
