"""RequestState: V2's GPU-resident state table, one permanent row per request.

A request gets a row when it is added and keeps it until it finishes, is aborted or is
preempted (preemption is treated as completion: a resumed request is added again, with
its generated tokens appended to its prefill). Rows are never moved and NOTHING is
cleared on removal, so every per-row field must be overwritten on add; a field that is
not would leak the previous occupant's data into the new request. The per-step batch is
a gather through `idx_mapping` (batch position -> state row), never a reorder.

Authority: the device `num_computed_tokens` is the truth and only kernels advance it
(post_update); `num_computed_tokens_np` is the scheduler's optimistic host copy, an
upper bound used for host-side sizes such as max_seq_len. total_len, last_sampled_tokens
and the tail of all_token_ids are likewise advanced on the device only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from runner_v2.staged_write import StagedWriteTensor, apply_row_scalars


class RequestState:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        vocab_size: int,
        device: torch.device | str,
    ):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.vocab_size = vocab_size
        self.device = torch.device(device)

        self.req_id_to_index: dict[str, int] = {}
        self.index_to_req_id: dict[int, str] = {}
        # LIFO: pop from the end, push freed rows back on the end. The first request
        # gets row R-1 and a freed row is the next one reused (hot in caches, and the
        # fastest way for tests to catch a field that add forgot to overwrite).
        self.free_indices: list[int] = list(range(max_num_reqs))

        R = max_num_reqs
        # Prefill tokens, then sampled tokens appended on the device by post_update.
        # Large (R x max_model_len) and read only by the input-prep kernels: pinned host
        # memory read through UVA on CUDA, device memory otherwise.
        self.all_token_ids = StagedWriteTensor(
            (R, max_model_len), torch.int32, self.device, uva_instead_of_gpu=True
        )
        self.num_computed_tokens = StagedWriteTensor(R, torch.int32, self.device)
        self.prompt_len = StagedWriteTensor(R, torch.int32, self.device)
        self.prefill_len = StagedWriteTensor(R, torch.int32, self.device)
        self.total_len = StagedWriteTensor(R, torch.int32, self.device)
        self.last_sampled_tokens = StagedWriteTensor(R, torch.int64, self.device)
        # the per-row scalars, written together at each admission: one apply for all
        self._row_scalars = (
            self.num_computed_tokens,
            self.prompt_len,
            self.prefill_len,
            self.total_len,
            self.last_sampled_tokens,
        )
        self._staged = (self.all_token_ids, *self._row_scalars)
        # The scheduler's view (before this step's tokens); the runner refreshes it for
        # cached requests each step. An upper bound on the device value.
        self.num_computed_tokens_np = np.zeros(R, dtype=np.int32)

    # Host mirrors of fields that only change at add (exact, not just bounds).
    @property
    def prompt_len_np(self) -> np.ndarray:
        return self.prompt_len.np

    @property
    def prefill_len_np(self) -> np.ndarray:
        return self.prefill_len.np

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(
        self,
        req_id: str,
        prompt_len: int,
        prefill_token_ids: Sequence[int] | np.ndarray,
        num_computed_tokens: int,
    ) -> int:
        """Give `req_id` a row and stage all of its per-row state; returns the row.

        prefill_token_ids: the prompt, plus the tokens generated before a preemption
        when the request resumes (so prefill_len >= prompt_len).
        """
        if req_id in self.req_id_to_index:
            raise ValueError(
                f"request {req_id!r} already holds state row {self.req_id_to_index[req_id]}"
            )
        prefill_len = len(prefill_token_ids)
        if not (0 < prompt_len <= prefill_len <= self.max_model_len):
            raise ValueError(
                f"request {req_id!r}: need 0 < prompt_len ({prompt_len}) <= prefill_len "
                f"({prefill_len}) <= max_model_len ({self.max_model_len})"
            )
        if not (0 <= num_computed_tokens <= prefill_len):
            raise ValueError(
                f"request {req_id!r}: num_computed_tokens {num_computed_tokens} not in "
                f"[0, prefill_len={prefill_len}]"
            )
        if not self.free_indices:
            raise RuntimeError(
                f"request {req_id!r}: all {self.max_num_reqs} state rows are taken (max_num_seqs); "
                "the scheduler admitted more running requests than max_num_seqs"
            )
        row = self.free_indices.pop()
        self.req_id_to_index[req_id] = row
        self.index_to_req_id[row] = req_id

        # Overwrite EVERY per-row field: nothing was cleared when the row was freed.
        # all_token_ids past prefill_len keeps the previous occupant's tokens; that is
        # harmless because every reader stops at total_len (set here) and post_update
        # overwrites position total_len before bumping it.
        self.all_token_ids.stage_write(row, 0, prefill_token_ids)
        self.num_computed_tokens.stage_write_elem(row, num_computed_tokens)
        self.prompt_len.stage_write_elem(row, prompt_len)
        self.prefill_len.stage_write_elem(row, prefill_len)
        self.total_len.stage_write_elem(row, prefill_len)
        # Read only once the prefill is done, by which time post_update has set it; the
        # 0 keeps a bug from surfacing as the previous occupant's token.
        self.last_sampled_tokens.stage_write_elem(row, 0)
        self.num_computed_tokens_np[row] = num_computed_tokens
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Free `req_id`'s row (no data is cleared); None when it holds no row."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        del self.index_to_req_id[row]
        self.free_indices.append(row)
        return row

    def reset(self) -> None:
        """Free every row and drop the writes not yet shipped (the engine's recovery after
        a failed step). No data is cleared, as on any removal."""
        self.req_id_to_index.clear()
        self.index_to_req_id.clear()
        self.free_indices = list(range(self.max_num_reqs))
        for tensor in self._staged:
            tensor.discard_staged_writes()

    def apply_staged_writes(self) -> None:
        """Ship this step's staged per-row writes: one copy + one launch for the token
        table and one for all the per-row scalars (none when nothing was added)."""
        self.all_token_ids.apply_write()
        apply_row_scalars(self._row_scalars)
