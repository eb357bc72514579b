"""`runnerlab ab --workloads spec` on CPU with tiny-llama: the flags (every bad value one
line naming the flag, exit 2, before anything runs), a run of ngram k=2 (V1; V2 refused
by the policy) and draft_model k=2 (both) beside the baselines, whose entries are checked
against the run's own accounting (tokens = steps + accepted drafts), greedy tokens equal
to the baseline's, the table and the chart; the token comparison itself against made-up
mismatches."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest
import torch

from policy import features
from shared.harness import spec_args, spec_workload
from shared.harness.ab import ab_main
from shared.harness.chart import build_figure
from shared.harness.cli import main as cli_main
from shared.harness.spec_workload import token_checks

ON_CPU = not torch.cuda.is_available()
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
         "prompt_lookup_max": 2}
DRAFT = {"method": "draft_model", "model": "tiny-llama-draft", "num_speculative_tokens": 2}
MAX_TOKENS = 8
STAT_KEYS = ("output_tokens_per_s", "steps", "tokens_per_step", "output_tokens", "seconds")


def _run(out, *argv: str) -> tuple[int, dict, str]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = ab_main(["--quick", "--repeats", "1", "--output-dir", str(out), *argv])
    return rc, json.loads((out / "ab.json").read_text()), stdout.getvalue()


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory):
    """churn and spec in one run: the spec workload after the up-front engines are freed."""
    out = tmp_path_factory.mktemp("ab-spec")
    rc, report, text = _run(out, "--workloads", "churn,spec", "--spec-max-tokens",
                            str(MAX_TOKENS), "--spec-configs", json.dumps([NGRAM, DRAFT]))
    return rc, report, text


def _ran(entry: dict, runners=("v1", "v2")) -> list[str]:
    return [r for r in runners if "refused" not in entry[r] and "failed" not in entry[r]]


def test_spec_run_writes_an_entry_per_config_beside_the_baselines(spec_run) -> None:
    rc, report, text = spec_run
    assert rc == 0, text
    assert report["failures"] == []
    baseline, ngram, draft = report["workloads"]["spec"]
    assert [e["label"] for e in (baseline, ngram, draft)] == [
        "baseline", "ngram k=2 n=1..2", "draft_model k=2"]
    assert baseline["speculative_config"] is None
    assert ngram["speculative_config"] == {**NGRAM, "rejection_sample_method": "standard"}
    assert _ran(ngram) == ["v1"] and _ran(draft) == ["v1", "v2"]
    for entry in (ngram, draft):
        for runner in _ran(entry):
            stats, base = entry[runner], baseline[runner]
            for key in STAT_KEYS:
                assert stats[key]["n"] == 1, key  # --repeats 1, the warm-up excluded
            assert {"median", "p90"} <= set(stats["wall_ms"])
            assert ("forward_gpu_ms" in stats) == (not ON_CPU)
            tps, base_tps = (s["output_tokens_per_s"]["median"] for s in (stats, base))
            assert stats["speedup"] == pytest.approx(tps / base_tps)
            assert stats["baseline_output_tokens_per_s"] == base_tps
            assert stats["baseline_forward_gpu_ms"] == base.get("forward_gpu_ms", {}).get("median")
            assert stats["engine"]["kv_blocks"] > 0 and stats["engine"]["startup_s"] > 0
            assert set(stats["acceptance"]) == {
                "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                "mean_acceptance_length", "acceptance_rate_per_position"}
    assert "acceptance" not in baseline["v1"]
    # the churn workload ran first, under the run's own loop; spec says it ran sync
    assert "churn" in report["workloads"]
    assert report["settings"]["spec"]["engine_loop"] == "sync"
    if report["engine_loops"] != ["sync"]:
        assert any("spec workload's engines" in w for w in report["warnings"])


def test_spec_counts_add_up(spec_run) -> None:
    """Every step emits 1 + its accepted drafts per request, the prefill step one token:
    output tokens = steps + accepted drafts (batch 1, a one-step prefill)."""
    _, report, _ = spec_run
    baseline, *configs = report["workloads"]["spec"]
    for runner in ("v1", "v2"):
        base = baseline[runner]
        assert base["output_tokens"]["median"] == MAX_TOKENS
        assert base["steps"]["median"] == MAX_TOKENS
        assert base["tokens_per_step"]["median"] == 1.0
    for entry in configs:
        for runner in _ran(entry):
            stats, acc = entry[runner], entry[runner]["acceptance"]
            out, steps = stats["output_tokens"]["median"], stats["steps"]["median"]
            assert stats["prefill_steps"]["median"] == 1
            assert out == MAX_TOKENS
            assert out == steps + acc["num_accepted_tokens"]
            assert stats["tokens_per_step"]["median"] == pytest.approx(out / steps)
            assert acc["num_drafts"] <= steps - 1
            assert acc["num_draft_tokens"] <= 2 * acc["num_drafts"]
            if acc["num_draft_tokens"]:
                assert acc["acceptance_rate"] == pytest.approx(
                    acc["num_accepted_tokens"] / acc["num_draft_tokens"])
            rates = acc["acceptance_rate_per_position"]
            assert rates == sorted(rates, reverse=True)  # position i needs i - 1 accepted


def test_greedy_speculation_keeps_the_baseline_tokens(spec_run) -> None:
    _, report, _ = spec_run
    baseline, ngram, draft = report["workloads"]["spec"]
    assert baseline["token_checks"]["v1_vs_v2"] is True
    assert ngram["token_checks"] == {"runs": {"v1": True}, "vs_baseline": {"v1": True},
                                     "v1_vs_v2": None}
    assert draft["token_checks"] == {"runs": {"v1": True, "v2": True},
                                     "vs_baseline": {"v1": True, "v2": True}, "v1_vs_v2": True}
    assert all(e["tokens_identical"] and e["mismatches"] == [] for e in (baseline, ngram, draft))
    assert report["tokens_identical"] is True


def test_ngram_on_v2_is_refused_not_a_crash(spec_run) -> None:
    _, report, text = spec_run
    ngram = report["workloads"]["spec"][1]
    refusal = ngram["v2"]["refused"]
    assert refusal.startswith("Model runner V2") and "ngram" in refusal and "\n" not in refusal
    assert "v2" not in ngram["run_s"]
    assert f"V2 refused: {refusal}" in text
    assert "== spec, sync loop ==" in text


def test_the_chart_draws_each_configs_speedup(spec_run) -> None:
    _, report, _ = spec_run
    fig = build_figure(report)
    spec_ax = next(ax for ax in fig.axes if ax.get_title() == "spec")
    assert len(spec_ax.patches) == 3  # ngram V1, draft V1 and V2; V2's ngram a note
    assert any(t.get_text() == "V2 refused" for t in spec_ax.texts)
    heights = sorted(p.get_height() for p in spec_ax.patches)
    entries = report["workloads"]["spec"][1:]
    assert heights == pytest.approx(sorted(e[r]["speedup"] for e in entries for r in _ran(e)))


def test_spec_alone_sampled_on_one_runner(tmp_path) -> None:
    """Spec alone: the report's head from the baseline engines (sync); sampled tokens are
    not compared with the baseline's, but every run draws the same (seeded)."""
    rc, report, text = _run(tmp_path, "--runners", "v1", "--workloads", "spec",
                            "--spec-temperature", "0.8", "--spec-max-tokens", "6",
                            "--spec-configs", json.dumps(NGRAM), "--repeats", "2")
    assert rc == 0, text
    assert report["engine_loops"] == ["sync"] and list(report["engines"]) == ["v1"]
    baseline, ngram = report["workloads"]["spec"]
    assert ngram["token_checks"] == {"runs": {"v1": True}, "vs_baseline": {"v1": None},
                                     "v1_vs_v2": None}
    assert ngram["v1"]["steps"]["n"] == 2 and len(ngram["run_s"]["v1"]) == 2
    assert "temperature 0.8, seeded" in text


