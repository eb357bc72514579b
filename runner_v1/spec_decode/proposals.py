"""V1's draft proposals waiting for their verify, keyed by request: the drafted tokens and,
for a randomly sampled row, their draft distributions q, all device views (nothing here
reaches the host). The draft proposer keeps a row's proposal when it launches it, trims
it once the step's tokens are on the host (synchronous loop), and drops it when the row
verifies again or the request leaves; the rejection sampler and the input prep read the
step's slices in batch-row order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from runner_v1.spec_decode.metadata import ragged_arange, to_device


@dataclass(frozen=True)
class Proposal:
    """One request's drafts (device views)."""

    tokens: torch.Tensor  # int64 [num_drafts]
    probs: torch.Tensor | None  # float64 [num_drafts, V]; None for a greedy row


class DraftProposals:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._by_request: dict[str, Proposal] = {}

    # ---- the proposer's side ----------------------------------------------------------
    def keep(self, req_id: str, tokens: torch.Tensor, probs: torch.Tensor | None) -> None:
        self._by_request[req_id] = Proposal(tokens, probs)

    def trim(self, req_id: str, cap: int) -> None:
        """Keep the first `cap` drafts only (none: the proposal goes)."""
        p = self._by_request.pop(req_id, None)
        if p is not None and cap > 0:
            self._by_request[req_id] = Proposal(
                p.tokens[:cap], None if p.probs is None else p.probs[:cap])

    def remove(self, req_id: str) -> None:
        self._by_request.pop(req_id, None)

    def clear(self) -> None:
        self._by_request.clear()

    # ---- the step's side --------------------------------------------------------------
    def tokens_for_step(
        self, req_ids: Sequence[str], num_draft_tokens: np.ndarray
    ) -> torch.Tensor:
        """The step's drafts on the device, int64 [sum drafts], rows in batch-row order,
        each request's first num_draft_tokens[row] (what the verify checks: under async
        scheduling the host only has placeholders for them)."""
        props, counts = self._scheduled(req_ids, num_draft_tokens)
        return torch.cat([p.tokens[:c] for p, c in zip(props, counts.tolist())])

    def probs_for_step(
        self, req_ids: Sequence[str], num_draft_tokens: np.ndarray
    ) -> torch.Tensor | None:
        """q of this step's drafts, float64 [sum drafts, V], rows in batch-row order, each
        request's first num_draft_tokens[row] (the scheduler may trim the tail of a
        proposal, never its head). A greedy row gets one-hot rows at its draft tokens so
        the tensor is defined everywhere. None when no drafted row samples randomly."""
        props, counts = self._scheduled(req_ids, num_draft_tokens)
        is_random = np.array([p.probs is not None for p in props], dtype=bool)
        if not is_random.any():
            return None
        starts = np.cumsum(counts) - counts

        def flat_rows(sel: np.ndarray) -> torch.Tensor:  # the out rows of these requests
            flat = np.repeat(starts[sel], counts[sel]) + ragged_arange(counts[sel])
            return to_device(flat, self.device)  # pinned, non_blocking: no wait for the verify

        out = torch.zeros((int(counts.sum()), self.vocab_size), dtype=torch.float64,
                          device=self.device)
        random_rows = np.flatnonzero(is_random).tolist()
        out[flat_rows(is_random)] = torch.cat([props[i].probs[: counts[i]] for i in random_rows])
        greedy_rows = np.flatnonzero(~is_random).tolist()
        if greedy_rows:
            tokens = torch.cat([props[i].tokens[: counts[i]] for i in greedy_rows])
            out[flat_rows(~is_random), tokens] = 1.0
        return out

    def _scheduled(
        self, req_ids: Sequence[str], num_draft_tokens: np.ndarray
    ) -> tuple[list[Proposal], np.ndarray]:
        """The proposals of the rows with drafts this step, and their draft counts."""
        rows = np.flatnonzero(num_draft_tokens)
        counts = num_draft_tokens[rows].astype(np.int64)
        props = []
        for row, count in zip(rows.tolist(), counts.tolist()):  # per drafted request
            p = self._by_request.get(req_ids[row])
            if p is None or count > p.tokens.shape[0]:
                have = 0 if p is None else p.tokens.shape[0]
                raise RuntimeError(
                    f"request {req_ids[row]!r} is scheduled with {count} drafts but the draft "
                    f"proposer holds {have} for it: the scheduler and the runner disagree")
            props.append(p)
        return props, counts
