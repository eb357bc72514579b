"""V1 rejection sampler: speculative-decoding verification in vectorised PyTorch.

The semantics are those of tests/oracles/rejection_reference.py (its docstring is the
spec); V2 computes the same function in Triton. Methods: "standard" (Leviathan / Chen
rejection sampling) and "synthetic" (accept by configured rates, vLLM's benchmark
mode). Block verification is V2-only and refused here by name.

Layout: request b has k_b + 1 contiguous logit rows; its drafts are the flat
draft_token_ids[draft_start_b : draft_start_b + k_b], draft t belonging to logit row
t + b. Per-request metadata is expanded to logit rows, so every "sample from p" row is
exactly the normal sampler's token (runner_v1/sampler.py sample()) and every keep set
its filter_threshold. Probabilities are float64, computed with the same operations as
V2 and the reference: p = e / sum(e), e = exp(float64(scaled) - float64(max scaled)) on
the keep set. Sums may be reduced in a different order than elsewhere, so p can differ
in the last ulp; a decision flips only when a uniform lands within that ulp.
Loops: none over requests, tokens or vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from runner_v1.sampler import compute_dtype, filter_threshold, sample
from runner_v1.sampling_metadata import SamplingMetadata
from shared.contract.sampler_output import RejectionOutput
from shared.runtime.host_buffers import copy_packed_to_device
from shared.sampling.noise import acceptance_uniform, exponential_noise

METHODS = ("standard", "synthetic")


@dataclass(frozen=True)
class _Layout:
    """Where each request's rows and drafts are (host-built index tensors)."""

    max_k: int
    first_row: torch.Tensor  # int64 [N]: the request's first logit row
    draft_start: torch.Tensor  # int64 [N]: the request's first draft in the flat drafts
    req_of_row: torch.Tensor  # int64 [M]
    req_of_draft: torch.Tensor  # int64 [T]
    offset_of_draft: torch.Tensor  # int64 [T]: i of draft d_i
    draft_rows: torch.Tensor  # int64 [T]: the logit row that verifies the draft


def _layout(num_draft_tokens: np.ndarray, device: torch.device) -> _Layout:
    k = np.asarray(num_draft_tokens, dtype=np.int64)
    n, t = len(k), int(k.sum())
    draft_start = np.cumsum(k) - k
    req_of_draft = np.repeat(np.arange(n, dtype=np.int64), k)
    flat = np.arange(t, dtype=np.int64)
    # one pinned copy for the six (separate pageable copies cost a launch each)
    first_row, start, req_of_row, req_of_d, offset, draft_rows = copy_packed_to_device([
        draft_start + np.arange(n), draft_start, np.repeat(np.arange(n, dtype=np.int64), k + 1),
        req_of_draft, flat - draft_start[req_of_draft], flat + req_of_draft], device)
    return _Layout(
        max_k=int(k.max()) if n else 0, first_row=first_row, draft_start=start,
        req_of_row=req_of_row, req_of_draft=req_of_d, offset_of_draft=offset,
        draft_rows=draft_rows,
    )


def check_supported(metadata: SamplingMetadata, method: str) -> None:
    """The runner's own guard: what the policy refuses earlier must never pass silently."""
    if method == "block":
        raise ValueError(
            "rejection_sample_method='block' (block verification) is V2-only; the V1 "
            "rejection sampler implements 'standard' and 'synthetic'.")
    if method not in METHODS:
        raise ValueError(f"unknown rejection sample method {method!r}; V1 supports {METHODS}")
    unsupported = [name for name, used in (
        ("penalties", metadata.repetition_penalty is not None),
        ("min_tokens", bool(metadata.min_tokens_stop_ids)),
        ("logprobs", metadata.max_num_logprobs is not None),
        ("allowed_token_ids / logit_bias / bad words", metadata.uses_builtin_processors),
    ) if used]
    if unsupported:
        raise ValueError(f"speculative decoding does not support {', '.join(unsupported)}")


