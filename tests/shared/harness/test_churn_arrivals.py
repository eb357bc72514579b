"""churn's arrivals against a stand-in engine: top_up keeps `live` requests unfinished,
draws prompts and outputs from churn's ranges, and a seed gives the same arrivals."""

from __future__ import annotations

from shared.harness.workloads import CHURN_MAX_TOKENS, CHURN_PROMPT_LEN, ChurnArrivals


class _Engine:
    vocab_size = 50

    def __init__(self) -> None:
        self.requests: dict[str, tuple[list[int], int]] = {}
        self.finished: set[str] = set()

    def add_request(self, req_id, prompt, params) -> None:
        assert req_id not in self.requests
        self.requests[req_id] = (prompt, params.max_tokens)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests) - len(self.finished)


def _run(seed: int) -> list[tuple[list[int], int]]:
    engine = _Engine()
    arrivals = ChurnArrivals(engine, live=5, tag="c", seed=seed)
    for step in range(4):
        arrivals.top_up()
        assert engine.get_num_unfinished_requests() == 5
        engine.finished |= {f"c{i}" for i in range(step, 2 * step + 1)}  # some finish
    assert arrivals.added == len(engine.requests)
    return [engine.requests[f"c{i}"] for i in range(arrivals.added)]


def test_top_up_keeps_live_requests_from_churns_ranges() -> None:
    requests = _run(seed=2)
    assert len(requests) > 5  # finished ones were replaced
    for prompt, max_tokens in requests:
        assert CHURN_PROMPT_LEN[0] <= len(prompt) <= CHURN_PROMPT_LEN[1]
        assert CHURN_MAX_TOKENS[0] <= max_tokens <= CHURN_MAX_TOKENS[1]
        assert all(1 <= t < _Engine.vocab_size for t in prompt)


def test_the_seed_decides_the_arrivals() -> None:
    assert _run(seed=2) == _run(seed=2)
    assert _run(seed=2) != _run(seed=3)
