"""`runnerlab ab` compares like with like: one engine loop for every runner, read from the
policy's feature table (the tests set the table's "async scheduling" row both ways, so
they hold before and after V1 gains async scheduling); the header states each engine's
loop, graph mode and capture sizes and warns when the runners differ; ab.json records
them; the throughput workload is set beside its floor."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest

import shared.harness.workloads as wl
from policy import features
from policy.model_config import build_model_config
from shared.harness import ab_args, ab_loops
from shared.harness import floor as fl
from shared.harness.ab import ab_main
from shared.harness.ab_engines import (
    difference_warnings,
    engine_groups,
    engine_specs,
    summarize_sizes,
)
from shared.harness.chart import build_figure
from shared.harness.cli import main as cli_main
from tests.shared.harness.test_floor import SHAPE, simulate

TINY = ["--quick", "--steps", "2", "--batch-sizes", "1,2"]


@pytest.fixture(params=["v1 unable", "v1 able"])
def v1_async(request, monkeypatch) -> bool:
    """The feature table with V1's async-scheduling status set one way; True: V1 has it."""
    able = request.param == "v1 able"
    status = features.SUPPORTED if able else features.UNSUPPORTED
    table = tuple(dataclasses.replace(f, v1=status) if f.label == ab_loops.ASYNC_FEATURE else f
                  for f in features.FEATURES)
    monkeypatch.setattr(features, "FEATURES", table)
    return able


def _loops(argv: list[str], runners: list[str]) -> ab_loops.EngineLoops:
    return ab_loops.resolve_engine_loops(ab_args.build_parser().parse_args(argv), runners)


def test_the_default_loop_is_async_only_where_every_runner_has_it(v1_async) -> None:
    both = _loops([], ["v1", "v2"])
    if v1_async:
        assert both == ab_loops.EngineLoops(("async",), "default")
    else:
        assert both.loops == ("sync",)
        assert both.warning.startswith("engine loop sync for every runner: V1 cannot run "
                                       "async scheduling (policy.features 'async scheduling'")
    assert _loops([], ["v2"]) == ab_loops.EngineLoops(("async",), "default")
    assert _loops([], ["v1"]).loops == (("async",) if v1_async else ("sync",))


def test_engine_loop_flag_and_async_scheduling_agree(v1_async) -> None:
    assert _loops(["--engine-loop", "sync"], ["v1", "v2"]).loops == ("sync",)
    assert _loops(["--engine-loop", "both"], ["v2"]).loops == ("sync", "async")
    assert _loops(["--async-scheduling"], ["v2"]).loops == ("async",)
    assert _loops(["--no-async-scheduling"], ["v1", "v2"]).loops == ("sync",)
    assert _loops(["--engine-loop", "async", "--async-scheduling"], ["v2"]).loops == ("async",)
    with pytest.raises(ab_args.Refused, match="--async-scheduling contradicts --engine-loop both"):
        _loops(["--engine-loop", "both", "--async-scheduling"], ["v2"])