def test_spec_alone_on_v2_runs_the_async_loop(tmp_path) -> None:
    """V2 has async scheduling with speculative decoding (policy.features): alone, its
    spec engines and baselines run async, and greedy drafts still keep the tokens."""
    row = spec_args.ASYNC_SPEC_FEATURE.format("draft_model")
    assert features.feature(row).status("v2") == features.SUPPORTED
    rc, report, text = _run(tmp_path, "--runners", "v2", "--workloads", "spec",
                            "--spec-max-tokens", "6", "--spec-configs",
                            json.dumps({**DRAFT, "num_speculative_tokens": 1}))
    assert rc == 0, text
    assert report["engine_loops"] == ["async"] and report["engines"]["v2"]["engine_loop"] == "async"
    baseline, draft = report["workloads"]["spec"]
    assert draft["engine_loop"] == "async" and report["async_scheduling"] == {"v2": True}
    assert draft["token_checks"]["vs_baseline"] == {"v2": True}
    assert draft["v2"]["output_tokens"]["median"] == 6 and "== spec, async loop ==" in text


@pytest.fixture
def spec_async(request, monkeypatch):
    """The feature table with the runners' async-with-speculation statuses set by the
    parameter: the runners that have it."""
    able = request.param
    row = spec_args.ASYNC_SPEC_FEATURE.format("draft_model")
    table = tuple(f if f.label != row else dataclasses.replace(
        f, v1=features.SUPPORTED if "v1" in able else features.UNSUPPORTED,
        v2=features.SUPPORTED if "v2" in able else features.UNSUPPORTED)
        for f in features.FEATURES)
    monkeypatch.setattr(features, "FEATURES", table)
    return able


