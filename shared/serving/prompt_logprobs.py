"""A request's prompt logprobs on the engine side: one slot per prompt position, filled
from the runners' per-step slices (ModelRunnerOutput.prompt_logprobs) and turned into
RequestOutput.prompt_logprobs.

A slot may be written more than once: a preempted request, or every request after a
failed step, recomputes its prompt (it takes no prefix-cache hits,
KVCacheManager.get_computed_blocks) and writes the same values again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from shared.contract.outputs import PositionLogprobs, make_position_logprobs
from shared.contract.step import PromptLogprobs

if TYPE_CHECKING:  # request.py imports this module
    from shared.serving.request import Request

# One prompt position: (the prompt token then the top-k ids, their logprobs, the prompt
# token's rank).
_Row = tuple[list[int], list[float], int]


class PromptLogprobsStore:
    """Slots for positions 0 .. prompt_len - 1; position 0 stays None (nothing predicts
    it). The built output is cached until the next write: a streaming engine asks for
    it every step."""

    def __init__(self, prompt_len: int):
        self.rows: list[_Row | None] = [None] * prompt_len
        self._built: list[PositionLogprobs | None] | None = None

    def write(self, plp: PromptLogprobs) -> None:
        end = plp.start + len(plp.ranks)
        if plp.start < 1 or end > len(self.rows):
            raise ValueError(
                f"prompt logprobs for positions [{plp.start}, {end}) outside the prompt's "
                f"[1, {len(self.rows)})")
        self.rows[plp.start : end] = zip(plp.token_ids, plp.logprobs, plp.ranks)
        self._built = None

    def build(self, decode: Callable[[int], str] | None) -> list[PositionLogprobs | None]:
        """One entry per prompt position (None for position 0, and for positions not
        computed yet: a request aborted mid-prefill)."""
        if self._built is None:
            self._built = [None if row is None else make_position_logprobs(*row, decode)
                           for row in self.rows]
        return list(self._built)


def record_prompt_logprobs(
    scheduled: Mapping[str, Request], prompt_logprobs: Mapping[str, PromptLogprobs]
) -> None:
    """Store a step's prompt logprobs (runner_output.prompt_logprobs) in the requests
    that step scheduled, by object: a request finished or aborted since ignores its
    late output (its id may belong to a resubmitted request by now)."""
    for req_id, plp in prompt_logprobs.items():
        request = scheduled.get(req_id)
        if request is None or request.is_finished or request.prompt_logprobs is None:
            continue
        request.prompt_logprobs.write(plp)


def prompt_logprobs_output(request: Request, tokenizer: Any) -> list[PositionLogprobs | None] | None:
    """RequestOutput.prompt_logprobs: None unless the request asked for them; each token's
    text is tokenizer.decode([id]) when the engine has a tokenizer."""
    if request.prompt_logprobs is None:
        return None
    decode = None if tokenizer is None else (lambda token: tokenizer.decode([token]))
    return request.prompt_logprobs.build(decode)
