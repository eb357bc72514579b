"""Piecewise CUDA graphs, one implementation for both runners: the model split at its
attention calls, every piece between two attention calls captured once per padded token
count, attention itself run eagerly in between (vLLM gets the split from torch.compile;
here the model exposes it by hand: LlamaModel.forward_segment / attention). V1 replays
them through its implicit wrapper (runner_v1/cudagraph.py), V2 by descriptor
(runner_v2/cudagraph.py).

A segment only does per-token work (embedding, norms, matmuls, RoPE, MLP / MoE, and
the KV write of the attention after it, which reads the runner's persistent slot
mapping), so a graph captured at S tokens serves any batch of <= S tokens whatever its
mix of prefills and decodes; attention itself is the one piece that depends on the
batch layout (query_start_loc, seq_lens, block tables), so it stays eager and reads the
step's metadata from the forward context. Recording the KV write takes one launch per
layer off the eager part, which sets the host cost of a piecewise step on a model of
many thin layers (scripts/bench_attention_host.py measures the pieces). The KV caches
are therefore bound before capture and never rebound, as FULL graphs already require.

Static buffers: every segment graph reads its inputs from, and copies its outputs into,
views [:S] of buffers allocated here once at the largest size (plus the runner's
persistent input_ids / positions). The graphs own no live outputs, so their private
temporaries can all share one memory pool: any graph may reuse any other's scratch
memory, since replays never overlap and nothing a graph allocated is read after it ends.

Padding (S > num_tokens): tokens num_tokens..S-1 are padding. The runner's input prep
writes input_ids 0, positions 0 (in range for the embedding and RoPE) and slot_mapping
PAD there (so the recorded KV write skips them); the attention metadata covers the real
requests only (num_reqs is not padded), so padded tokens attend to nothing and write no
KV. Their rows carry garbage
(attention leaves them unwritten, and the static buffers hold whatever an earlier,
larger step left), but every segment op is per token (norm, linear, MLP, MoE routing),
so garbage stays in its row, and logits_indices point at real tokens only: a padded
row is never sampled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from shared.attention.metadata import PAD_SLOT_ID
from shared.runtime.cudagraph_utils import Replayable, no_gc_during_capture
from shared.runtime.forward_context import get_forward_context

logger = logging.getLogger("runnerlab")


@dataclass(frozen=True)
class _Views:
    """The static buffers cut to one capture size S."""

    input_ids: torch.Tensor  # int32 [S], the runner's persistent buffer
    positions: torch.Tensor  # int64 [S], the runner's persistent buffer
    slot_mapping: torch.Tensor  # int64 [S], the runner's persistent buffer
    q: torch.Tensor  # [S, H*D]
    k: torch.Tensor  # [S, Hkv*D]
    v: torch.Tensor  # [S, Hkv*D]
    attn_output: torch.Tensor  # [S, H*D]
    residual: torch.Tensor  # [S, hidden]
    hidden_states: torch.Tensor  # [S, hidden]: the last segment's output


def split_model(model: nn.Module) -> nn.Module:
    """The module that exposes the piecewise split (LlamaModel inside LlamaForCausalLM,
    also for the MoE subclasses); a clear error for a model without one."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "forward_segment"):
        raise TypeError(
            f"{type(model).__name__} has no piecewise split (forward_segment); use "
            "cudagraph_mode='FULL' or 'NONE' for it"
        )
    return inner