@pytest.mark.parametrize("spec_async", [(), ("v2",), ("v1", "v2")], indirect=True)
def test_the_spec_loop_is_async_only_where_every_runner_has_it(spec_async) -> None:
    loop = spec_args.spec_engine_loop
    for runners in (["v1"], ["v2"], ["v1", "v2"]):
        able = all(r in spec_async for r in runners)
        default = loop(None, runners, alone=True)
        assert default.loop == ("async" if able else "sync") and default.refusal is None
        assert (default.note is None) == able
        if not able:
            assert "cannot run async scheduling with speculative decoding" in default.note
        assert loop("sync", runners, alone=True) == spec_args.SpecLoop("sync")
        asked = loop("async", runners, alone=False)
        assert (asked.loop, asked.refusal is None) == (("async", True) if able else (None, False))
        assert loop("both", runners, alone=True).refusal.startswith("--engine-loop both")
        assert loop("both", runners, alone=False).loop == "sync"


def test_a_failing_spec_engine_is_an_entry_and_the_run_goes_on(tmp_path, monkeypatch) -> None:
    real = spec_workload._build

    def build(args, settings, runner, config):
        if runner == "v2" and config is not None:
            raise RuntimeError("at 52:8:\n  if x:\n  ^\nAssertionError('the kernel')")
        return real(args, settings, runner, config)

    monkeypatch.setattr(spec_workload, "_build", build)
    rc, report, text = _run(tmp_path, "--workloads", "spec", "--spec-max-tokens", "4",
                            "--spec-configs", json.dumps({**DRAFT, "num_speculative_tokens": 1}))
    assert rc == 1  # a failure fails the run, after writing everything else
    baseline, draft = report["workloads"]["spec"]
    failed = "RuntimeError: at 52:8: ... AssertionError('the kernel')"
    assert draft["v2"] == {"failed": failed} and "speedup" in draft["v1"]
    assert report["failures"] == [f"V2 draft_model k=1: {failed}"]
    assert f"V2 failed: {failed}" in text


