"""V1 input preparation: turn per-row query lengths into the flat ragged-batch tensors.

Everything is vectorised NumPy over the rows of the (dense, condensed) PersistentBatch and
written into persistent host buffers, then shipped with non_blocking copies. Padding
rules (a CUDA graph replays over padded sizes, so stale values would be read):
- query_start_loc past the real rows repeats the last real value (non-decreasing),
- seq_lens past the real rows is 0 (a padded row attends to nothing),
- slot_mapping from the real token count on is PAD_SLOT_ID (the KV write skips it),
- input_ids / positions of padded tokens are 0 (in range for the embedding and RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runner_v1.buffers import CpuGpuBuffer
from runner_v1.persistent_batch import PersistentBatch
from shared.attention.metadata import CommonAttentionMetadata, count_leading_decodes


class InputBuffers:
    """The persistent per-step buffers (host + device); the device sides are what a
    captured CUDA graph reads, so they are allocated once at their maximum size."""

    def __init__(
        self, max_num_reqs: int, max_num_batched_tokens: int, device: torch.device | str
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        T, R = max_num_batched_tokens, max_num_reqs
        self.input_ids = CpuGpuBuffer(T, dtype=torch.int32, device=device)
        self.positions = CpuGpuBuffer(T, dtype=torch.int64, device=device)
        self.query_start_loc = CpuGpuBuffer(R + 1, dtype=torch.int32, device=device)
        self.seq_lens = CpuGpuBuffer(R, dtype=torch.int32, device=device)
        self.logits_indices = CpuGpuBuffer(R, dtype=torch.int64, device=device)
        self.query_pos = np.zeros(T, dtype=np.int32)  # host-only scratch
        self.arange = np.arange(max(R, T) + 1, dtype=np.int32)


@dataclass
class PreparedInputs:
    """One step's flat inputs. Device tensors are views of persistent buffers, valid until
    the next step's input prep overwrites them; `*_cpu` / `*_np` are host views."""

    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    num_tokens_padded: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # leading rows with query length 1
    num_decode_tokens: int
    num_scheduled_tokens_np: np.ndarray  # int32 [num_reqs]
    query_start_loc: torch.Tensor  # int32 [num_reqs_padded + 1], device
    query_start_loc_cpu: torch.Tensor  # int32 [num_reqs_padded + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs_padded], device
    seq_lens_cpu: torch.Tensor  # int32 [num_reqs_padded]
    positions: torch.Tensor  # int64 [num_tokens_padded], device
    positions_np: np.ndarray  # int64 [num_tokens]
    input_ids: torch.Tensor  # int32 [num_tokens_padded], device
    slot_mapping: torch.Tensor  # int64 [num_tokens_padded], device
    logits_indices: torch.Tensor  # int64 [num_reqs], device: last token of each row
    logits_indices_np: np.ndarray  # int64 [num_reqs]

    def common_attn_metadata(
        self, block_table: torch.Tensor, block_size: int
    ) -> CommonAttentionMetadata:
        """block_table: the committed device table; rows past num_reqs are zero there."""
        return CommonAttentionMetadata.for_batch(
            self, block_table[: self.num_reqs_padded], self.slot_mapping, block_size,
            query_start_loc_cpu=self.query_start_loc_cpu, seq_lens_cpu=self.seq_lens_cpu,
        )


# ---- pure vectorised pieces -------------------------------------------------------------


def compute_req_indices(num_scheduled: np.ndarray, arange: np.ndarray) -> np.ndarray:
    """Row of every flat token: [2, 5, 3] -> [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]."""
    return np.repeat(arange[: num_scheduled.shape[0]], num_scheduled)


def cumsum_and_arange(
    num_scheduled: np.ndarray, arange: np.ndarray, out_query_pos: np.ndarray
) -> np.ndarray:
    """Returns cu_num_tokens ([2, 5, 3] -> [2, 7, 10]) and writes each token's offset in
    its row's chunk into out_query_pos ([0, 1, 0, 1, 2, 3, 4, 0, 1, 2]): a global arange
    minus each row's start, repeated per token; no Python loop over rows."""
    cu_num_tokens = np.cumsum(num_scheduled)
    total = int(cu_num_tokens[-1]) if cu_num_tokens.shape[0] else 0
    row_starts = np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
    np.subtract(arange[:total], row_starts, out=out_query_pos[:total])
    return cu_num_tokens


def fill_query_start_loc(cu_num_tokens: np.ndarray, out: np.ndarray) -> None:
    """out[0] = 0, out[1:n+1] = cu_num_tokens, and the padded tail repeats the last
    value so a varlen kernel sees empty padded rows, never a decreasing offset."""
    n = cu_num_tokens.shape[0]
    out[0] = 0
    out[1 : n + 1] = cu_num_tokens
    out[n + 1 :] = cu_num_tokens[-1] if n else 0


def fill_seq_lens(
    num_computed: np.ndarray, num_scheduled: np.ndarray, out: np.ndarray
) -> None:
    """seq_len = tokens in the KV cache after this step; 0 for every padded row."""
    n = num_scheduled.shape[0]
    np.add(num_computed[:n], num_scheduled, out=out[:n])
    out[n:] = 0


def gather_input_ids(
    token_ids_cpu: torch.Tensor,
    req_indices: np.ndarray,
    positions: np.ndarray,
    out: torch.Tensor,
) -> None:
    """input_ids[t] = token_ids[req[t], pos[t]], as one index_select over the flattened
    [R, max_model_len] table (faster than np.take on a large table)."""
    max_model_len = token_ids_cpu.shape[1]
    token_indices = req_indices.astype(np.int64) * max_model_len + positions
    torch.index_select(token_ids_cpu.view(-1), 0, torch.from_numpy(token_indices), out=out)


