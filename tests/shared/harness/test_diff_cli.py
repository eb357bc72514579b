"""`runnerlab diff`: the JSON document, the exit status, and that a broken runner is
caught and located; plus the comparison rules and event counting on hand-made records."""

from __future__ import annotations

import json

import pytest

import shared.serving.engine
from runner_v2.model_runner import GPUModelRunner as V2Runner
from shared.harness.cli import main as cli_main
from shared.harness.compare import compare_runs
from shared.harness.scenario_run import RequestRecord, ScenarioRun, StepEvent

PAIR_FIELDS = {"a", "b", "identical", "first_divergence", "max_logprob_diff"}


def test_quick_json_documents_agreement(capsys):
    rc = cli_main(["diff", "--quick", "--json"])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert rc == 0, captured.err
    assert doc["all_agree"] is True
    assert doc["scenarios"], "no scenario ran"
    for s in doc["scenarios"]:
        assert {"name", "engines", "pairs"} <= s.keys()
        assert {"v1", "v2"} <= set(s["engines"])
        pairs = {(p["a"], p["b"]) for p in s["pairs"]}
        assert ("v1", "v2") in pairs
        if s["greedy"]:
            assert ("v1", "hf") in pairs and ("v2", "hf") in pairs
        for p in s["pairs"]:
            assert PAIR_FIELDS <= p.keys()
            assert p["identical"] is True and p["first_divergence"] is None


class TokenSwappingRunner(V2Runner):
    """V2 with one bug: at its third sampling step it reports a wrong token for the first
    request of the batch (the device state keeps the right one). Records where."""

    corrupted: list[tuple[str, int]] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._num_samples = 0
        self._num_tokens: dict[str, int] = {}

    def sample_tokens(self, grammar_output=None):
        out = super().sample_tokens(grammar_output)
        if hasattr(out, "get_output"):
            out = out.get_output()
        self._num_samples += 1
        for i, req_id in enumerate(out.req_ids):
            if not out.sampled_token_ids[i]:
                continue
            position = self._num_tokens.get(req_id, 0)
            self._num_tokens[req_id] = position + 1
            if self._num_samples == 3 and not type(self).corrupted:
                token = out.sampled_token_ids[i][0]
                out.sampled_token_ids[i] = [(token + 1) % 512]
                type(self).corrupted.append((req_id, position))
        return out


def test_a_broken_runner_makes_diff_fail_and_locates_it(monkeypatch, capsys):
    real = shared.serving.engine.resolve_runner_class

    def resolve(path: str) -> type:
        return TokenSwappingRunner if path.startswith("runner_v2.") else real(path)

    monkeypatch.setattr(shared.serving.engine, "resolve_runner_class", resolve)
    TokenSwappingRunner.corrupted = []
    rc = cli_main(["diff", "--scenarios", "greedy_logprobs", "--engines", "v1,v2", "--json"])
    captured = capsys.readouterr()
    assert rc == 1
    [(req_id, position)] = TokenSwappingRunner.corrupted
    doc = json.loads(captured.out)
    assert doc["all_agree"] is False
    [pair] = doc["scenarios"][0]["pairs"]
    assert pair["identical"] is False
    assert pair["first_divergence"] == {"request_id": req_id, "position": position}
    assert "greedy_logprobs" in captured.err
    assert f"request {req_id!r} position {position}" in captured.err


@pytest.mark.parametrize("argv", [
    ["--scenarios", "no_such_scenario"], ["--engines", "hf"], ["--engines", "v1,v3"],
    ["--seeds", "x"], ["--dtype", "int8"], ["--model", "/no/such/dir"],
])
def test_usage_errors_exit_2(argv, capsys):
    assert cli_main(["diff", *argv]) == 2


# ---------------------------------------------------------------- comparison rules


def rec(tokens, finish="length", logprobs=None):
    return RequestRecord(list(tokens), logprobs, finish)


def test_runner_pair_reports_first_token_divergence():
    a = {"x": rec([1, 2, 3]), "y": rec([4, 5, 6])}
    b = {"x": rec([1, 2, 3]), "y": rec([4, 9, 6])}
    report = compare_runs("v1", a, "v2", b, 1e-9, reference=False)
    assert not report.identical and not report.agrees
    assert (report.first_divergence.request_id, report.first_divergence.position) == ("y", 1)


