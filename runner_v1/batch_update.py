"""BatchUpdate: what happened to the rows of V1's persistent batch during one step.

Anything that keeps its own row-indexed state (logits processors, a sampler cache)
replays these records to stay aligned with the PersistentBatch. A consumer applies them in
this order: `removed` (the row's request is gone), then `added` (a new request now sits
at the row), then `moved` in the recorded order.

That fixed replay order only reproduces the batch if, within a step, every removal and
addition happens before the first move. V1's `_update_states` has exactly that shape
(removes, adds, then condense and reorder), and the builder refuses anything else rather
than emitting a record that replays to the wrong layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shared.contract.sampling_params import SamplingParams


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = "unidirectional"  # src -> dst; src is left empty (condense)
    SWAP = "swap"  # src <-> dst (reorder)


@dataclass(frozen=True)
class AddedRequest:
    row: int
    req_id: str
    sampling_params: SamplingParams
    # A live reference to the request's generated tokens (grows as the request decodes).
    output_token_ids: list[int]
    prompt_token_ids: tuple[int, ...] = ()  # the user prompt


@dataclass(frozen=True)
class MovedRequest:
    src: int
    dst: int
    directionality: MoveDirectionality


@dataclass(frozen=True)
class BatchUpdate:
    batch_size: int  # number of live rows after the step's changes
    removed: tuple[int, ...]  # ascending; rows whose request left and was not replaced
    added: tuple[AddedRequest, ...]  # ascending by row
    moved: tuple[MovedRequest, ...]  # in the order they happened


class BatchUpdateBuilder:
    """Collects one step's row changes; `get_and_reset` emits them and starts over."""

    def __init__(self) -> None:
        self._removed: set[int] = set()
        self._added: dict[int, AddedRequest] = {}
        self._moved: list[MovedRequest] = []

    def _check_no_moves(self, what: str) -> None:
        if self._moved:
            raise RuntimeError(
                f"BatchUpdateBuilder: a row was {what} after rows were moved in the same "
                "step; the removed/added/moved record cannot express that order. Remove "
                "and add requests before condense() and reordering, or call "
                "get_and_reset() first."
            )

    def removed(self, row: int) -> None:
        self._check_no_moves("removed")
        # A request added to this row earlier in the step never existed for consumers.
        self._added.pop(row, None)
        self._removed.add(row)

    def added(
        self,
        row: int,
        req_id: str,
        sampling_params: SamplingParams,
        output_token_ids: list[int],
        prompt_token_ids: tuple[int, ...] = (),
    ) -> None:
        self._check_no_moves("added")
        # Refilling a hole: the row is no longer empty at the end of the step, but the
        # `added` entry still tells consumers that its previous occupant is gone.
        self._removed.discard(row)
        self._added[row] = AddedRequest(row, req_id, sampling_params, output_token_ids,
                                        tuple(prompt_token_ids))

    def moved(self, src: int, dst: int, directionality: MoveDirectionality) -> None:
        self._moved.append(MovedRequest(src, dst, directionality))

    @property
    def has_changes(self) -> bool:
        return bool(self._removed or self._added or self._moved)

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """The step's record, or None when no row changed; the builder is then empty."""
        if not self.has_changes:
            return None
        update = BatchUpdate(
            batch_size=batch_size,
            removed=tuple(sorted(self._removed)),
            added=tuple(self._added[row] for row in sorted(self._added)),
            moved=tuple(self._moved),
        )
        self._removed = set()
        self._added = {}
        self._moved = []
        return update


def replay_batch_update(rows: list, update: BatchUpdate | None) -> list:
    """Apply `update` to a plain list of row occupants (None = empty row); returns the new
    list. The reference consumer: tests use it to check the records, and a row-indexed
    consumer can mirror its logic."""
    rows = list(rows)
    if update is None:
        return rows
    needed = max([update.batch_size, *(a.row + 1 for a in update.added)], default=0)
    rows.extend([None] * max(0, needed - len(rows)))
    for row in update.removed:
        if row < len(rows):
            rows[row] = None
    for added in update.added:
        rows[added.row] = added.req_id
    for move in update.moved:
        if move.directionality is MoveDirectionality.SWAP:
            rows[move.src], rows[move.dst] = rows[move.dst], rows[move.src]
        else:
            rows[move.dst] = rows[move.src]
            rows[move.src] = None
    return rows[: update.batch_size]
