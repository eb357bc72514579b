"""Incremental detokenization with stop-string matching (vLLM's semantics).

Each output token is decoded with the prefix / read-offset method: decode a short window
of ids ending at the new one and emit only what it adds to the window's already-emitted
part. Text stays held back while the window ends in U+FFFD, the mark of a UTF-8 sequence
split over tokens, so a multibyte character appears once it is complete. The prompt's last
ids seed the window, so the first output token is decoded in context (a SentencePiece
decoder strips the leading space of a sequence's first token, not of a token after one).

Stop strings are searched on the output text only (never the prompt), in the text a token
produced plus the len(stop) - 1 characters before it, so a stop string split over tokens
is found at the token that completes it. Every call decodes a bounded window and searches
a bounded tail: O(new tokens), whatever the output length.
"""

from __future__ import annotations

from typing import Any

from shared.contract.sampling_params import SamplingParams

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt ids of context before the first
# output token, and two more read in case some are special tokens that decode to nothing.
_PROMPT_CONTEXT = 5
_PROMPT_TAIL = _PROMPT_CONTEXT + 2

# Held-back ids past the read offset before the window is cut at a stable point. A UTF-8
# character spans at most 4 tokens, so only a run of invalid bytes reaches it; without the
# cut the window would grow with the output. Skipped special tokens never enter it.
_MAX_HELD = 8
_UTF8_MAX_BYTES = 4

_REPLACEMENT = "\ufffd"


class StopStringMatchedError(RuntimeError):
    """append() was called after a stop string ended the request."""