@pytest.mark.parametrize(("argv", "flag"), [
    (["--engine-loop", "async"], "--engine-loop async"),
    (["--engine-loop", "both"], "--engine-loop both"),
    (["--async-scheduling"], "--async-scheduling"),
])
def test_a_loop_v1_cannot_run_is_one_line_naming_the_flag_and_the_fix(
        argv, flag, tmp_path, capsys, monkeypatch) -> None:
    table = tuple(dataclasses.replace(f, v1=features.UNSUPPORTED)
                  if f.label == ab_loops.ASYNC_FEATURE else f for f in features.FEATURES)
    monkeypatch.setattr(features, "FEATURES", table)
    rc = cli_main(["ab", *argv, "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err == (f"runnerlab ab: error: {flag}: V1 cannot run async scheduling "
                   "(policy.features 'async scheduling': unsupported-yet); use --engine-loop "
                   "sync, or --runners v2\n")
    assert not (tmp_path / "out").exists()


def test_engines_are_labelled_by_loop_only_when_there_are_two() -> None:
    one = engine_specs(["v1", "v2"], ["async"])
    assert [(s.label, s.runner, s.loop) for s in one] == [("v1", "v1", "async"), ("v2", "v2", "async")]
    both = [s.label for s in engine_specs(["v1", "v2"], ["sync", "async"])]
    assert both == ["v1-sync", "v2-sync", "v1-async", "v2-async"]
    assert engine_groups(both) == [["v1-sync", "v2-sync"], ["v1-async", "v2-async"]]
    assert engine_groups(["v1", "v2"]) == [["v1", "v2"]]


def test_capture_sizes_are_summarized_by_start_end_and_count() -> None:
    assert summarize_sizes([]) == "none"
    assert summarize_sizes([1, 2, 4]) == "1,2,4"
    assert summarize_sizes([1, 2, 4, 8, 16]) == "1,2,4,8,16"
    assert summarize_sizes([1, 2, 4] + list(range(8, 513, 8))) == "1,2,4,8..512 (n=67)"


def _engine(runner: str, loop: str = "sync", mode: str = "FULL", sizes=(1, 2, 4)) -> dict:
    return {"runner": runner, "engine_loop": loop, "cudagraph_mode": mode,
            "cudagraph_capture_sizes": list(sizes), "capture_sizes": summarize_sizes(list(sizes))}


def test_warnings_name_what_the_compared_runners_differ_in() -> None:
    assert difference_warnings({"v1": _engine("v1"), "v2": _engine("v2")}) == []
    [mode] = difference_warnings({"v1": _engine("v1", mode="FULL_AND_PIECEWISE"),
                                  "v2": _engine("v2")})
    assert mode.startswith("the runners differ in graph mode (V1 FULL_AND_PIECEWISE, V2 FULL)")
    loop, sizes = difference_warnings({"v1": _engine("v1", sizes=(1, 2)),
                                       "v2": _engine("v2", loop="async")})
    assert loop.startswith("the runners differ in engine loop (V1 sync, V2 async)")
    assert sizes.startswith("the runners differ in capture sizes (V1 1,2, V2 1,2,4)")
    # under both loops, each loop's engines are compared with each other, not across loops
    engines = {"v1-sync": _engine("v1"), "v2-sync": _engine("v2"),
               "v1-async": _engine("v1", "async"), "v2-async": _engine("v2", "async", "NONE")}
    [only] = difference_warnings(engines)
    assert "graph mode (V1-ASYNC FULL, V2-ASYNC NONE)" in only


@pytest.mark.parametrize(("engines", "share"), [(2, 0.42), (4, 0.21)])
def test_engines_split_the_gpu_between_them(engines, share) -> None:
    args = ab_args.build_parser().parse_args(["--quick", "--model", "tiny-llama"])
    config = ab_args._engine_args(args, "v2", "sync", num_engines=engines)
    assert config.gpu_memory_utilization == share and config.async_scheduling is False
    assert ab_args._engine_args(args, "v2", "async").async_scheduling is True


def test_a_gpu_share_the_engines_cannot_all_have_is_refused() -> None:
    args = ab_args.build_parser().parse_args(["--gpu-memory-utilization", "0.3",
                                              "--engine-loop", "both", "--runners", "v1,v2"])
    settings = ab_args._settings(args, "cuda", ["v1", "v2"],
                                 ab_loops.EngineLoops(("sync", "async"), "both"))
    with pytest.raises(ab_args.Refused, match=r"--gpu-memory-utilization 0.3 is each engine's "
                       r"share of the GPU, and 4 engines share it \(1.20 in all\); give at most 0.25"):
        ab_args.check_flags(args, settings, "cuda")
    settings["engine_loops"] = ["sync"]
    ab_args.check_flags(args, settings, "cuda")  # two engines: 0.6 in all


def _run(argv: list[str], tmp_path) -> tuple[int, dict, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = ab_main([*argv, "--output-dir", str(tmp_path)])
    return rc, json.loads((tmp_path / "ab.json").read_text()), out.getvalue()


def test_both_loops_measure_every_workload_under_each_and_compare_all_tokens(tmp_path) -> None:
    rc, report, out = _run([*TINY, "--runners", "v2", "--engine-loop", "both",
                            "--workloads", "decode"], tmp_path)
    assert rc == 0, out
    assert report["engine_loops"] == ["sync", "async"]
    assert {k: (e["runner"], e["engine_loop"]) for k, e in report["engines"].items()} == {
        "v2-sync": ("v2", "sync"), "v2-async": ("v2", "async")}
    assert report["async_scheduling"] == {"v2-sync": False, "v2-async": True}
    for entry in report["workloads"]["decode"]:
        assert {"v2-sync", "v2-async"} <= set(entry) and entry["tokens_identical"]
        assert len(entry["run_s"]["v2-sync"]) == len(entry["run_s"]["v2-async"]) == 2
    assert "tokens identical across engines (every runner under every loop): True" in out
    assert "engines: V2-SYNC sync loop, graphs NONE; V2-ASYNC async loop, graphs NONE" in out
    assert out.index("== decode, sync loop ==") < out.index("== decode, async loop ==")
    lines = build_figure(report).axes[0].get_lines()
    assert len(lines) == 10 and len({(ln.get_linestyle(), ln.get_marker()) for ln in lines}) == 2


def test_both_runners_under_both_loops(tmp_path, capsys) -> None:
    """With the real feature table (both runners have async scheduling): four engines.
    The refusal for a runner without it is the fixture-driven test above."""
    rc = cli_main(["ab", *TINY, "--engine-loop", "both", "--workloads", "decode",
                   "--output-dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads((tmp_path / "ab.json").read_text())
    assert list(report["engines"]) == ["v1-sync", "v2-sync", "v1-async", "v2-async"]
    assert report["tokens_identical"] is True


def test_the_header_and_json_state_each_engines_loop_and_graphs(tmp_path) -> None:
    rc, report, out = _run([*TINY, "--workloads", "decode"], tmp_path)
    assert rc == 0, out
    loop = "async"  # both runners have async scheduling: the default for both
    assert report["engine_loops"] == [loop]
    for runner in ("v1", "v2"):
        engine = report["engines"][runner]
        assert (engine["engine_loop"], engine["cudagraph_mode"]) == (loop, "NONE")  # CPU
        assert engine["cudagraph_capture_sizes"] == [] and engine["capture_sizes"] == "none"
    assert f"engines: V1 {loop} loop, graphs NONE; V2 {loop} loop, graphs NONE" in out
    forced = [w for w in report["warnings"] if w.startswith("engine loop sync for every runner")]
    assert len(forced) == (loop == "sync")
    assert all(f"WARNING: {w}" in out for w in report["warnings"])
    assert report["read_bandwidth_GBps"] > 0 and report["gemm_TFLOPs"] > 0
    assert report["gemm_dtype"] == report["dtype"] == "float32"


def test_throughput_is_set_beside_its_floor(tmp_path, monkeypatch) -> None:
    """A small stand-in for nano-vllm's workload (its 256 requests are minutes on the
    CPU): 7 requests through 4 slots. The first four hold them for 8 decode steps; the
    others wait, and the 5-token one decodes 4 more steps: 12, not 8 as all at once."""
    monkeypatch.setattr(wl, "nano_vllm_workload", lambda: (
        [[3 + i] * (5 + 3 * i) for i in range(7)], [9, 9, 9, 9, 5, 2, 1]))
    monkeypatch.setattr(wl, "THROUGHPUT_MAX_LEN", 40)  # its longest request: 14 + 9 tokens
    rc, report, out = _run(["--quick", "--workloads", "throughput", "--repeats", "1",
                            "--max-num-seqs", "4"], tmp_path)
    assert rc == 0, out
    [entry] = report["workloads"]["throughput"]
    floor = entry["floor"]
    assert floor["output_tokens"] == entry["v1"]["expected_output_tokens"]["median"] == 44
    assert floor["max_num_seqs"] == 4 and floor["decode_steps"] == 12
    rates = fl.Rates(report["read_bandwidth_GBps"] * 1e9, report["gemm_TFLOPs"] * 1e12)
    assert floor["seconds"] == pytest.approx(floor["kv_bytes_read"] / rates.read_bytes_per_s
                                             + floor["weight_bytes_read"] / rates.read_bytes_per_s
                                             + floor["prefill_flops"] / rates.matmul_flops_per_s)
    assert floor["weight_bytes_read"] == 12 * report["weight_bytes"]
    cfg = build_model_config("tiny-llama", "float32", "cpu", None)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    prompts, outputs = wl.nano_vllm_workload()
    shape = dataclasses.replace(SHAPE, kv_bytes_per_token=per_token)
    ref = simulate(shape, [len(p) for p in prompts], outputs, 4, rates)
    assert (floor["kv_bytes_read"], floor["decode_steps"]) == (ref["kv_bytes"], ref["steps"])
    for runner in ("v1", "v2"):
        seconds = entry[runner]["seconds"]["median"]
        assert entry[runner]["floor_fraction"] == pytest.approx(floor["seconds"] / seconds)
    assert f"floor {floor['tokens_per_s']:,.0f} output tokens/s at the CPU's measured rates" in out
    assert "floor time decode 12 steps reading" in out
    fractions = f"V1 {entry['v1']['floor_fraction']:.3g}  V2 {entry['v2']['floor_fraction']:.3g}"
    assert f"of floor {fractions}  (floor time / measured time)" in out
    assert "the floors below are for these rates" in out
    [hline] = build_figure(report).axes[0].collections[-1:]
    assert hline.get_label() == "floor"