def test_runner_pair_needs_equal_finish_reasons_and_labels():
    report = compare_runs("v1", {"x": rec([1, 2])}, "v2", {"x": rec([1, 2], "stop")}, 1e-9, False)
    assert not report.identical and report.first_divergence.position == 1
    report = compare_runs("v1", {"x": rec([1])}, "v2", {}, 1e-9, False)
    assert not report.identical and report.first_divergence.request_id == "x"


def test_reference_pair_compares_aborted_requests_by_prefix():
    batch = {"x": rec([1, 2], "abort"), "y": rec([3, 4, 5])}
    solo = {"x": rec([1, 2, 7, 8]), "y": rec([3, 4, 5])}
    assert compare_runs("v1", batch, "solo", solo, 1e-9, reference=True).agrees
    solo["x"] = rec([1, 6, 7, 8])
    assert compare_runs("v1", batch, "solo", solo, 1e-9, reference=True).first_divergence.position == 1


def test_async_pair_allows_only_the_in_flight_token_of_an_abort():
    sync = {"x": rec([1, 2, 3], "abort"), "y": rec([4, 5])}
    late = {"x": rec([1, 2], "abort"), "y": rec([4, 5])}
    assert compare_runs("v1", sync, "v2-async", late, 1e-9, False, in_flight=True).agrees
    assert not compare_runs("v1", sync, "v2", late, 1e-9, False).agrees  # sync pairs: exact
    late["x"] = rec([1], "abort")  # two tokens short: more than the one in flight
    assert not compare_runs("v1", sync, "v2-async", late, 1e-9, False, in_flight=True).agrees
    late["x"], late["y"] = rec([1, 2], "abort"), rec([4])  # y ended on its own: exact
    assert not compare_runs("v1", sync, "v2-async", late, 1e-9, False, in_flight=True).agrees


def test_quick_diff_with_async_v2_agrees(capsys):
    assert cli_main(["diff", "--quick", "--engines", "v1,v2-async", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["all_agree"] and doc["engines"] == ["v1", "v2-async"]
    assert all(s["engines"] == ["v1", "v2-async"] for s in doc["scenarios"])


def test_logprob_tolerance_and_top_ids():
    a = {"x": rec([5], logprobs=[{5: -1.0, 7: -2.0}])}
    b = {"x": rec([5], logprobs=[{5: -1.0 + 1e-6, 7: -2.0}])}
    report = compare_runs("v1", a, "v2", b, 1e-9, reference=False)
    assert report.identical and not report.agrees
    assert report.max_logprob_diff == pytest.approx(1e-6)
    b = {"x": rec([5], logprobs=[{5: -1.0, 8: -2.0}])}  # different top ids
    assert not compare_runs("v1", a, "v2", b, 1e-9, reference=False).agrees
    hf = {"x": rec([5], None, logprobs=[{5: -1.0 + 1e-7}])}  # hf: the sampled token only
    assert compare_runs("v1", a, "hf", hf, 1e-5, reference=True).agrees


def step(num_tokens, finished=(), num_reqs=1, decodes=0, **kw):
    fields = dict(num_new=0, preempted=(), resumed=0, prefix_hits=0, partial_prefills=0,
                  resubmitted=0)
    fields.update(kw)
    return StepEvent(num_reqs=num_reqs, num_tokens=num_tokens, finished=tuple(finished),
                     decodes=decodes, **fields)


def test_zero_token_step_counts_only_when_work_follows():
    trailing = ScenarioRun({}, [step(3), step(0, ["a"], num_reqs=0)], 0, 0)
    assert trailing.events()["zero_token_step"] == 0
    assert trailing.missing_events(("zero_token_step",)) == ["zero_token_step"]
    middle = ScenarioRun({}, [step(3), step(0, ["a"], num_reqs=0), step(4, num_new=1)], 0, 0)
    assert middle.events()["zero_token_step"] == 1


def test_decode_batch_shrink_needs_uniform_decode():
    run = ScenarioRun({}, [step(4, num_reqs=4, decodes=4), step(3, num_reqs=2, decodes=1)], 0, 0)
    assert run.events()["decode_batch_shrink"] == 0
    run = ScenarioRun({}, [step(4, num_reqs=4, decodes=4), step(2, num_reqs=2, decodes=2)], 0, 0)
    assert run.events()["decode_batch_shrink"] == 1
