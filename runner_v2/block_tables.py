"""BlockTables: the persistent per-state-row block table on the device, updated by staged
diffs, plus one per-step kernel that gathers the step's table and computes its slots.

The persistent table is indexed by STATE row (a request's permanent row). Each step only
the new block ids travel (a decode step where nobody crossed a block boundary ships
nothing); the step's table, in batch order, is gathered on the device through
idx_mapping into a persistent buffer whose address never changes (CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from runner_v2.staged_write import StagedWriteTensor
from shared.attention.metadata import PAD_SLOT_ID
from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton

_BLOCK = 1024
# Globals read inside @triton.jit must be constexpr.
_PAD: tl.constexpr = tl.constexpr(PAD_SLOT_ID)


@triton.jit
def _block_tables_and_slots_kernel(
    out_ptr,  # [>= num_reqs_padded, width] int32, the step's table (row stride out_stride)
    out_stride,
    slot_mapping_ptr,  # [max_num_tokens] int64, persistent
    table_ptr,  # [max_num_reqs, width] int32, the persistent table by state row
    table_stride,
    idx_mapping_ptr,  # [num_reqs] int32, batch position -> state row
    query_start_loc_ptr,  # [num_reqs + 1] int32
    positions_ptr,  # [>= num_tokens] int64
    num_reqs,
    num_reqs_padded,
    width,
    max_num_tokens,
    block_size,
    BLOCK: tl.constexpr,
):
    """Programs 0..num_reqs_padded-1: the step's block-table rows (a real row's slots
    too); program num_reqs_padded: the PAD tail of the slot mapping."""
    b = tl.program_id(0)
    dst = out_ptr + b.to(tl.int64) * out_stride
    if b < num_reqs:
        row = tl.load(idx_mapping_ptr + b).to(tl.int64)
        src = table_ptr + row * table_stride
        # Whole row, including columns past this request's num_blocks: those hold stale
        # ids (an earlier occupant's) that attention never reads, since it stops at
        # ceil(seq_len / block_size) blocks.
        for off in range(0, width, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            mask = offs < width
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
        start = tl.load(query_start_loc_ptr + b)
        end = tl.load(query_start_loc_ptr + b + 1)
        for off in range(start, end, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            mask = offs < end
            pos = tl.load(positions_ptr + offs, mask=mask, other=0)
            block_ids = tl.load(src + pos // block_size, mask=mask)
            slots = block_ids.to(tl.int64) * block_size + pos % block_size
            tl.store(slot_mapping_ptr + offs, slots, mask=mask)
    elif b < num_reqs_padded:
        # Padded row of a graph batch: zero over the full width so it names block 0
        # only (its seq_len is 0, so nothing is read anyway).
        for off in range(0, width, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=offs < width)
    else:
        # The last program: PAD from the REAL token count (read on the device) to the
        # end of the buffer. Padded tokens of a graph batch carry stale ids/positions
        # from an earlier step; PAD makes the KV write skip them.
        num_tokens = tl.load(query_start_loc_ptr + num_reqs)
        for off in range(num_tokens, max_num_tokens, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            pad = tl.full([BLOCK], _PAD, dtype=tl.int64)
            tl.store(slot_mapping_ptr + offs, pad, mask=offs < max_num_tokens)


class BlockTables:
    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        block_size: int,
        device: torch.device | str,
    ):
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (max_num_reqs, max_num_blocks_per_req)
        self.block_table = StagedWriteTensor(shape, torch.int32, self.device)
        # Host count of valid block ids per state row (exact: only the host appends).
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        # Persistent per-step outputs: stable addresses for CUDA graphs.
        self.input_block_tables = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.slot_mappings = torch.full(
            (max_num_batched_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=self.device
        )

    def append_block_ids(self, row: int, new_block_ids: Sequence[int], overwrite: bool) -> None:
        """Stage new block ids for state row `row`.

        overwrite=True for a request newly added to the row (fresh or resumed): its ids
        start at column 0 and the previous occupant's count is discarded.
        """
        start = 0 if overwrite else int(self.num_blocks[row])
        n = len(new_block_ids)
        if start + n > self.max_num_blocks_per_req:
            raise ValueError(
                f"state row {row}: {start + n} blocks exceed max_num_blocks_per_req "
                f"({self.max_num_blocks_per_req})"
            )
        self.block_table.stage_write(row, start, new_block_ids)
        self.num_blocks[row] = start + n

    def discard_staged_writes(self) -> None:
        self.block_table.discard_staged_writes()

    def apply_staged_writes(self) -> None:
        self.block_table.apply_write()

    def prepare(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_reqs_padded: int,
        num_tokens_padded: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's block table in batch order, int32 [num_reqs_padded, max_blocks]
        (rows past len(idx_mapping) zeroed), and its KV slots, int64 [num_tokens_padded]
        (PAD from the real token count to the end of the buffer): views of persistent
        buffers, both from one launch. Slots read the persistent table by state row."""
        num_reqs = idx_mapping.shape[0]
        assert idx_mapping.dtype == torch.int32 and idx_mapping.dim() == 1
        assert num_reqs <= num_reqs_padded <= self.max_num_reqs
        assert query_start_loc.dtype == torch.int32 and query_start_loc.shape[0] >= num_reqs + 1
        assert positions.dtype == torch.int64
        assert num_tokens_padded <= self.max_num_batched_tokens
        out, table = self.input_block_tables, self.block_table.gpu
        kept(_block_tables_and_slots_kernel)((num_reqs_padded + 1,),
            out, out.stride(0), self.slot_mappings, table, table.stride(0), idx_mapping,
            query_start_loc, positions, num_reqs, num_reqs_padded,
            self.max_num_blocks_per_req, self.max_num_batched_tokens, self.block_size,
            BLOCK=_BLOCK,
        )  # fmt: skip
        return out[:num_reqs_padded], self.slot_mappings[:num_tokens_padded]
