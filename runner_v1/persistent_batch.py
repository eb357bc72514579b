"""V1's persistent batch: per-request state in dense, row-indexed host arrays.

Row = batch position. Live rows are 0..num_reqs-1 once `condense()` has run; between a
removal and the next condense a removed row is a hole (None in `req_ids`). The
attention inputs, the block-table copy and the sampler all read the prefix
[0, num_reqs), which is why the batch must stay dense and why every per-row field must
move with its request. Those fields are listed once, in `ROW_FIELDS`; condense and
swap_states iterate over that list (a test enumerates the instance's row-indexed arrays
and fails when one is missing from it).
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from runner_v1.batch_update import BatchUpdate, BatchUpdateBuilder, MoveDirectionality
from runner_v1.block_table import BlockTable
from runner_v1.buffers import CpuGpuBuffer
from runner_v1.request_state import CachedRequestState
from runner_v1.sampling_metadata import SamplingMetadata
from runner_v1.sampling_metadata_builder import (
    compute_min_tokens_stop_ids,
    make_sampling_metadata,
)

# Every row-indexed field of PersistentBatch, by attribute name. condense() and
# swap_states() move exactly these; add a field here when you add one to __init__.
ROW_FIELDS: tuple[str, ...] = (
    # Python lists (request ids, references to output lists, stop ids, built-ins)
    "_req_ids", "req_output_token_ids", "stop_token_ids",
    "allowed_token_ids", "logit_bias", "bad_words",
    # tokens and counters
    "token_ids", "num_tokens", "num_prompt_tokens", "num_computed_tokens",
    # sampling values
    "temperature", "top_k", "top_p", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seeds", "min_tokens", "num_logprobs", "eos_token_id",
    # KV blocks (moved through BlockTable.move_row / swap_row)
    "block_table",
)  # fmt: skip
# Fields whose valid part is a row prefix of the given length: only the prefix moves
# (the token table is max_model_len wide, and a row past num_tokens is never read).
ROW_PREFIX_COUNTS: dict[str, str] = {"token_ids": "num_tokens"}


class PersistentBatch:
    ROW_FIELDS = ROW_FIELDS
    ROW_PREFIX_COUNTS = ROW_PREFIX_COUNTS

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        vocab_size: int,
        block_size: int,
        device: torch.device | str,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        R = max_num_reqs

        self._req_ids: list[str | None] = [None] * R
        self.req_id_to_index: dict[str, int] = {}
        # References to the requests' generated-token lists (the sampler's penalties).
        self.req_output_token_ids: list[list[int] | None] = [None] * R
        self.stop_token_ids: list[tuple[int, ...] | None] = [None] * R
        # Built-in logits processors, per row, None = unused (see _write_builtin_row).
        # Lists of small per-request arrays rather than an [R, vocab] mask: a move is a
        # reference copy, and a rebuild sends only the ids to the device.
        self.allowed_token_ids: list[np.ndarray | None] = [None] * R
        self.logit_bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * R
        self.bad_words: list[tuple[tuple[tuple[int, ...], int], ...] | None] = [None] * R

        # The token table is never copied to the device as a whole (input prep gathers
        # from it into a pinned buffer), so it is not pinned: pinning R x max_model_len
        # int32 would lock up to hundreds of MiB. `token_ids_cpu` is the same memory.
        self.token_ids_cpu = torch.zeros(R, max_model_len, dtype=torch.int32)
        self.token_ids: np.ndarray = self.token_ids_cpu.numpy()
        # Host-only counters (read by NumPy input prep, never copied as they are).
        self.num_tokens = np.zeros(R, dtype=np.int32)  # prefill + generated, per row
        self.num_prompt_tokens = np.zeros(R, dtype=np.int32)  # the USER prompt length
        self.num_computed_tokens = np.zeros(R, dtype=np.int32)

        # Sampling values: pinned host + device, copied when the metadata is rebuilt.
        def buffer(dtype: torch.dtype) -> CpuGpuBuffer:
            return CpuGpuBuffer(R, dtype=dtype, device=self.device)

        self.temperature = buffer(torch.float32)
        self.top_k = buffer(torch.int32)  # 0 = off
        self.top_p = buffer(torch.float32)
        self.min_p = buffer(torch.float32)
        self.presence_penalty = buffer(torch.float32)
        self.frequency_penalty = buffer(torch.float32)
        self.repetition_penalty = buffer(torch.float32)
        self.seeds = buffer(torch.int64)
        self.min_tokens = np.zeros(R, dtype=np.int32)
        self.num_logprobs = np.full(R, -1, dtype=np.int32)  # -1 = no logprobs
        self.eos_token_id = np.full(R, -1, dtype=np.int32)  # -1 = none, or ignore_eos

        self.block_table = BlockTable(
            R, -(-max_model_len // block_size), max_num_batched_tokens, block_size, self.device
        )

        self._num_rows = 0  # rows in use, holes included
        self._free_rows: list[int] = []  # heap of holes: add_request takes the lowest
        self.batch_update_builder = BatchUpdateBuilder()
        self.last_batch_update: BatchUpdate | None = None
        self._sampling_metadata: SamplingMetadata | None = None  # None = batch changed
        self._bind_row_fields()

    def _bind_row_fields(self) -> None:
        """Sort ROW_FIELDS by how a row is moved; done once so moves stay cheap. (Tuples,
        not lists: a list attribute of length max_num_reqs reads as a per-row field.)"""
        lists, arrays, prefix_arrays, tables = [], [], [], []
        for name in self.ROW_FIELDS:
            value = getattr(self, name)
            if isinstance(value, BlockTable):
                tables.append(value)
            elif isinstance(value, list):
                lists.append(value)
            else:
                array = value.np if isinstance(value, CpuGpuBuffer) else value
                assert isinstance(array, np.ndarray) and array.shape[0] == self.max_num_reqs
                if name in self.ROW_PREFIX_COUNTS:
                    counts = getattr(self, self.ROW_PREFIX_COUNTS[name])
                    prefix_arrays.append((array, counts))
                else:
                    arrays.append(array)
        self._row_lists: tuple[list, ...] = tuple(lists)
        self._row_arrays: tuple[np.ndarray, ...] = tuple(arrays)
        self._row_prefix_arrays: tuple[tuple[np.ndarray, np.ndarray], ...] = tuple(prefix_arrays)
        self._row_tables: tuple[BlockTable, ...] = tuple(tables)

    # ---- views ------------------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str | None]:
        """Row -> request id for the rows in use; None marks a hole until condense()."""
        return self._req_ids[: self._num_rows]

    @property
    def has_holes(self) -> bool:
        return bool(self._free_rows)

    # ---- add / remove -----------------------------------------------------------------

    def add_request(self, request: CachedRequestState) -> int:
        """Put a request in the lowest hole, else after the last row; returns its row."""
        req_id = request.req_id
        if req_id in self.req_id_to_index:
            raise ValueError(
                f"request {req_id!r} is already at row {self.req_id_to_index[req_id]}; an "
                "aborted-then-resubmitted id must be removed before it is added again"
            )
        tokens = request.all_token_ids
        if len(tokens) > self.max_model_len:
            raise ValueError(f"request {req_id!r} has {len(tokens)} tokens > max_model_len")
        if len(request.block_ids) > self.block_table.max_num_blocks_per_req:
            raise ValueError(f"request {req_id!r} has more blocks than max_model_len needs")
        if self._free_rows:
            row = self._free_rows[0]
        elif self._num_rows < self.max_num_reqs:
            row = self._num_rows
        else:
            raise RuntimeError(f"PersistentBatch is full ({self.max_num_reqs} rows)")
        # Recorded first: the builder refuses an add after a move, before anything changed.
        self.batch_update_builder.added(
            row, req_id, request.sampling_params, request.output_token_ids,
            tuple(request.prompt_token_ids[: request.prompt_len]),
        )
        if self._free_rows:
            heapq.heappop(self._free_rows)
        else:
            self._num_rows += 1

        self._req_ids[row] = req_id
        self.req_id_to_index[req_id] = row
        self.req_output_token_ids[row] = request.output_token_ids
        # Columns past num_tokens keep an older request's tokens; nothing reads them.
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = request.prompt_len
        self.num_computed_tokens[row] = request.num_computed_tokens
        self._write_sampling_row(row, request)
        self.block_table.add_row(request.block_ids, row)
        self._sampling_metadata = None
        return row

    def _write_sampling_row(self, row: int, request: CachedRequestState) -> None:
        # Every sampling field is written on every add: the row may hold a stale request.
        sp = request.sampling_params
        self.temperature.np[row] = sp.temperature
        # top_k >= vocab_size keeps every token: store it as "off" so the row does not
        # switch the whole batch onto the top-k path.
        self.top_k.np[row] = sp.top_k if 0 < sp.top_k < self.vocab_size else 0
        self.top_p.np[row] = sp.top_p
        self.min_p.np[row] = sp.min_p
        self.presence_penalty.np[row] = sp.presence_penalty
        self.frequency_penalty.np[row] = sp.frequency_penalty
        self.repetition_penalty.np[row] = sp.repetition_penalty
        self.seeds.np[row] = request.seed
        self.min_tokens[row] = sp.min_tokens
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        eos = request.eos_token_id
        self.eos_token_id[row] = -1 if eos is None or sp.ignore_eos else eos
        self.stop_token_ids[row] = tuple(sp.stop_token_ids)
        self._write_builtin_row(row, request)

    def _write_builtin_row(self, row: int, request: CachedRequestState) -> None:
        """Written on every add, None included: a row keeps its previous occupant's
        values otherwise (vLLM's V1 leaks a stale allowed-ids mask row that way). Ids past
        the vocabulary are dropped here, as the oracle ignores them."""
        sp, v = request.sampling_params, self.vocab_size
        allowed = None
        if sp.allowed_token_ids is not None:
            # Kept even when empty after the cut: then the row allows no token at all.
            ids = np.asarray(sp.allowed_token_ids, dtype=np.int64)
            allowed = ids[ids < v]
        self.allowed_token_ids[row] = allowed
        bias = None
        if sp.logit_bias:
            ids = np.fromiter(sp.logit_bias, dtype=np.int64, count=len(sp.logit_bias))
            # float32 storage: the sampler widens it to the compute dtype, as the oracle
            values = np.fromiter(sp.logit_bias.values(), dtype=np.float32,
                                 count=len(sp.logit_bias))
            keep = ids < v
            if keep.any():
                bias = (ids[keep], values[keep])
        self.logit_bias[row] = bias
        words = tuple((tuple(w[:-1]), w[-1]) for w in sp.bad_words_token_ids or () if w[-1] < v)
        self.bad_words[row] = words or None

    def remove_request(self, req_id: str) -> int | None:
        """Empty the request's row (a hole until condense()); returns the row or None."""
        row = self.req_id_to_index.get(req_id)
        if row is None:
            return None
        self.batch_update_builder.removed(row)  # first: it may refuse (see BatchUpdate)
        del self.req_id_to_index[req_id]
        for values in self._row_lists:  # the request id, its output list, its built-ins
            values[row] = None
        # The blocks go back to the pool now; if this row ends up past num_reqs it is a
        # padded row of a graph batch and must not name blocks someone else will own.
        self.block_table.clear_row(row)
        heapq.heappush(self._free_rows, row)
        self._sampling_metadata = None
        return row

    def clear(self) -> None:
        """Forget every request (the engine's recovery after a failed step, which may have
        stopped half-way through an update, so no per-row invariant is trusted here). Rows
        become free from 0 up; their arrays keep stale values, which add_request
        overwrites. The removals are recorded for row-indexed consumers."""
        live = sorted(self.req_id_to_index.values())
        self.batch_update_builder = BatchUpdateBuilder()
        for row in live:
            self.batch_update_builder.removed(row)
        self.req_id_to_index.clear()
        for values in self._row_lists:
            values[:] = [None] * self.max_num_reqs
        for row in range(self._num_rows):
            self.block_table.clear_row(row)
        self._num_rows = 0
        self._free_rows = []
        self._sampling_metadata = None

    # ---- moving rows ------------------------------------------------------------------

    def condense(self) -> None:
        """Move the highest occupied row into each hole, lowest hole first, until the
        live rows are exactly 0..num_reqs-1."""
        if not self._free_rows:
            return
        num_reqs = self.num_reqs
        last = self._num_rows - 1
        for hole in sorted(self._free_rows):
            if hole >= num_reqs:
                break  # this hole and all later ones lie in the trimmed tail
            while self._req_ids[last] is None:
                last -= 1
            self._move_row(last, hole)
            last -= 1
        self._free_rows = []
        self._num_rows = num_reqs

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self._req_ids[src]
        for array, counts in self._row_prefix_arrays:
            n = counts[src]
            array[dst, :n] = array[src, :n]
        for array in self._row_arrays:
            array[dst] = array[src]
        for values in self._row_lists:
            values[dst] = values[src]
            values[src] = None
        for table in self._row_tables:
            table.move_row(src, dst)
        self.req_id_to_index[req_id] = dst
        self.batch_update_builder.moved(src, dst, MoveDirectionality.UNIDIRECTIONAL)
        self._sampling_metadata = None

    def swap_states(self, i: int, j: int) -> None:
        """Exchange two occupied rows, every field included."""
        if i == j:
            return
        id_i, id_j = self._req_ids[i], self._req_ids[j]
        if id_i is None or id_j is None:
            raise ValueError(f"swap_states({i}, {j}): both rows must hold a request")
        # Fancy indexing copies the right-hand side first. A tuple swap of row views
        # (a[i], a[j] = a[j], a[i]) would leave both rows equal to the old row j.
        for array, counts in self._row_prefix_arrays:  # before the counts are swapped
            n = max(counts[i], counts[j])
            array[[i, j], :n] = array[[j, i], :n]
        for array in self._row_arrays:
            array[[i, j]] = array[[j, i]]
        for values in self._row_lists:
            values[i], values[j] = values[j], values[i]
        for table in self._row_tables:
            table.swap_row(i, j)
        self.req_id_to_index[id_i] = j
        self.req_id_to_index[id_j] = i
        self.batch_update_builder.moved(i, j, MoveDirectionality.SWAP)
        self._sampling_metadata = None

    def reorder_decodes_first(self, num_scheduled_tokens: dict[str, int]) -> int:
        """Rows with query length 1 (decodes) first, the rest after, in the fewest swaps
        (vLLM's V1 reorder, not a stable partition): each prefill row among the first
        num_decodes rows, front to back, swaps with a decode row past them, back to
        front. A swap moves every field of both rows, so a stable partition, which
        shifted every decode behind the first prefill (about every row of a churn step),
        cost the host a swap per row. Returns the number of decode rows."""
        self._require_dense("reorder_decodes_first")
        n = self.num_reqs
        query_lens = np.fromiter(
            (num_scheduled_tokens[r] for r in self._req_ids[:n]), dtype=np.int64, count=n
        )
        is_decode = query_lens == 1
        num_decodes = int(is_decode.sum())
        prefills_in_front = np.flatnonzero(~is_decode[:num_decodes])
        decodes_behind = num_decodes + np.flatnonzero(is_decode[num_decodes:])[::-1]
        # as many of one as of the other; a loop over misplaced requests, not tokens
        for i, j in zip(prefills_in_front.tolist(), decodes_behind.tolist()):
            self.swap_states(i, j)
        return num_decodes

    def _require_dense(self, what: str) -> None:
        if self._free_rows:
            raise RuntimeError(f"{what}: the batch has holes; call condense() first")

    # ---- per-step updates -------------------------------------------------------------

    def append_output_tokens(self, rows_np: np.ndarray, token_ids_np: np.ndarray) -> None:
        """Write one sampled token per given row into the token table (vectorised).
        The caller appends the same tokens to the requests' output lists."""
        cols = self.num_tokens[rows_np]
        self.token_ids[rows_np, cols] = token_ids_np
        self.num_tokens[rows_np] = cols + 1

    # ---- sampling metadata --------------------------------------------------------------

    def refresh_sampling_metadata(self) -> SamplingMetadata:
        """The sampler's view of the batch. Rebuilt (and copied to the device) only when
        rows changed since the last build; the output-count-dependent part is refreshed
        on every call. Also emits this step's BatchUpdate into `last_batch_update`."""
        self._require_dense("refresh_sampling_metadata")
        self.last_batch_update = self.batch_update_builder.get_and_reset(self.num_reqs)
        if self._sampling_metadata is None:
            self._sampling_metadata = make_sampling_metadata(self)
        self._sampling_metadata.min_tokens_stop_ids = compute_min_tokens_stop_ids(self)
        return self._sampling_metadata
