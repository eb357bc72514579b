"""Where V1's draft forwards read and write, built without waiting for the step's tokens.

The proposer enqueues the draft model right behind the verify, before the accepted run
reaches the host (runner_v1/spec_decode/draft_proposer.py). The host knows the step's
layout (every row's query, its drafts, its allocated blocks) but not how many drafts
the target accepted; only these few values depend on that count, and they are computed
on the device with a handful of torch ops:

- the catch-up feeds every sampled row one token more than its query, at host-known
  positions [num_computed, num_computed + query_len + 1); the target's new token lands
  at index (known - num_computed) + accepted inside it, over whatever the table held
  there (a rejected draft, or the scratch column past the last draft);
- the single-token draft forwards run at positions new_token_position + i.

Tokens past the new one get KV from rejected drafts: never read before they are
rewritten, since a query at position P reads only positions <= P, every one of which the
same forward or an earlier forward of this step wrote with the right token, and the next
step's catch-up starts at the target's num_computed_tokens, which is at or before them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runner_v1.spec_decode.metadata import ragged_arange
from shared.attention.metadata import PAD_SLOT_ID

# A V1 catch-up feeds a sampled decode row its scheduled drafts + 2 tokens: k + 2 for
# every row whose proposal the scheduler did not trim, whatever was accepted, so FULL
# graphs of q = k + 2 serve every batch size; shorter ones (trimmed drafts: max_tokens
# or max_model_len near) only up to this many requests.
CATCH_UP_FULL_MAX_REQS = 4


def v1_full_query_lens(k: int) -> dict[int, int]:
    """The uniform query lengths V1's draft captures FULL graphs for (q -> the most
    requests): its single-token forwards and untrimmed catch-ups at every size, the
    other catch-ups at small batches."""
    lens = dict.fromkeys(range(2, k + 2), CATCH_UP_FULL_MAX_REQS)
    lens[1] = lens[k + 2] = 1 << 30
    return lens


@dataclass(frozen=True)
class CatchUpLayout:
    """One step's catch-up, host side, rows = the batch's [:N]."""

    lens: np.ndarray  # int64 [N]: tokens fed per row (query, + 1 for a sampled row, capped)
    cu: np.ndarray  # int64 [N]: cumulative lens (row b's tokens end at cu[b])
    sampled: np.ndarray  # bool [N]: the row sampled this step (its query reached its end)
    new_rel: np.ndarray  # int64 [N]: the new token's index in the row with none accepted
    seq_lens: np.ndarray  # int64 [N]: start + lens (an upper bound while a step is in flight)

    @property
    def total(self) -> int:
        return int(self.cu[-1]) if self.cu.size else 0


def catch_up_layout(
    start: np.ndarray, scheduled: np.ndarray, known: np.ndarray, allocated: np.ndarray
) -> CatchUpLayout:
    """start: num_computed before the step; scheduled: query lengths (drafts included);
    known: num_tokens before the step's tokens land; allocated: KV positions owned. All
    int64 [N]. KV past the allocated blocks is never written: the row is cut there (a
    new request's last prefill chunk gets no lookahead, so its new token may not fit)."""
    sampled = (scheduled > 0) & (start + scheduled >= known)
    end = np.minimum(start + scheduled + sampled, allocated)
    lens = np.maximum(end - start, 0)
    return CatchUpLayout(lens=lens, cu=np.cumsum(lens), sampled=sampled, new_rel=known - start,
                         seq_lens=start + lens)


@dataclass(frozen=True)
class StepTokens:
    """The step's flat query on the device, as the target's forward read it (its
    persistent input buffers: the next step's input prep, later in the stream, is what
    overwrites them)."""

    input_ids: torch.Tensor  # int32 [>= num_tokens]
    positions: torch.Tensor  # int64 [>= num_tokens]
    seq_lens: torch.Tensor  # int32 [>= N]
    query_start_loc: np.ndarray  # int [N + 1], host


def catch_up_sources(
    layout: CatchUpLayout, query_start_loc: np.ndarray, scheduled: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host index maps from the catch-up to the step's query: catch-up token t of row b,
    offset j, is the step's token query_start_loc[b] + j, except the one past a sampled
    row's query, which repeats the query's last token one position further on (its id
    is the new token's slot: place_new_tokens overwrites it when it is placed there).
    -> (source token int64 [T], extra position 0/1 int64 [T], row int64 [T])."""
    n = layout.lens.shape[0]
    rows = np.repeat(np.arange(n, dtype=np.int64), layout.lens)
    offset = ragged_arange(layout.lens)
    query_len = scheduled[rows]
    src = query_start_loc[:n].astype(np.int64)[rows] + np.minimum(offset, query_len - 1)
    return src, (offset >= query_len).astype(np.int64), rows


def catch_up_inputs(
    step: StepTokens, src: torch.Tensor, extra: torch.Tensor, rows: torch.Tensor,
    block_table: torch.Tensor, block_size: int, input_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The catch-up's tokens (into input_ids[:T]), positions and slots, on the device,
    from the step's: under async scheduling only the device knows the positions (the
    host's count every draft of the previous step as accepted). Every position lies in
    the row's allocated blocks (catch_up_layout cut the rows there). -> (positions int64
    [T], slots int64 [T])."""
    torch.index_select(step.input_ids, 0, src, out=input_ids[: src.shape[0]])
    positions = step.positions.index_select(0, src) + extra
    blocks = block_table[rows, positions // block_size].to(torch.int64)
    return positions, blocks * block_size + positions % block_size


def place_new_tokens(
    input_ids: torch.Tensor, scratch: int, new_tokens: torch.Tensor,
    num_new: torch.Tensor | None, row_start: torch.Tensor, new_rel: torch.Tensor,
    limit: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes each sampled row's new token (the target's: the bonus or the recovered one)
    into the catch-up's device input_ids, on the device.

    new_tokens: int64 [N, w] (accepted drafts, then the target's token) or [N] (a step
    without drafts); num_new: int32 [N] tokens per row, or None for one each. row_start,
    new_rel, limit: int64 [N] on the device (limit: the row's fed length for a sampled
    row, 0 otherwise). A row whose new token falls past its fed length (cut at its
    allocated blocks) or that did not sample writes to input_ids[scratch], a slot no
    forward reads. -> (the new token's index in the row, whether it was placed)."""
    n = row_start.shape[0]
    if num_new is None:
        accepted = torch.zeros(n, dtype=torch.int64, device=input_ids.device)
        token = new_tokens[:n].reshape(n)
    else:
        accepted = (num_new[:n].to(torch.int64) - 1).clamp_(min=0)
        token = new_tokens[:n].gather(1, accepted[:, None]).squeeze(1)
    rel = new_rel + accepted
    placed = rel < limit
    index = torch.where(placed, row_start + rel, scratch)
    input_ids.index_put_((index,), token.to(input_ids.dtype))
    return rel, placed


def draft_decode_inputs(
    new_pos: torch.Tensor, rows: torch.Tensor, limit: torch.Tensor, block_table: torch.Tensor,
    num_forwards: int, block_size: int, max_model_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k - 1 single-token forwards' inputs for every proposing row at once: forward i
    (1-based) feeds draft i at position new_pos + i. new_pos: int64 [n], the new token's
    position; rows: int64 [n] batch rows; limit: int64 [n], min(allocated, max_model_len).
    A position at or past the limit writes no KV (PAD slot) and is clamped below
    max_model_len so its attention stays inside the block table: its draft is one the
    host trims off. -> (positions int64, seq_lens int32, slots int64), each
    [num_forwards, n]."""
    offsets = torch.arange(1, num_forwards + 1, dtype=torch.int64, device=new_pos.device)
    pos = new_pos[None, :] + offsets[:, None]
    valid = pos < limit[None, :]
    pos.clamp_(max=max_model_len - 1)
    blocks = block_table[rows[None, :].expand_as(pos), pos // block_size].to(torch.int64)
    slots = torch.where(valid, blocks * block_size + pos % block_size, PAD_SLOT_ID)
    return pos, (pos + 1).to(torch.int32), slots
