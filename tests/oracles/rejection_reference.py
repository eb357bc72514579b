"""Plain NumPy reference of speculative-decoding verification, one request at a time.

The test oracle of runner_v1/spec_decode/ and runner_v2/spec_decode/. Written for
reading: loops are fine. Noise, filters and normal sampling come from
tests/oracles/sampling_reference.py (itself independent of the runners' noise code).

A request with k >= 0 draft tokens d_0..d_{k-1} has k + 1 logit rows; row i is the
target distribution of the token after input position positions[i], and d_i was
proposed for the slot row i predicts.
- p_i (target_probs): greedy rows one-hot at argmax(x_i) (lowest id on ties); random rows
  softmax over the normal sampler's keep set of scaled = x_i / T:
  e = exp(float64(scaled) - float64(max scaled)) zeroed outside keep, p = e / sum(e).
- q_i: the draft model's probabilities, or one-hot at d_i (drafts without a
  distribution, e.g. ngram).
- u_i (acceptance): u(seed ^ ACCEPT_SALT, positions[i], vocab_id = 0).
- "sample from p at row j": exactly the normal sampler's token for that row.
- residual sampling at row j of r >= 0: argmax over {v : r_v > 0} of r_v / E_v with
  E_v = -nlog(u(seed, positions[j], v)) (the exponential race: P(v) = r_v / sum r);
  all-zero r falls back to sampling from p at row j.
Every float operation is the runners' too, except that sums (Z, S_i) are reduced in
another order: p may differ in its last bits, which changes a token only when a uniform
falls within that much of a threshold (never in the tests' seeds).

Methods:
- standard (Leviathan et al. 2023, Chen et al. 2023): accept d_i iff u_i < p_i(d_i) /
  q_i(d_i) (q_i(d_i) == 0: accept; greedy rows: d_i == argmax x_i); n = leading accepted;
  then the bonus sample from p at row k (n == k), the argmax (greedy) or the residual
  max(p_n - q_n, 0) at row n.
- synthetic (vLLM's benchmark mode): accept d_i iff u_i < rates[i], regardless of the
  draft; then sample from p at row n.
- block (block verification, Sun et al. 2024, Algorithm 2): greedy rows as standard.
  w_0 = 1, w_i = min((w_{i-1} p_{i-1}(d_{i-1})) / q_{i-1}(d_{i-1}), 1) (1 where q(d) == 0;
  the product first, so that w_{i-1} = 0 never meets an infinite ratio);
  for i < k: S_i = sum_v max(w_i p_i(v) - q_i(v), 0), h_i = S_i / (S_i + (1 - w_i)) (1 when
  that is 0/0); h_k = w_k. tau = the largest i in 1..k with eta_i <= h_i (0 if none);
  output d_0..d_{tau-1}, then sample from p at row k (tau == k) or the residual
  max(w_tau p_tau - q_tau, 0) at row tau.
  eta_i = u(seed ^ ACCEPT_SALT, positions[0], vocab_id = i - 1): keyed by the request's
  FIRST row, not by row i's own position as u_i is. tau reads every eta_i, also those
  of rows after the stopping point, and the next step's rows start at position
  positions[tau + 1]: keyed by their own positions, the next step would reuse eta values
  that this step's outcome conditioned (eta_j > h_j for j > tau), which biases it.
  Measured with the chain of tests/oracles/spec_chain.py,
  100000 runs (too slow for the suite): chi-square p = 9e-46 keyed by row, 0.62 keyed by
  the first row. The first row's position grows every step, so (first position,
  offset) never repeats. standard and synthetic read only u_0..u_n, and the next step
  starts at row n + 1: their per-row keying never reuses a value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.contract.sampling_params import SamplingParams
from shared.sampling.noise import ACCEPT_SALT
from tests.oracles.sampling_reference import (
    keep_mask,
    reference_nlog,
    reference_sample_row,
    reference_uniform,
)

METHODS = ("standard", "synthetic", "block")


@dataclass
class SpecRequest:
    """One request's verification inputs."""

    logits: np.ndarray  # [k + 1, V], float32 or float64
    params: SamplingParams  # temperature, top_k, top_p, min_p (no penalties)
    seed: int
    positions: Sequence[int]  # [k + 1]: input position of each logit row
    draft_token_ids: Sequence[int]  # [k]
    draft_probs: np.ndarray | None = None  # float64 [k, V]; None: one-hot at the drafts

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0


def _compute(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64 if x.dtype == np.float64 else np.float32)


