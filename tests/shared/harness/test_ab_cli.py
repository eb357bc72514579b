"""`runnerlab ab` end to end on CPU: the table, ab.json with its documented fields,
ab.png, identical tokens from both runners; one runner alone; the Triton-interpreter
caveat; every refused flag as one line with exit status 2."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

import shared.harness.ab as ab
import shared.harness.ab_args as ab_args
import shared.harness.ab_loops as ab_loops
from shared.harness.ab import ab_main
from shared.harness.chart import build_figure
from shared.harness.cli import main as cli_main

ON_CPU = not torch.cuda.is_available()
# tiny sizes: a few seconds per run
TINY = ["--quick", "--steps", "2", "--batch-sizes", "1,2"]
SYNC = ab_loops.EngineLoops(("sync",), "sync")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `ab --quick` over decode and churn, shared by the tests that read its output."""
    out = tmp_path_factory.mktemp("ab")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = ab_main(["--quick", "--output-dir", str(out), "--workloads", "decode,churn"])
    return rc, json.loads((out / "ab.json").read_text()), stdout.getvalue(), out


def test_ab_quick_writes_json_and_png(quick_run) -> None:
    rc, report, out, path = quick_run
    assert rc == 0, out
    for key in ("model", "dtype", "device", "settings", "workloads", "tokens_identical",
                "startup_s", "graph_capture_s", "weight_bytes", "runners", "caveats",
                "v2_triton_interpreter", "engines", "engine_loops", "warnings",
                "read_bandwidth_GBps", "gemm_TFLOPs", "gemm_dtype"):
        assert key in report, key
    assert report["runners"] == ["v1", "v2"]
    assert report["tokens_identical"] is True
    decode = report["workloads"]["decode"]
    assert [e["label"] for e in decode] == ["b1", "b4"]
    for entry in decode:
        for runner in ("v1", "v2"):
            stats = entry[runner]
            assert stats["wall_ms"]["n"] == 2 * report["settings"]["steps"]  # A-B-B-A: 2 runs each
            for stage in ("preprocess", "forward", "postprocess", "sample"):
                assert stats["stages_ms"][stage]["median"] > 0
    (churn,) = report["workloads"]["churn"]
    for runner in ("v1", "v2"):  # the run timed without per-step event reads
        assert churn[runner]["steady_ms"]["median"] > 0
    assert any(line.split()[:2] == ["live4", "steady"] for line in out.splitlines())
    png = (path / "ab.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "V2/V1" in out and "tokens identical across runners: True" in out


@pytest.mark.skipif(not ON_CPU, reason="the interpreter runs only without a GPU")
def test_cpu_report_says_v2_ran_under_the_triton_interpreter(quick_run) -> None:
    _, report, out, _ = quick_run
    assert report["v2_triton_interpreter"] is True
    [caveat] = report["caveats"]
    assert "Triton interpreter" in caveat and "not V2's design" in caveat
    assert f"CAVEAT: {caveat}" in out
    fig = build_figure(report)
    assert "Triton interpreter" in fig._suptitle.get_text()


def test_png_has_one_panel_per_measured_workload_with_both_runners_visible(quick_run) -> None:
    _, report, _, _ = quick_run
    fig = build_figure(report)
    assert [ax.get_title() for ax in fig.axes] == ["decode", "churn (live4)"]
    decode_ax = fig.axes[0]
    # five rows (wall + four stages) per runner, V1 solid with filled markers, V2 dashed
    # with open ones, so that equal values still show both
    styles = [(line.get_linestyle(), line.get_marker(), line.get_markerfacecolor())
              for line in decode_ax.get_lines()]
    assert len(styles) == 10
    v1, v2 = set(styles[0::2]), set(styles[1::2])
    assert {s[:2] for s in v1} == {("-", "o")} and {s[:2] for s in v2} == {("--", "s")}
    assert all(s[2] == "none" for s in v2) and not any(s[2] == "none" for s in v1)
    churn_ax = fig.axes[1]
    hatched = [p for p in churn_ax.patches if p.get_hatch()]
    assert len(churn_ax.patches) == 10 and len(hatched) == 5  # V2's bars hatched


def test_png_draws_throughput_and_prefill_panels() -> None:
    """Workloads other than decode get panels too (a hand-made report: throughput is too
    slow for a CPU test)."""
    rate = {"median": 100.0, "min": 90.0, "max": 110.0, "n": 3}
    stages = {"wall_ms": {"median": 2.0}, "stages_ms": {s: {"median": 0.5} for s in
                                                       ("preprocess", "forward", "postprocess", "sample")}}
    report = {
        "model": "m", "dtype": "float32", "device": "cpu", "runners": ["v1", "v2"],
        "caveats": [], "settings": {},
        "workloads": {
            "prefill": [{"label": "4x256", "v1": stages, "v2": stages}],
            "throughput": [{"label": "nano-vllm", "v1": {"output_tokens_per_s": rate},
                            "v2": {"output_tokens_per_s": rate}}],
        },
    }
    fig = build_figure(report)
    assert [ax.get_title() for ax in fig.axes] == ["prefill (4x256)", "throughput (nano-vllm)"]
    assert len(fig.axes[1].patches) == 2


def test_one_runner_runs_alone_without_ratios(tmp_path, capsys) -> None:
    rc = cli_main(["ab", *TINY, "--runners", "v1", "--workloads", "decode",
                   "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "ab.json").read_text())
    assert report["runners"] == ["v1"] and report["settings"]["runners"] == ["v1"]
    assert set(report["startup_s"]) == {"v1"}
    for entry in report["workloads"]["decode"]:
        assert "v1" in entry and "v2" not in entry
        assert entry["v1"]["stages_ms"]["forward"]["median"] > 0
    assert report["v2_triton_interpreter"] is False and report["caveats"] == []
    assert "V2" not in out and "tokens identical across V1's runs: True" in out
    fig = build_figure(report)
    assert len(fig.axes[0].get_lines()) == 5


def test_model_runner_names_the_one_runner(tmp_path, capsys) -> None:
    rc = cli_main(["ab", *TINY, "--model-runner", "v2", "--workloads", "decode",
                   "--output-dir", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "ab.json").read_text())
    assert report["runners"] == ["v2"]
    assert list(report["workloads"]["decode"][0]) == ["label", "tokens_identical", "run_s", "v2", "floor_ms"]


@pytest.mark.parametrize(("argv", "expected"), [
    (["--batch-sizes", "0"], "--batch-sizes: batch size 0 is not valid"),
    (["--batch-sizes", "1,-8"], "--batch-sizes: batch size -8 is not valid"),
    (["--batch-sizes", "1,x"], "--batch-sizes: 'x' is not an integer"),
    (["--steps", "0"], "--steps: 0 is not valid"),
    (["--prompt-len", "ten"], "--prompt-len: 'ten' is not an integer"),
    (["--warmup", "-1"], "--warmup: -1 is not valid"),
    (["--repeats", "0"], "--repeats: 0 is not valid"),
    (["--threads", "0"], "--threads: 0 is not valid"),
    (["--max-model-len", "x"], "--max-model-len: invalid int value: 'x'"),
    (["--workloads", "decode,bogus"], "--workloads: unknown workload bogus"),
    (["--runners", "v3"], "--runners: unknown runner v3"),
    (["--model-runner", "auto"], "--model-runner auto: ab measures the runners it is told to"),
    (["--model-runner", "v1", "--runners", "v1"], "--model-runner and --runners both"),
    (["--engine-loop", "fast"], "--engine-loop: invalid choice: 'fast'"),
    (["--engine-loop", "sync", "--async-scheduling"],
     "--async-scheduling contradicts --engine-loop sync; give --engine-loop only"),
    (["--engine-loop", "both", "--no-async-scheduling"],
     "--no-async-scheduling contradicts --engine-loop both"),
    (["--workloads", "churn", "--steps", "3"], "--steps sets the decode workload"),
    (["--max-num-seqs", "2", "--batch-sizes", "1,4", "--workloads", "decode"],
     "--max-num-seqs 2 is below the 4"),
    (["--max-model-len", "16"], "the decode workload needs requests of"),
    pytest.param(["--nvtx"], "--nvtx: NVTX ranges need a CUDA device",
                 marks=pytest.mark.skipif(not ON_CPU, reason="CPU only")),
    pytest.param(["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization has no effect",
                 marks=pytest.mark.skipif(not ON_CPU, reason="CPU only")),
    (["--block-size", "12"], "block_size=12 is not valid"),
])
def test_refused_flags_are_one_line_with_exit_2(argv, expected, tmp_path, capsys) -> None:
    rc = cli_main(["ab", *argv, "--output-dir", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert captured.err.startswith(f"runnerlab ab: error: {expected}"), captured.err
    assert not (tmp_path / "out").exists()  # refused before anything ran or was written


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_unwritable_output_dir_is_one_line_before_measuring(kind, tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    target = blocker if kind == "a file" else blocker / "sub"
    rc = cli_main(["ab", *TINY, "--output-dir", str(target)])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""  # nothing measured
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith(f"runnerlab ab: error: --output-dir {str(target)!r} is not "
                                   "a writable directory")


def test_a_failed_write_after_measuring_is_one_line_exit_1(tmp_path, capsys, monkeypatch) -> None:
    def full_disk(report, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ab, "write_png", full_disk)
    rc = cli_main(["ab", *TINY, "--runners", "v1", "--workloads", "decode",
                   "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.strip().splitlines()[-1] == (
        f"runnerlab ab: error: writing the results to {str(tmp_path)!r}: No space left on device")
    assert "Traceback" not in err


@pytest.mark.skipif(not ON_CPU, reason="the CPU default")
def test_cpu_default_sizes_and_what_they_cut() -> None:
    args = ab_args.build_parser().parse_args([])
    settings = ab_args._settings(args, "cpu", ["v1", "v2"], SYNC)
    assert settings["batches"] == list(ab_args.CPU_SIZES.batches)
    assert settings["workloads"] == ["decode", "prefill", "churn"]
    note = settings["defaults_note"]
    assert note.startswith("CPU default") and "no throughput workload" in note
    gpu = ab_args._settings(args, "cuda", ["v1", "v2"], SYNC)  # the GPU default is unchanged
    assert gpu["batches"] == [1, 8, 32, 64, 128, 256, 512, 1024] and gpu["steps"] == 30
    assert gpu["workloads"] == list(ab_args.WORKLOADS) and gpu["defaults_note"] is None
    # a flag that sets a size takes it out of the note
    args = ab_args.build_parser().parse_args(["--batch-sizes", "2", "--steps", "4"])
    note = ab_args._settings(args, "cpu", ["v1"], SYNC)["defaults_note"]
    assert "batch sizes" not in note and "measured steps" not in note


def test_repeats_sets_the_runs_of_every_workload(tmp_path) -> None:
    assert ab_main([*TINY, "--runners", "v1", "--workloads", "decode", "--repeats", "1",
                    "--output-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "ab.json").read_text())
    for entry in report["workloads"]["decode"]:
        assert len(entry["run_s"]["v1"]) == 1
        assert entry["v1"]["wall_ms"]["n"] == report["settings"]["steps"]


def test_ab_profile_writes_a_trace_per_runner(tmp_path) -> None:
    rc = ab_main(["--quick", "--output-dir", str(tmp_path), "--workloads", "churn", "--profile"])
    assert rc == 0
    traces = sorted(p.name for p in tmp_path.glob("trace_*.json"))
    assert traces == ["trace_v1_live4.json", "trace_v2_live4.json"]
    for name in traces:
        trace = json.loads((tmp_path / name).read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        # the profiled region holds the runs themselves: the model's projections and its
        # attention softmax, not only the profiler's own bookkeeping events
        assert {"aten::linear", "aten::softmax"} <= names, sorted(names)[:20]


@pytest.mark.skipif(not ON_CPU, reason="the CPU default")
def test_threads_default_to_one_on_cpu_and_the_flag_sets_them(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    seen = []
    real = ab.run_ab

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(ab, "run_ab", spy)
    base = [*TINY, "--runners", "v1", "--workloads", "decode", "--output-dir", str(tmp_path)]
    assert ab_main(base) == 0
    assert json.loads((tmp_path / "ab.json").read_text())["settings"]["threads"] == 1
    assert ab_main([*base, "--threads", "2"]) == 0
    assert json.loads((tmp_path / "ab.json").read_text())["settings"]["threads"] == 2
    assert seen == [1, 2]  # what the measurement ran with
    assert torch.get_num_threads() == before  # and the process's setting is given back


def test_throughput_engines_admit_the_ladders_top_whatever_the_workloads() -> None:
    """nano-vllm's 256 requests run as many at once as the engine admits: a throughput-only
    run must size max_num_seqs like a full one (a run that left it at 16 measured a quarter
    of the throughput, with a different batch history in the async engine)."""
    full = ab_args._settings(ab_args.build_parser().parse_args([]), "cuda", ["v1", "v2"], SYNC)
    only = ab_args._settings(ab_args.build_parser().parse_args(["--workloads", "throughput"]),
                             "cuda", ["v1", "v2"], SYNC)
    assert ab_args.concurrency(only) == ab_args.concurrency(full) == max(ab_args.GPU_SIZES.batches)
    decode = ab_args._settings(
        ab_args.build_parser().parse_args(["--workloads", "decode", "--batch-sizes", "1,4"]),
        "cuda", ["v1", "v2"], SYNC)
    assert ab_args.concurrency(decode) == 4