class IncrementalDetokenizer:
    """One request's output text, one token at a time.

    output_text equals tokenizer.decode(output_ids, skip_special_tokens=...) except where
    decode differs from decoding the ids in context, and except for the held-back tail:
    text of the last ids while it ends in U+FFFD (an incomplete UTF-8 sequence, or a
    genuine trailing U+FFFD) is emitted only once a later token completes it.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._vocab_size = len(tokenizer)
        # Special ids that may be skipped; each is checked against decode on first sight.
        self._special_ids = _special_ids(tokenizer) if self._skip_special else frozenset()
        self._skipped: dict[int, bool] = {}
        stop = params.stop
        self._stops: list[str] = [stop] if isinstance(stop, str) else list(stop or ())
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # The window: ids[prefix:read] were emitted last (context), ids[read:] are held.
        self._ids = [int(t) for t in prompt_token_ids[-_PROMPT_TAIL:] if self._decodable(t)]
        self._num_tokens = 0
        self._read = len(self._ids)
        self._prefix = max(self._read - _PROMPT_CONTEXT, 0)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached
        # Text as chunks (no O(length) copy per token) and the tail a stop string
        # completed by the next token can start in.
        self._chunks: list[str] = []
        self._num_chars = 0
        self._tail_len = max((len(s) for s in self._stops), default=1) - 1
        self._tail = ""
        self._stop_reason: str | None = None
        # Streaming: text not yet returned by new_text_since_last_call. A stop string
        # excluded from the output could still start in the last stop_buffer_length
        # characters, so those are not streamed until the request finishes.
        self._unstreamed: list[str] = []
        self.stop_buffer_length = self._tail_len if self._stops and not self._include_stop else 0

    # ---- public ---------------------------------------------------------------------

    def append(self, token_id: int) -> str | None:
        """Add one output token; returns the stop string it completed (the request must
        stop at this token), else None."""
        if self._stop_reason is not None:
            raise StopStringMatchedError(
                f"append({token_id}) after the stop string {self._stop_reason!r} ended the "
                "request; its output is final"
            )
        token_id = int(token_id)  # a NumPy scalar from a runner's output
        self._num_tokens += 1
        delta = self._decode_next(token_id) if self._decodable(token_id) else ""
        if not delta:
            return None
        first_new = len(self._tail)  # where delta starts in window
        window = self._tail + delta
        window_start = self._num_chars - first_new  # window[0]'s index in the text
        self._chunks.append(delta)
        self._num_chars += len(delta)
        self._unstreamed.append(delta)
        self._tail = window[-self._tail_len:] if self._tail_len else ""
        # vLLM: no stop string ends a request within its first min_tokens tokens.
        if self._stops and self._num_tokens > self._min_tokens:
            self._check_stop(window, first_new, window_start)
        return self._stop_reason

    @property
    def output_text(self) -> str:
        """The text so far: on a stop string, cut before it (or just after it with
        include_stop_str_in_output)."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def final_text(self) -> str:
        """The text of a finished request: output_text plus the held tail, decoded as it
        stands (an incomplete UTF-8 sequence the request ended in shows as U+FFFD, as a
        whole decode shows it). After a stop string, output_text as cut."""
        text = self.output_text
        if self._stop_reason is not None or len(self._ids) <= self._read:
            return text
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        return text + window[len(prefix_text):] if window.startswith(prefix_text) else text

    def decode_whole(self, token_ids: list[int]) -> str:
        """What final_text() would be after append() of every id (no stop strings), in two
        decodes rather than one a token: the output decoded in the prompt's context, as
        the incremental text is. So a FINAL_ONLY request, decoded once at its finish, has
        the text its CUMULATIVE twin streams (a SentencePiece decoder would strip a leading
        space from the output decoded alone). Call it on a fresh detokenizer."""
        if self._num_tokens or self._stops:
            raise RuntimeError("decode_whole needs a fresh detokenizer without stop strings")
        ids = self._ids + [t for t in map(int, token_ids) if self._decodable(t)]
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(ids[self._prefix:])
        if text.startswith(prefix_text):
            return text[len(prefix_text):]
        # The output changed the context's text: the prompt ended inside a character
        # that the output completes. The incremental rule decides what that shows as.
        for token_id in token_ids:
            self.append(token_id)
        return self.final_text()

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the request, if one did."""
        return self._stop_reason

    def new_text_since_last_call(self, finished: bool = False) -> str:
        """Text added since the previous call, for streaming. Until the request finishes
        (finished=True, or a stop string matched) the last stop_buffer_length characters
        are held back: a stop string excluded from the output may be starting there."""
        keep = 0 if finished or self._stop_reason is not None else self.stop_buffer_length
        pending = "".join(self._unstreamed)
        cut = max(len(pending) - keep, 0)
        self._unstreamed[:] = [pending[cut:]] if cut < len(pending) else []
        return pending[:cut]

    # ---- decoding -------------------------------------------------------------------

    def _decodable(self, token_id: int) -> bool:
        """Whether the id adds anything to the text. vLLM: an id outside the vocabulary
        (a padded lm_head row) decodes to nothing. A skipped special token decodes to
        nothing too; kept out of the window, a run of them (an ignore_eos request) costs
        nothing, and cannot grow the window behind an incomplete character."""
        if not 0 <= token_id < self._vocab_size:
            return False
        if token_id not in self._special_ids:
            return True
        skipped = self._skipped.get(token_id)
        if skipped is None:
            skipped = self._skipped[token_id] = self._decode([token_id]) == ""
        return not skipped

    def _decode(self, ids: list[int]) -> str:
        # No clean-up: it rewrites " ." and the like across the window's edges, so a
        # window's text would stop being a prefix of the next one's.
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)

    def _decode_next(self, token_id: int) -> str:
        """The text token_id completes: the window's new suffix, or "" while held."""
        self._ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        prefix_text = self._prefix_text
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(prefix_text) and not text.endswith(_REPLACEMENT):
            return self._advance(len(self._ids), text[len(prefix_text):])
        if len(self._ids) - self._read > _MAX_HELD:
            return self._release_held(prefix_text, text)
        return ""

    def _release_held(self, prefix_text: str, text: str) -> str:
        """Emit the held ids up to the last point whose text no later byte can change.
        The text of ids[prefix:cut] is stable when it ends in a complete character, or
        in U+FFFD that the window's later bytes already show is not the start of a
        character still being completed (the window's text extends it). Every id in the
        window adds a byte or more, so one of the last 4 cuts is stable: it is before the
        token holding the lead byte of the last incomplete sequence, or after its fate."""
        last = max(self._read, len(self._ids) - 1 - _UTF8_MAX_BYTES)
        for cut in range(len(self._ids) - 1, last, -1):
            head = self._decode(self._ids[self._prefix:cut])
            stable = not head.endswith(_REPLACEMENT) or (
                len(text) > len(head) and text.startswith(head))
            if stable and head.startswith(prefix_text):
                return self._advance(cut, head[len(prefix_text):])
        return ""

    def _advance(self, read: int, delta: str) -> str:
        """ids[:read] are emitted: the last emitted ids become the context."""
        self._prefix, self._read = self._read, read
        del self._ids[:self._prefix]  # older ids are never decoded again
        self._read -= self._prefix
        self._prefix = 0
        self._prefix_text = None
        return delta

    # ---- stop strings ---------------------------------------------------------------

    def _check_stop(self, window: str, first_new: int, window_start: int) -> None:
        """Find a stop string ending in the new text, window[first_new:] (window[0] is
        the text's character window_start). The one that ends first wins (the one a
        finer tokenisation would have hit first); on a tie, the one that starts first."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            i = window.find(stop, max(first_new - len(stop) + 1, 0))
            if i != -1 and (best is None or (i + len(stop), i) < best[:2]):
                best = (i + len(stop), i, stop)
        if best is None:
            return
        end, start, stop = best
        keep = window_start + (end if self._include_stop else start)
        self._truncate(keep)
        self._stop_reason = stop

    def _truncate(self, num_chars: int) -> None:
        cut = self._num_chars - num_chars
        if cut:
            self._chunks[:] = ["".join(self._chunks)[:num_chars]]
            # Nothing cut was streamed: a match starts at most stop_buffer_length
            # characters before this token's text, and those were held back.
            pending = "".join(self._unstreamed)
            self._unstreamed[:] = [pending[:max(len(pending) - cut, 0)]]
            self._num_chars = num_chars


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One token's own text, for Logprob.decoded_token (vLLM's: special tokens kept, an
    incomplete UTF-8 piece as U+FFFD, "" for an id outside the vocabulary)."""
    if not 0 <= token_id < len(tokenizer):
        return ""
    return tokenizer.decode([int(token_id)]) or ""


def _special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids skip_special_tokens may drop: the added tokens marked special (the tokenizers
    library skips these) and all_special_ids (transformers' Python tokenizers do)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, t in added.items() if getattr(t, "special", False))
    return frozenset(ids)
