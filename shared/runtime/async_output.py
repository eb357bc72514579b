"""Async output, both runners: the device-to-host copy of a step's sampled ids (and
logprobs) runs on a side stream while the runner post-processes on the main stream;
`get_output()` waits for the copy (an event sync, not a device sync) and fills the
ModelRunnerOutput.

The copies land in pinned host buffers that a `PinnedOutputRing` hands out round-robin
and reuses, instead of allocating fresh pinned memory every step (page-locking is a
driver call; the caching host allocator still costs a lock and bookkeeping per
tensor). A slot is handed out again only after its previous owner has been
materialised (its copy waited for and its output filled from the buffers), so a reuse
can never overwrite tokens a caller has not read yet, whatever the ring's depth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shared.contract.step import ModelRunnerOutput, TokenLogprobs
from shared.runtime.host_buffers import pinned_empty

HostTensors = dict[str, torch.Tensor | None]
Fill = Callable[[ModelRunnerOutput, HostTensors], None]


class PinnedOutputRing:
    """`depth` slots of named pinned buffers, grown on demand and reused in turn."""

    def __init__(self, depth: int = 3):
        if depth < 1:
            raise ValueError(f"PinnedOutputRing depth={depth}; it needs at least one slot")
        self._slots: list[dict[str, torch.Tensor]] = [{} for _ in range(depth)]
        self._owners: list[AsyncModelRunnerOutput | None] = [None] * depth
        self._next = 0

    def take(self, owner: AsyncModelRunnerOutput) -> dict[str, torch.Tensor]:
        i = self._next
        self._next = (i + 1) % len(self._slots)
        previous = self._owners[i]
        if previous is not None:
            previous.materialize()  # its buffers are about to be overwritten
        self._owners[i] = owner
        return self._slots[i]


def _host_buffer(slot: dict[str, torch.Tensor], key: str, t: torch.Tensor) -> torch.Tensor:
    """A pinned view shaped like `t` from the slot's buffer for `key`, grown to the next
    power of two when too small (batch sizes vary step to step; this keeps regrowth rare)."""
    n = t.numel()
    buf = slot.get(key)
    if buf is None or buf.dtype != t.dtype or buf.numel() < n:
        buf = pinned_empty(1 << max(n - 1, 0).bit_length(), t.dtype)
        slot[key] = buf
    return buf[:n].view(t.shape)


class AsyncModelRunnerOutput:
    def __init__(
        self,
        output: ModelRunnerOutput,
        device_tensors: HostTensors,
        fill: Fill,
        copy_stream: torch.cuda.Stream | None,
        ring: PinnedOutputRing | None = None,
    ):
        self._output = output
        self._fill: Fill | None = fill
        self._event: torch.cuda.Event | None = None
        self._device: HostTensors | None = None
        if copy_stream is None:
            # CPU: the "device" tensors already are host tensors.
            self._host: HostTensors | None = dict(device_tensors)
            return
        slot = ring.take(self) if ring is not None else None
        main = torch.cuda.current_stream()
        host: HostTensors = {}
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_stream(main)  # the sampler's results must be complete
            for key, t in device_tensors.items():
                if t is None:
                    host[key] = None
                    continue
                dst = pinned_empty(tuple(t.shape), t.dtype) if slot is None else (
                    _host_buffer(slot, key, t))
                dst.copy_(t, non_blocking=True)
                if slot is None:
                    # nothing else keeps the device tensor alive until the copy is done
                    t.record_stream(copy_stream)
                host[key] = dst
            self._event = torch.cuda.Event()
            self._event.record(copy_stream)
        self._host = host
        if slot is not None:
            # Held until materialize(): the main stream cannot reuse their memory while
            # the copy may still read it (cheaper than record_stream per tensor).
            self._device = device_tensors

    def host_tensors(self) -> HostTensors:
        """The copied tensors, once the copy has landed (waits for it)."""
        self._wait()
        assert self._host is not None, "host_tensors() after the output was materialised"
        return self._host

    def get_output(self) -> ModelRunnerOutput:
        self.materialize()
        return self._output

    def materialize(self) -> None:
        """Wait for the copy and fill the output; afterwards the host buffers may be reused."""
        if self._fill is None:
            return
        self._wait()
        self._fill(self._output, self._host)
        self._fill = None
        self._host = None

    def _wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
            self._device = None


def fill_sampled_output(
    output: ModelRunnerOutput,
    host: HostTensors,
    is_sampled: Sequence[bool],
    num_logprobs: Sequence[int],
) -> None:
    """The runner-independent part of a step's output, from host copies of the sampler's
    tensors ("sampled" [n], and "ids" / "lps" / "ranks" when logprobs were computed):
    one token for each row that samples (a partial prefill chunk's token is dropped),
    and per row either None or the top `num_logprobs[row]` raw logprobs."""
    tokens = host["sampled"].tolist()
    output.sampled_token_ids = [[t] if s else [] for t, s in zip(tokens, is_sampled)]
    if host.get("lps") is None:
        return
    ids, lps, ranks = host["ids"].tolist(), host["lps"].tolist(), host["ranks"].tolist()
    output.logprobs = [
        TokenLogprobs(ids[i][: 1 + k], lps[i][: 1 + k], ranks[i]) if k >= 0 and s else None
        for i, (k, s) in enumerate(zip(num_logprobs, is_sampled))
    ]


def fill_spec_sampled_output(
    output: ModelRunnerOutput, host: HostTensors, is_sampled: Sequence[bool],
    num_drafts: int,
) -> None:
    """A speculative step's output from host copies of the rejection sampler's tensors
    ("sampled" [n, max_k + 1], "num_sampled" [n]): each sampling row's accepted run, and
    `num_drafts` placeholders (-1: the values stay on the device) as its next drafts."""
    runs, counts = host["sampled"].tolist(), host["num_sampled"].tolist()
    output.sampled_token_ids = [r[:c] if s else [] for r, c, s in zip(runs, counts, is_sampled)]
    output.draft_token_ids = [[-1] * num_drafts if s else [] for s in is_sampled]