def target_probs(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """p of one row, float64 [V]."""
    x = _compute(x)
    if params.temperature == 0.0:
        p = np.zeros(len(x))
        p[int(np.argmax(x))] = 1.0
        return p
    scaled = x / x.dtype.type(np.float32(params.temperature))
    l64 = scaled.astype(np.float64)
    e = np.where(keep_mask(scaled, params), np.exp(l64 - l64.max()), 0.0)
    return e / e.sum()


def draft_dist(req: SpecRequest, i: int, vocab_size: int) -> np.ndarray:
    """q_i, float64 [V]."""
    if req.draft_probs is not None:
        return np.asarray(req.draft_probs[i], dtype=np.float64)
    q = np.zeros(vocab_size)
    q[req.draft_token_ids[i]] = 1.0
    return q


def acceptance_uniform(seed: int, pos: int, offset: int = 0) -> float:
    return float(reference_uniform(seed ^ ACCEPT_SALT, pos, np.array([offset]))[0])


def sample_from_p(req: SpecRequest, j: int) -> int:
    """The normal sampler's token for row j (no penalties, no min_tokens)."""
    return reference_sample_row(req.logits[j], req.params, req.seed, req.positions[j],
                                [], []).token_id


def residual_sample(req: SpecRequest, j: int, r: np.ndarray) -> int:
    """Sample from r / sum(r) at row j by the exponential race; p at row j if r == 0."""
    if not (r > 0).any():
        return sample_from_p(req, j)
    e = -reference_nlog(reference_uniform(req.seed, req.positions[j], np.arange(len(r))))
    score = np.full(len(r), -np.inf)
    score[r > 0] = r[r > 0] / e[r > 0]
    return int(np.argmax(score))  # first maximum: lowest id on ties


def _leading_accepted(req: SpecRequest, accept) -> int:
    n = 0
    while n < req.num_drafts and accept(n):
        n += 1
    return n


def standard_accepts(req: SpecRequest, i: int) -> bool:
    x, d = req.logits[i], req.draft_token_ids[i]
    if req.greedy:
        return d == int(np.argmax(_compute(x)))
    q_d = draft_dist(req, i, x.shape[-1])[d]
    p_d = target_probs(x, req.params)[d]
    return bool(q_d == 0 or acceptance_uniform(req.seed, req.positions[i]) < p_d / q_d)


def _standard(req: SpecRequest) -> list[int]:
    n = _leading_accepted(req, lambda i: standard_accepts(req, i))
    drafts = list(req.draft_token_ids[:n])
    if n == req.num_drafts or req.greedy:
        return drafts + [sample_from_p(req, n)]
    p = target_probs(req.logits[n], req.params)
    r = np.maximum(p - draft_dist(req, n, len(p)), 0.0)
    return drafts + [residual_sample(req, n, r)]


def _synthetic(req: SpecRequest, rates: Sequence[float]) -> list[int]:
    assert len(rates) >= req.num_drafts
    n = _leading_accepted(
        req, lambda i: acceptance_uniform(req.seed, req.positions[i]) < float(rates[i]))
    return list(req.draft_token_ids[:n]) + [sample_from_p(req, n)]


def block_weights(req: SpecRequest) -> list[float]:
    """w_0..w_k."""
    w = [1.0]
    for i, d in enumerate(req.draft_token_ids):
        x = req.logits[i]
        q_d = draft_dist(req, i, x.shape[-1])[d]
        p_d = target_probs(x, req.params)[d]
        w.append(1.0 if q_d == 0 else min(w[-1] * p_d / q_d, 1.0))
    return w


def block_h(s: float, w: float) -> float:
    """h_i for i < k from S_i and w_i."""
    den = s + (1.0 - w)
    return 1.0 if den == 0 else s / den


def block_eta(req: SpecRequest, i: int) -> float:
    """eta_i, i = 1..k (module docstring: keyed by the first row)."""
    return acceptance_uniform(req.seed, req.positions[0], i - 1)


def _block(req: SpecRequest) -> list[int]:
    if req.greedy:
        return _standard(req)
    k = req.num_drafts
    w = block_weights(req)
    tau = 0
    for i in range(1, k + 1):
        if i == k:
            h = w[k]
        else:
            p = target_probs(req.logits[i], req.params)
            s = float(np.maximum(w[i] * p - draft_dist(req, i, len(p)), 0.0).sum())
            h = block_h(s, w[i])
        if block_eta(req, i) <= h:
            tau = i
    drafts = list(req.draft_token_ids[:tau])
    if tau == k:
        return drafts + [sample_from_p(req, k)]
    p = target_probs(req.logits[tau], req.params)
    r = np.maximum(w[tau] * p - draft_dist(req, tau, len(p)), 0.0)
    return drafts + [residual_sample(req, tau, r)]


def reference_rejection_sample(
    req: SpecRequest, method: str, rates: Sequence[float] | None = None
) -> list[int]:
    """The request's output tokens: the accepted drafts, then one sampled token."""
    assert len(req.positions) == len(req.logits) == req.num_drafts + 1
    if method == "standard":
        return _standard(req)
    if method == "synthetic":
        assert rates is not None
        return _synthetic(req, rates)
    if method == "block":
        return _block(req)
    raise ValueError(f"unknown method {method!r}")