class PiecewiseGraphs:
    """Per capture size S: one graph per segment over the static buffers [:S]."""

    def __init__(
        self,
        model: nn.Module,
        capture_sizes: list[int],
        input_ids: torch.Tensor,  # int32 [>= max size]: the runner's persistent device buffer
        positions: torch.Tensor,  # int64 [>= max size]: the runner's persistent device buffer
        slot_mapping: torch.Tensor,  # int64 [>= max size]: the runner's persistent device buffer
        dtype: torch.dtype,
    ) -> None:
        if not capture_sizes:
            raise ValueError("PiecewiseGraphs needs at least one capture size")
        self.model = split_model(model)
        self.capture_sizes = sorted(capture_sizes)
        max_size = self.capture_sizes[-1]
        held = min(input_ids.shape[0], positions.shape[0], slot_mapping.shape[0])
        if held < max_size:
            raise ValueError(
                f"input buffers hold {held} tokens, the largest piecewise capture size is "
                f"{max_size}"
            )
        assert slot_mapping.dtype == torch.int64, slot_mapping.dtype
        self.input_ids, self.positions, self.slot_mapping = input_ids, positions, slot_mapping
        self.num_layers = self.model.num_segments - 1
        device = input_ids.device
        q_size, kv_size = self._attention_widths()
        hidden_size = self.model.norm.weight.shape[0]

        def buf(width: int) -> torch.Tensor:
            # Zeros, not empty: a warm-up must not feed NaN/inf into Triton JIT runs.
            return torch.zeros(max_size, width, dtype=dtype, device=device)

        self.q, self.k, self.v = buf(q_size), buf(kv_size), buf(kv_size)
        self.attn_output = buf(q_size)
        self.residual, self.hidden_states = buf(hidden_size), buf(hidden_size)
        self.graphs: dict[int, list[Replayable]] = {}
        self._views: dict[int, _Views] = {}

    def _attention_widths(self) -> tuple[int, int]:
        widths = {(layer.self_attn.q_size, layer.self_attn.kv_size) for layer in self.model.layers}
        if len(widths) > 1:
            raise ValueError(f"layers with different attention shapes {sorted(widths)}")
        return widths.pop() if widths else (0, 0)  # no layers: no attention buffers

    def __contains__(self, num_tokens: int) -> bool:
        return num_tokens in self.graphs

    # ---- capture ------------------------------------------------------------------------
    def capture(self, pool: Any, label: str) -> None:
        """Largest size first (its temporaries size the pool; smaller sizes reuse them).
        Each segment runs eagerly once before its capture: Triton JIT and allocator
        warm-up stay outside the graph. `pool`: the memory pool to share (None: a new
        one per graph); `label` names the runner in the log line."""
        on_cuda = self.input_ids.is_cuda
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0] if on_cuda else 0
        # Capture happens at start-up, before any step: zero inputs keep the warm-up
        # runs in range (token 0, position 0) whatever the buffers held, and PAD slots
        # keep them (and the recording) from writing KV.
        self.input_ids[: self.capture_sizes[-1]].zero_()
        self.positions[: self.capture_sizes[-1]].zero_()
        self.slot_mapping[: self.capture_sizes[-1]].fill_(PAD_SLOT_ID)
        with no_gc_during_capture():
            for size in reversed(self.capture_sizes):
                self._views[size] = self._make_views(size)
                graphs = []
                for index in range(self.model.num_segments):
                    body = partial(self._segment, index, self._views[size])
                    with torch.no_grad():
                        body()
                        graphs.append(self._record(body, pool))
                self.graphs[size] = graphs
        if on_cuda:
            torch.cuda.synchronize()
            logger.info(
                "%s captured %d PIECEWISE graphs (%d segments x sizes %d..%d) in %.2f s, "
                "%.1f MB of graph memory", label,
                sum(len(g) for g in self.graphs.values()), self.model.num_segments,
                self.capture_sizes[0], self.capture_sizes[-1], time.perf_counter() - start,
                (free_before - torch.cuda.mem_get_info()[0]) / 1e6,
            )

    def _record(self, body: Callable[[], None], pool: Any) -> Replayable:
        """Capture `body` in a CUDA graph (tests on CPU override this with an eager
        stand-in that re-runs `body` on replay)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            body()
        return graph

    def _make_views(self, size: int) -> _Views:
        return _Views(
            self.input_ids[:size], self.positions[:size], self.slot_mapping[:size],
            self.q[:size], self.k[:size],
            self.v[:size], self.attn_output[:size], self.residual[:size],
            self.hidden_states[:size],
        )

    def _segment(self, index: int, views: _Views) -> None:
        """The captured body of one segment: read the static views, run the segment,
        copy its results into the static views (so nothing the graph allocated outlives
        it: its temporaries may share the pool with every other graph), and store the
        next attention's K/V at the persistent slot mapping."""
        out = self.model.forward_segment(
            index, views.input_ids, views.positions, views.attn_output, views.residual
        )
        if index == self.num_layers:
            views.hidden_states.copy_(out)
            return
        q, k, v, residual = out
        views.q.copy_(q)
        views.k.copy_(k)
        views.v.copy_(v)
        views.residual.copy_(residual)
        self.model.write_kv(index, views.k, views.v, views.slot_mapping)

    # ---- run ----------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One forward of S = input_ids.shape[0] tokens (a captured size). The inputs
        must be the persistent buffers' views [:S] that prepare_inputs just filled: the
        graphs read those addresses, not the arguments. Attention metadata comes from
        the forward context. -> hidden states [S, hidden], a view of a static buffer
        (valid until the next forward)."""
        size = input_ids.shape[0]
        views = self._views[size]
        assert input_ids.data_ptr() == views.input_ids.data_ptr(), "not the persistent input_ids"
        assert positions.data_ptr() == views.positions.data_ptr(), "not the persistent positions"
        self._check_slot_mapping()
        graphs = self.graphs[size]
        graphs[0].replay()
        for index in range(self.num_layers):
            # Eager: paged attention for the real requests over the KV the segment just
            # wrote; the padded rows of its output are left unwritten.
            self.model.attend(index, views.q, views.attn_output)
            graphs[index + 1].replay()
        return views.hidden_states

    def _check_slot_mapping(self) -> None:
        """The recorded KV writes read the persistent slot mapping: the step's metadata
        must describe that buffer, or its tokens' K/V would land in the wrong slots."""
        ctx = get_forward_context()
        if ctx is None or not ctx.attn_metadata or not self.num_layers:
            return
        metadata = next(iter(ctx.attn_metadata.values()))
        slots = getattr(metadata, "common", metadata).slot_mapping
        assert slots.data_ptr() == self.slot_mapping.data_ptr(), (
            "the step's slot_mapping is not the persistent buffer the graphs write through")