def test_token_checks_report_mismatches() -> None:
    base = {"v1": [{"0": [1, 2, 3, 4], "1": [5, 6]}], "v2": [{"0": [1, 2, 3, 4], "1": [5, 6]}]}
    same = {"v1": [{"0": [1, 2, 3, 4], "1": [5, 6]}] * 2}
    checks, lines = token_checks("x", same, base, lossless=True, across=True)
    assert checks == {"runs": {"v1": True}, "vs_baseline": {"v1": True}, "v1_vs_v2": None}
    assert lines == []
    off = {"v1": [{"0": [1, 2, 9, 4], "1": [5, 6]}, {"0": [1, 2, 9, 4], "1": [5, 7]}],
           "v2": [{"0": [1, 2, 3, 4], "1": [5, 6]}]}
    checks, lines = token_checks("x", off, base, lossless=True, across=True)
    assert checks == {"runs": {"v1": False, "v2": True},
                      "vs_baseline": {"v1": False, "v2": True}, "v1_vs_v2": False}
    assert lines == [
        "V1 x: its runs differ (1 of 2 requests; request 1 first at output token 1 of 2)",
        "V1 x: differs from V1's baseline (1 of 2 requests; request 0 first at output token 2 of 4)",
        "x: V2 differs from V1 (1 of 2 requests; request 0 first at output token 2 of 4)"]
    checks, _ = token_checks("x", off, base, lossless=False, across=False)  # synthetic, sampled
    assert checks["vs_baseline"] == {"v1": None, "v2": None} and checks["v1_vs_v2"] is None


def test_spec_configs_resolve_and_the_defaults_run_on_both_runners() -> None:
    [ngram, draft] = spec_args.parse_spec_configs(json.dumps([
        {"method": "ngram", "num_speculative_tokens": 3}, DRAFT]))
    assert ngram["prompt_lookup_min"] == ngram["prompt_lookup_max"] >= 1
    assert draft == {**DRAFT, "rejection_sample_method": "standard"}
    assert spec_args.parse_spec_configs(json.dumps(DRAFT)) == [draft]  # one object: a list
    defaults = spec_args.default_spec_configs("tiny-llama")
    assert [c["num_speculative_tokens"] for c in defaults] == [1, 2, 3, 4]
    assert {(c["method"], c["model"]) for c in defaults} == {("draft_model", "tiny-llama-draft")}
    assert spec_args.unique_labels([draft, draft]) == ["draft_model k=2", "draft_model k=2 #2"]


def test_a_config_carries_kernel_options_for_its_own_engines() -> None:
    """One run can compare kernel options: a --spec-configs object's "kernel_options"
    (checked as KernelOptions) reach its engines over --kernel-options, not the baselines',
    and name the config in the table."""
    from shared.harness.ab_args import _engine_args, build_parser

    [plain, gemv] = spec_args.parse_spec_configs(json.dumps([
        DRAFT, {**DRAFT, "kernel_options": {"gemv_max_tokens": 4, "draft_full_graphs": False}}]))
    assert gemv == {**plain, "kernel_options": {"gemv_max_tokens": 4, "draft_full_graphs": False}}
    assert spec_args.unique_labels([plain, gemv]) == [
        "draft_model k=2", "draft_model k=2 {draft_full_graphs=false,gemv_max_tokens=4}"]
    args = build_parser().parse_args(
        [*SPEC, "--model", "tiny-llama", "--kernel-options", '{"pdl": false}'])
    base = _engine_args(args, "v2", "sync").kernel_options
    with_plain = _engine_args(args, "v2", "sync", speculative=plain)
    with_gemv = _engine_args(args, "v2", "sync", speculative=gemv)
    assert (base.pdl, base.gemv_max_tokens, base.draft_full_graphs) == (False, 1, True)
    assert with_plain.kernel_options == base
    assert with_gemv.kernel_options == base.model_copy(
        update={"gemv_max_tokens": 4, "draft_full_graphs": False})
    assert with_gemv.speculative_config.model_dump(exclude_none=True) == {
        k: v for k, v in plain.items()}


