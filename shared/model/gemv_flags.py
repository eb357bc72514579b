"""Row-chunk completion counts between chained batch-1 GEMVs (the flag chain).

Under PDL a GEMV waits for the whole previous grid to complete (griddepcontrol.wait)
before it reads that grid's output, so every kernel boundary drains the SMs: llama-3-8b's
GEMV chain took 114 us per layer against 99.6 us when no kernel waited at all (wrong
results, bench_layer_stream's diagnostic row), which is the floor of its bytes. Here a
GEMV that consumes another GEMV's output waits only for the part it is about to read:
- the producer, after storing its rows, adds their number to its output chunk's count and
  to a total (release, after a CTA barrier, so the counts cover every thread's stores);
- the consumer lets its successor launch at once, loads its first weight tile, and before
  it reads x chunk c (FLAG_CHUNK elements) spins until chunk c's count is full (acquire);
  when the total was already full at its start, it checks nothing more;
- it reads x through L2 only (.cg): another SM wrote it while this kernel ran;
- at its end it still executes griddepcontrol.wait, so that a grid completes only after
  the grid before it, as every kernel that relies on plain PDL (and a stream-ordered
  launch after the chain) expects.

The counts live in one arena per model, zeroed at the start of each forward (one memset,
captured in the CUDA graph with the forward), handing out one slot per signalling GEMV in
call order; a GEMV whose input tensor came from a signalling GEMV of this forward waits on
that slot. Deadlock cannot arise: a PDL grid launches only once every program of the grid
before it has started, so a spinning consumer never holds resources a producer needs; a
spin is still bounded (MAX_SPIN), after which it counts an error in the arena and goes on.
"""

from __future__ import annotations

import weakref

import torch

from shared.triton_utils import INTERPRET, tl, triton

FLAG_CHUNK = 512  # x elements per count: divides 4096 and 14336, a multiple of BLOCK_K
# Spins before a consumer gives up (an error in the arena): ~seconds on a GPU; under the
# interpreter programs run one after another, so a count not yet full never fills.
MAX_SPIN = 64 if INTERPRET else 1 << 22
# False (tests): consumers check every chunk even when the total was already full
FAST_PATH = True
# "chunks": wait for each chunk of x just before reading it; "whole": for all of x before
# the loop (what PDL's wait gives, through the counts: a benchmark comparison)
WAIT = "chunks"
# x (and the residual) read through L2 only. The acquire that precedes the reads should
# already keep L1 from serving stale lines (PTX memory model); False measures the cost.
X_L2_ONLY = True
# False (a benchmark diagnostic only): a waiting GEMV exits without waiting for the grid
# before, so grids may complete out of order
END_WAIT = True
# int32s between two counts: 32 puts each on its own 128-byte line, so that consumers
# polling one count and producers adding to another do not contend for a line
COUNT_STRIDE = 32
# "start": a waiting GEMV lets the next kernel launch as it starts; "first_chunk": once
# its first chunk of x has arrived (fewer kernels resident and polling ahead of time)
TRIGGER = "start"
# "auto": the chain runs where PDL does (without it kernels do not overlap and the counts
# cost atomics for nothing); "always" (tests, under the interpreter); "never".
MODE = "auto"


@triton.jit
def acquire_count(count_ptr):
    return tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def wait_for_count(count_ptr, target, error_ptr, MAX_SPIN: tl.constexpr):
    """Spin until the count reaches `target` (acquire), at most MAX_SPIN times."""
    seen = acquire_count(count_ptr)
    spins = 0
    while (seen < target) & (spins < MAX_SPIN):
        seen = acquire_count(count_ptr)
        spins += 1
    if seen < target:
        tl.atomic_add(error_ptr, 1)
    tl.debug_barrier()  # every thread's x loads come after the acquire


@triton.jit
def signal_rows(slot_ptr, first_row, num_rows, FLAG_CHUNK: tl.constexpr,
                STRIDE: tl.constexpr = 1):
    """This program stored rows [first_row, first_row + num_rows) (inside one chunk).
    Count i of a slot is at slot_ptr + i * STRIDE."""
    tl.debug_barrier()
    tl.atomic_add(slot_ptr + (1 + first_row // FLAG_CHUNK) * STRIDE, num_rows,
                  sem="release", scope="gpu")
    tl.atomic_add(slot_ptr, num_rows, sem="release", scope="gpu")


class FlagArena:
    """One forward's counts: arena[0] counts timed-out spins; slot s holds
    [total, chunk 0, chunk 1, ...] (COUNT_STRIDE apart) for the s-th signalling GEMV of
    the forward."""

    def __init__(self, num_slots: int, max_rows: int, device: torch.device | str):
        self.stride = COUNT_STRIDE
        self.slot_size = (1 + -(-max_rows // FLAG_CHUNK)) * self.stride
        self.num_slots = num_slots
        self.max_rows = max_rows
        self.counts = torch.zeros((1 + num_slots) * self.slot_size, dtype=torch.int32,
                                  device=device)
        self._next = 0
        # id(output tensor) -> (a weak reference to it, its slot): tensors compare
        # elementwise, so they cannot be dictionary keys themselves
        self._slot_of: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def begin(self) -> None:
        """A new forward: every count back to 0 (a memset on the stream) and no slots
        handed out."""
        self.counts.zero_()
        self._next = 0
        self._slot_of.clear()

    def slot_counts(self, index: int) -> torch.Tensor:
        """Slot `index`'s counts: [total, chunk 0, chunk 1, ...]."""
        start = (1 + index) * self.slot_size
        return self.counts[start:start + self.slot_size:self.stride]

    def errors(self) -> int:
        return int(self.counts[0].item())

    def error_ptr(self) -> torch.Tensor:
        return self.counts[:1]

    def slot_for_output(self, out: torch.Tensor) -> torch.Tensor | None:
        """A fresh slot for a GEMV about to write `out` (None when the arena is full or
        `out` is too long: that GEMV does not signal, and its consumer waits on PDL)."""
        if self._next == self.num_slots or out.shape[-1] > self.max_rows:
            return None
        start = (1 + self._next) * self.slot_size  # the first slot_size: the error count
        self._next += 1
        slot = self.counts[start:start + self.slot_size]
        self._slot_of[id(out)] = (weakref.ref(out), slot)
        return slot

    def slot_of_input(self, x: torch.Tensor) -> torch.Tensor | None:
        """The slot of the signalling GEMV that wrote `x` in this forward, if any."""
        ref, slot = self._slot_of.get(id(x), (None, None))
        return slot if ref is not None and ref() is x else None


_ACTIVE: FlagArena | None = None


class chain:  # noqa: N801 (used as a context manager, like torch.no_grad)
    """`with chain(arena):` batch-1 GEMVs inside signal and wait through `arena`; the
    arena is zeroed on entry. `chain(None)` changes nothing."""

    def __init__(self, arena: FlagArena | None):
        self.arena = arena

    def __enter__(self) -> FlagArena | None:
        global _ACTIVE
        self._outer = _ACTIVE
        if self.arena is not None:
            self.arena.begin()
            _ACTIVE = self.arena
        return self.arena

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        _ACTIVE = self._outer


def active() -> FlagArena | None:
    return _ACTIVE
