"""What a request's next output adds to what was sent: the engine's DELTA outputs
(SamplingParams.output_kind), which the server's streams send as they come.

The engine's text is the output text so far (grown by the incremental detokenizer), so
the new text is a suffix of it; two kinds of suffix are held back until a later step
settles them: an incomplete UTF-8 character at the end (shown as U+FFFD by a whole
decode; the incremental detokenizer holds it itself) and, with stop strings excluded
from the output, the last len(stop) - 1 characters (a stop string may be starting there,
and the finished text is cut before it). The pieces therefore concatenate to the final
text. Tokens are never held back: a token id is final once sampled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("runnerlab")

_REPLACEMENT = "\ufffd"


@dataclass
class OutputDelta:
    """What has been sent of one sequence's output (one per request or streamed choice)."""

    holdback: int = 0  # characters held while unfinished (max stop length - 1)
    sent_text: str = ""
    sent_tokens: int = 0

    def advance(self, text: str, num_tokens: int, finished: bool) -> tuple[str, int, int]:
        """`text`: the whole output text now, of `num_tokens` tokens. -> (new text, first
        new token index, end token index); marks them sent."""
        first, end = self.sent_tokens, num_tokens
        self.sent_tokens = end
        ready = text
        if not finished:
            # the partial character first: the held tail is counted in settled text
            ready = ready.rstrip(_REPLACEMENT)
            if self.holdback:
                ready = ready[:max(len(ready) - self.holdback, 0)]
        if not ready.startswith(self.sent_text):
            if not finished:
                return "", first, end  # not settled yet: the next step's text decides
            logger.warning("A request's final text does not extend its streamed text; the "
                           "stream sends the final text's remainder")
            common = _common_prefix_len(ready, self.sent_text)
            self.sent_text = ready
            return ready[common:], first, end
        delta = ready[len(self.sent_text):]
        if delta:
            self.sent_text = ready
        return delta, first, end


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def holdback_for(params: Any) -> int:
    """Characters an unfinished output holds back for `params`' stop strings."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1
