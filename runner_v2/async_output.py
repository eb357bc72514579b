"""Async output: the device-to-host copy of sampled ids (and logprobs) runs on a side
stream while the runner post-processes on the main stream; `get_output()` waits for
the copy (an event sync, not a device sync) and fills the ModelRunnerOutput.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.contract.step import ModelRunnerOutput
from shared.runtime.host_buffers import pinned_empty


class AsyncModelRunnerOutput:
    def __init__(
        self,
        output: ModelRunnerOutput,
        device_tensors: dict[str, torch.Tensor | None],
        fill: Callable[[ModelRunnerOutput, dict[str, torch.Tensor | None]], None],
        copy_stream: torch.cuda.Stream | None,
    ):
        self._output = output
        self._fill = fill
        self._event: torch.cuda.Event | None = None
        if copy_stream is None:
            # CPU: the "device" tensors already are host tensors.
            self._host = {k: (None if t is None else t) for k, t in device_tensors.items()}
            return
        main = torch.cuda.current_stream()
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_stream(main)  # the sampler's results must be complete
            self._host = {}
            for key, t in device_tensors.items():
                if t is None:
                    self._host[key] = None
                    continue
                host = pinned_empty(tuple(t.shape), t.dtype)
                host.copy_(t, non_blocking=True)
                # keep the device tensor alive until the copy is done
                t.record_stream(copy_stream)
                self._host[key] = host
            self._event = torch.cuda.Event(blocking=True)
            self._event.record(copy_stream)

    def get_output(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if self._fill is not None:
            self._fill(self._output, self._host)
            self._fill = None
        return self._output