def expand_metadata(metadata: SamplingMetadata, req_of_row: torch.Tensor) -> SamplingMetadata:
    """The metadata with one row per logit row (rows of a request repeat its values)."""
    m = req_of_row.shape[0]

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, req_of_row.to(t.device))

    return replace(
        metadata, num_reqs=m, temperature=take(metadata.temperature), top_k=take(metadata.top_k),
        top_p=take(metadata.top_p), min_p=take(metadata.min_p), seeds=take(metadata.seeds),
        output_token_ids=[[]] * m, num_logprobs=[-1] * m)  # both unread without penalties


@dataclass(frozen=True)
class _Target:
    """What p needs, per logit row: p(v) = e(v) / z with e(v) = exp(float64(scaled_v) -
    lmax) on the keep set (scaled >= threshold), 0 elsewhere. Kept in this form so that p
    is formed only where it is read (draft entries, rejecting rows): a float64 [M, V]
    tensor of p would be the largest allocation of the step."""

    scaled: torch.Tensor  # [M, V] compute dtype
    threshold: torch.Tensor | None  # [M] scaled's dtype; None: keep all
    lmax: torch.Tensor  # float64 [M]: float64(max scaled)
    z: torch.Tensor  # float64 [M]: sum of e over the keep set

    def probs(self, rows: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
        """p at (rows, cols) [T], or whole rows [R, V] when cols is None."""
        at = (rows, slice(None)) if cols is None else (rows, cols)
        per_row = (rows, None) if cols is None else rows  # broadcast over the row's columns
        scaled = self.scaled[at]
        e = torch.exp(scaled.to(torch.float64) - self.lmax[per_row])
        if self.threshold is not None:
            e = e.masked_fill(scaled < self.threshold[per_row], 0.0)
        return e / self.z[per_row]


def target_stats(logits: torch.Tensor, metadata: SamplingMetadata) -> _Target:
    """The p of every row: softmax of scaled over the keep set. Greedy rows get one too,
    never read (their decisions use the argmax)."""
    temp = metadata.temperature.to(compute_dtype(logits))
    scaled = logits / torch.where(temp == 0, torch.ones_like(temp), temp)[:, None]
    threshold = filter_threshold(scaled, metadata)
    e = scaled.to(torch.float64, copy=True)  # a copy also for fp64: modified in place
    lmax = e.max(dim=-1).values
    e.sub_(lmax[:, None]).exp_()  # in place: one [M, V] float64 buffer
    if threshold is not None:
        e.masked_fill_(scaled < threshold[:, None], 0.0)
    return _Target(scaled, threshold, lmax, e.sum(dim=-1))


def standard_accepts(u: torch.Tensor, p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """Accept a draft iff u < p(d) / q(d) (q(d) == 0: accept); a module function so that a
    test can swap in a wrong rule and watch the statistics fail."""
    return (q_d == 0) | (u < p_d / q_d)


def residual_sample(
    r: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponential race over r >= 0 (float64 [N, V]): argmax over r > 0 of r / E with
    E = -nlog(u(seed, pos, v)), lowest id on ties. Returns (token, found), found = any r > 0."""
    positive = r > 0
    race = exponential_noise(seeds, positions, r.shape[1])
    score = torch.where(positive, r / race, float("-inf"))
    return score.argmax(dim=-1), positive.any(dim=-1)


def rejection_sample(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    positions: torch.Tensor,
    num_draft_tokens: np.ndarray,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    method: str,
    synthetic_rates: Sequence[float] | torch.Tensor | None = None,
) -> RejectionOutput:
    """Verify each request's drafts against its target logits.

    logits [M, V], M = sum(k_b + 1); metadata: rows = the N requests; positions int64 [M]
    (input position of each logit row); num_draft_tokens int32 [N] on the host;
    draft_token_ids int64 [sum k_b]; draft_probs float64 [sum k_b, V] or None (one-hot
    drafts, e.g. ngram); method "standard" or "synthetic"; synthetic_rates: one
    conditional acceptance rate per draft position (synthetic only; a float64 device tensor
    avoids a host-to-device copy per step, which would wait for the verify forward)."""
    check_supported(metadata, method)
    n = metadata.num_reqs
    k = np.asarray(num_draft_tokens)
    assert k.shape == (n,) and (k >= 0).all()
    m, vocab = logits.shape
    t = int(k.sum())
    assert m == t + n and positions.shape == (m,) and draft_token_ids.shape == (t,)
    assert draft_probs is None or draft_probs.shape == (t, vocab)
    device = logits.device
    lay = _layout(k, device)
    md = expand_metadata(metadata, lay.req_of_row)
    positions = positions.to(torch.int64)
    target = sample(logits, md, positions)  # the normal sampler's token at every row
    d = draft_token_ids.to(torch.int64)

    dist = None
    if method == "synthetic":
        if synthetic_rates is None or len(synthetic_rates) < lay.max_k:
            raise ValueError(f"synthetic rejection sampling needs a rate per draft position "
                             f"(at least {lay.max_k}), got {synthetic_rates}")
        rates = synthetic_rates
        if not isinstance(rates, torch.Tensor):  # a pageable copy: it waits for the stream
            rates = torch.tensor(list(rates) or [0.0], dtype=torch.float64, device=device)
        u = acceptance_uniform(md.seeds[lay.draft_rows], positions[lay.draft_rows])
        accepted = u < rates[lay.offset_of_draft]
    else:
        accepted = target[lay.draft_rows] == d  # greedy rows: the argmax
        if not metadata.all_greedy:
            dist = target_stats(logits, md)
            p_d = dist.probs(lay.draft_rows, d)
            q_d = (torch.ones_like(p_d) if draft_probs is None
                   else draft_probs[torch.arange(t, device=device), d])
            u = acceptance_uniform(md.seeds[lay.draft_rows], positions[lay.draft_rows])
            random = md.temperature[lay.draft_rows] != 0
            accepted = torch.where(random, standard_accepts(u, p_d, q_d), accepted)

    acc = torch.zeros(n, lay.max_k, dtype=torch.bool, device=device)
    acc[lay.req_of_draft, lay.offset_of_draft] = accepted
    # leading accepted: the padding past k_b is False, so the run stops there at the latest
    num_acc = acc.to(torch.int64).cumprod(dim=1).sum(dim=1)
    out_row = lay.first_row + num_acc
    y = target[out_row]  # the bonus token, the greedy recovery, the synthetic recovery
    if dist is not None and t > 0:
        y = _recover(dist, y, out_row, num_acc, lay, metadata, positions, d, draft_probs, k)
    return _assemble(d, y, num_acc, lay)


def _recover(dist: _Target, y, out_row, num_acc, lay: _Layout, metadata: SamplingMetadata,
             positions, d, draft_probs, k: np.ndarray) -> torch.Tensor:
    """Random rows that rejected a draft: the residual max(p - q, 0) at the rejecting row
    (one-hot q: p without the draft); an all-zero residual keeps the sample from p."""
    num_drafts = torch.from_numpy(k.astype(np.int64)).to(y.device, non_blocking=True)
    need = (metadata.temperature.to(y.device) != 0) & (num_acc < num_drafts)
    draft = (lay.draft_start + num_acc).clamp(max=d.shape[0] - 1)  # the rejected draft
    p = dist.probs(out_row)
    if draft_probs is None:
        q = torch.zeros_like(p).scatter_(1, d[draft][:, None], 1.0)
    else:
        q = draft_probs[draft].to(torch.float64)
    r = (p - q).clamp(min=0.0)
    token, found = residual_sample(r, metadata.seeds, positions[out_row])
    return torch.where(need & found, token, y)


def _assemble(d: torch.Tensor, y: torch.Tensor, num_acc: torch.Tensor,
              lay: _Layout) -> RejectionOutput:
    n = num_acc.shape[0]
    drafts = torch.full((n, lay.max_k + 1), -1, dtype=torch.int64, device=d.device)
    drafts[lay.req_of_draft, lay.offset_of_draft] = d
    col = torch.arange(lay.max_k + 1, device=d.device)
    out = torch.where(col[None, :] < num_acc[:, None], drafts, -1)
    out.scatter_(1, num_acc[:, None], y[:, None])
    return RejectionOutput(out, (num_acc + 1).to(torch.int32))
