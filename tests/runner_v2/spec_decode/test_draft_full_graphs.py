"""V2's draft model with FULL graphs for its uniform forwards, on CPU with the eager
stand-ins (tests/shared/runtime/draft_graph_run.py): the tokens and the draft's KV of
the same engine without graphs, and the FULL graphs really replayed, for the
single-token drafts and the uniform catch-up, also over padded rows."""

from __future__ import annotations

from tests.shared.runtime.draft_graph_run import check_full_draft_graphs

K = 2
# a different random model: its drafts are mostly rejected, and V2 still feeds every
# drafted row k + 2 catch-up tokens (the tail past the accepted run writes no KV)
SPEC = {"method": "draft_model", "model": "tiny-llama-draft", "num_speculative_tokens": K}


def test_full_draft_graphs_give_the_eager_tokens_and_kv(monkeypatch):
    replays = check_full_draft_graphs("v2", SPEC, monkeypatch)
    # three rows drafting (padded to the graph of 4), one row alone, and the catch-up of
    # k + 2 tokens per row, padded and alone
    assert {(1, 4), (1, 1), (K + 2, 4), (K + 2, 1)} <= set(replays), replays