# ---- the whole step -------------------------------------------------------------------


def prepare_inputs(
    batch: PersistentBatch,
    num_scheduled_tokens_np: np.ndarray,
    buffers: InputBuffers,
    num_tokens_padded: int | None = None,
    num_reqs_padded: int | None = None,
    num_draft_tokens: np.ndarray | None = None,
) -> PreparedInputs:
    """num_scheduled_tokens_np: int32 [num_reqs] in row order of the condensed batch.
    num_draft_tokens: int32 [num_reqs], speculative drafts written past each row's
    num_tokens in the token table (runner_v1/spec_decode), or None."""
    num_reqs = batch.num_reqs
    if batch.has_holes or num_scheduled_tokens_np.shape[0] != num_reqs:
        raise ValueError("prepare_inputs needs a condensed batch and one count per row")
    if num_reqs == 0:
        raise ValueError("prepare_inputs: no rows (a zero-token step skips input prep)")
    # First: start the block-table copy so it overlaps the NumPy work below.
    batch.block_table.commit(num_reqs)

    num_scheduled = num_scheduled_tokens_np
    cu_num_tokens = cumsum_and_arange(num_scheduled, buffers.arange, buffers.query_pos)
    num_tokens = int(cu_num_tokens[-1])
    num_tokens_padded = num_tokens if num_tokens_padded is None else num_tokens_padded
    num_reqs_padded = num_reqs if num_reqs_padded is None else num_reqs_padded
    _check_sizes(num_reqs, num_reqs_padded, num_tokens, num_tokens_padded, buffers)

    seq_lens_np = buffers.seq_lens.np
    fill_seq_lens(batch.num_computed_tokens, num_scheduled, seq_lens_np)
    max_seq_len = int(seq_lens_np[:num_reqs].max())
    # A position at or past num_tokens would read a stale token (or the next row).
    known = batch.num_tokens[:num_reqs]
    if num_draft_tokens is not None:
        known = known + num_draft_tokens
    over = np.flatnonzero(seq_lens_np[:num_reqs] > known)
    if over.size:
        row = int(over[0])
        raise RuntimeError(
            f"V1 input prep: request {batch.req_ids[row]!r} (row {row}) is scheduled up "
            f"to position {int(seq_lens_np[row])} but the persistent batch holds only "
            f"{int(batch.num_tokens[row])} of its tokens: the scheduler and the runner "
            "disagree about it (a step that failed without the engine's recovery?)"
        )

    req_indices = compute_req_indices(num_scheduled, buffers.arange)
    positions_np = buffers.positions.np[:num_tokens]
    np.add(
        batch.num_computed_tokens[req_indices],
        buffers.query_pos[:num_tokens],
        out=positions_np,
    )
    gather_input_ids(
        batch.token_ids_cpu, req_indices, positions_np, buffers.input_ids.cpu[:num_tokens]
    )
    buffers.positions.np[num_tokens:num_tokens_padded] = 0
    buffers.input_ids.np[num_tokens:num_tokens_padded] = 0

    qsl_np = buffers.query_start_loc.np
    fill_query_start_loc(cu_num_tokens, qsl_np)
    logits_np = buffers.logits_indices.np[:num_reqs]
    np.subtract(qsl_np[1 : num_reqs + 1], 1, out=logits_np)

    slot_mapping = batch.block_table.compute_slot_mapping(
        req_indices, positions_np, num_tokens_padded
    )
    num_decodes = count_leading_decodes(num_scheduled)
    return PreparedInputs(
        num_reqs=num_reqs,
        num_reqs_padded=num_reqs_padded,
        num_tokens=num_tokens,
        num_tokens_padded=num_tokens_padded,
        max_query_len=int(num_scheduled.max()),
        max_seq_len=max_seq_len,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        num_scheduled_tokens_np=num_scheduled,
        query_start_loc=buffers.query_start_loc.copy_to_gpu(num_reqs_padded + 1),
        query_start_loc_cpu=buffers.query_start_loc.cpu[: num_reqs_padded + 1],
        seq_lens=buffers.seq_lens.copy_to_gpu(num_reqs_padded),
        seq_lens_cpu=buffers.seq_lens.cpu[:num_reqs_padded],
        positions=buffers.positions.copy_to_gpu(num_tokens_padded),
        positions_np=positions_np,
        input_ids=buffers.input_ids.copy_to_gpu(num_tokens_padded),
        slot_mapping=slot_mapping,
        logits_indices=buffers.logits_indices.copy_to_gpu(num_reqs),
        logits_indices_np=logits_np,
    )


def _check_sizes(
    num_reqs: int,
    num_reqs_padded: int,
    num_tokens: int,
    num_tokens_padded: int,
    buffers: InputBuffers,
) -> None:
    if not num_tokens <= num_tokens_padded <= buffers.max_num_batched_tokens:
        raise ValueError(
            f"num_tokens_padded={num_tokens_padded} must lie in [num_tokens={num_tokens}, "
            f"max_num_batched_tokens={buffers.max_num_batched_tokens}]"
        )
    if not num_reqs <= num_reqs_padded <= buffers.max_num_reqs:
        raise ValueError(
            f"num_reqs_padded={num_reqs_padded} must lie in [num_reqs={num_reqs}, "
            f"max_num_reqs={buffers.max_num_reqs}]"
        )