SPEC = ["--workloads", "spec"]


@pytest.mark.parametrize(("argv", "expected"), [
    (["--spec-configs", "{not json"], "--spec-configs: not JSON"),
    (["--spec-configs", "[]"], "--spec-configs: expected a non-empty JSON list"),
    (["--spec-configs", "[1]"], "--spec-configs: expected a non-empty JSON list"),
    (["--spec-configs", '[{"method": "eagle", "num_speculative_tokens": 2}]'],
     '--spec-configs: config 0 {"method": "eagle", "num_speculative_tokens": 2}: method'),
    (["--spec-configs", '[{"method": "ngram", "num_speculative_tokens": 0}]'],
     "--spec-configs: config 0 {"),
    (["--spec-configs", '[{"method": "draft_model", "num_speculative_tokens": 2}]'],
     "--spec-configs: config 0 {"),
    (["--spec-configs", json.dumps([{**DRAFT, "model": "tiny-mixtral"}])],
     "--spec-configs config 0 (draft_model k=2): speculative_config.model"),
    (["--runners", "v2", "--spec-configs", json.dumps([NGRAM])],
     "--spec-configs config 0 (ngram k=2 n=1..2): no runner measured here runs it"),
    (["--spec-configs", json.dumps([{**DRAFT, "kernel_options": {"gemv_max_tokens": -1}}])],
     "--spec-configs: config 0 {"),
    (["--spec-configs", json.dumps([{**DRAFT, "kernel_options": {"no_such": 1}}])],
     "--spec-configs: config 0 {"),
    (["--spec-batch", "0"], "--spec-batch: 0 is not valid"),
    (["--spec-prompt-len", "x"], "--spec-prompt-len: 'x' is not an integer"),
    (["--spec-max-tokens", "0"], "--spec-max-tokens: 0 is not valid"),
    (["--spec-temperature", "-1"], "--spec-temperature: -1.0 is not valid"),
    (["--spec-temperature", "nan"], "--spec-temperature: nan is not valid"),
    (["--spec-prompt-len", "500", "--spec-max-tokens", "100"],
     "the spec workload needs requests of 600 tokens"),
    (["--speculative-config", json.dumps(NGRAM)], "--speculative-config would give every engine"),
    # ngram is made from landed host tokens: neither runner runs it a step ahead
    (["--engine-loop", "async", "--spec-configs", json.dumps([NGRAM])],
     "the async engine loop (--engine-loop async or --async-scheduling)"),
    (["--engine-loop", "both"], "--engine-loop both: the spec workload runs one loop"),
    (["--model", "tiny-qwen3"], "--workloads spec: the model 'tiny-qwen3' has no draft preset"),
    (["--max-num-seqs", "2", "--spec-batch", "4"], "--max-num-seqs 2 is below the 4"),
])
def test_refused_spec_flags_are_one_line_with_exit_2(argv, expected, tmp_path, capsys) -> None:
    rc = cli_main(["ab", *SPEC, *argv, "--output-dir", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert captured.err.startswith(f"runnerlab ab: error: {expected}"), captured.err
    assert not (tmp_path / "out").exists()  # refused before anything ran or was written


@pytest.mark.parametrize("flag", sorted(spec_args.SPEC_FLAGS.values()))
def test_spec_flags_without_the_spec_workload_are_refused(flag, tmp_path, capsys) -> None:
    value = json.dumps([NGRAM]) if flag == "--spec-configs" else "1"
    rc = cli_main(["ab", "--workloads", "decode", flag, value, "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"runnerlab ab: error: {flag} sets the spec workload, "
                                      "which --workloads decode leaves out"), err
