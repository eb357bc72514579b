"""Streamed deltas: concatenated, they are the final text, and no chunk ever shows text
the final answer does not have (a held-back stop-string prefix, a partial character)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.serving.output_delta import OutputDelta

_FFFD = "\ufffd"


def _run(snapshots: list[str], holdback: int) -> list[str]:
    delta = OutputDelta(holdback)
    sent = []
    for i, text in enumerate(snapshots):
        finished = i == len(snapshots) - 1
        piece, _, _ = delta.advance(text, i + 1, finished)
        sent.append(piece)
    return sent


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="ab c\u00e9", min_size=0, max_size=4), min_size=1,
                max_size=12), st.integers(0, 4), st.data())
def test_deltas_concatenate_to_the_final_text(pieces, holdback, data):
    """Snapshots grow by pieces; an unfinished one may end in a partial character (U+FFFD),
    and the final one may be cut (a stop string at its end removed)."""
    full = "".join(pieces)
    snapshots = []
    for i in range(1, len(pieces) + 1):
        text = "".join(pieces[:i])
        if i < len(pieces) and data.draw(st.booleans()):
            text += _FFFD
        snapshots.append(text)
    cut = data.draw(st.integers(0, min(holdback, len(full))))
    final = full[:len(full) - cut]
    snapshots[-1] = final
    sent = _run(snapshots, holdback)
    assert "".join(sent) == final
    # a chunk never shows the held tail or a replacement character
    shown = ""
    for piece, text in zip(sent[:-1], snapshots[:-1]):
        shown += piece
        assert _FFFD not in shown
        assert len(shown) <= max(len(text.rstrip(_FFFD)) - holdback, 0) or holdback == 0


def test_a_stop_string_prefix_is_held_until_the_answer_settles():
    # "The end" then the stop string "END" completed: "The end E" shown would be wrong
    sent = _run(["The end", "The end E", "The end EN", "The end "], holdback=2)
    assert sent == ["The e", "nd", " ", ""]
    assert "".join(sent) == "The end "
