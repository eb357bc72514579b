"""`runnerlab ab --workloads embed` on CPU with tiny-llama: the default run through ab_main
(ab.json's embed entry checked against its own accounting and a hand count of the
model's parameters, the table, the chart), the V1 - V2 agreement check (and a run that
fails it), embed beside another workload, every refused flag as one line before anything
runs, and the GEMM-rate floor against a case worked by hand."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import numpy as np
import pytest
import torch

from policy import features
from shared.harness import embed_workload
from shared.harness.ab import ab_main
from shared.harness.chart import build_figure
from shared.harness.cli import main as cli_main
from shared.harness.embed_args import CPU_EMBED_SIZES, GPU_EMBED_SIZES
from shared.harness.embed_workload import agreement, disagreements, embed_prompts, max_abs_diff
from shared.harness.floor import GemmFloor
from tests.shared.harness.test_ab_cli import (  # (a name pytest does not collect again)
    test_refused_flags_are_one_line_with_exit_2 as refused_in_one_line,
)

ON_CPU = not torch.cuda.is_available()
RATE_KEYS = ("seconds", "steps", "embeddings_per_s", "prompt_tokens_per_s")


def _run(out, *argv: str) -> tuple[int, dict, str]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = ab_main(["--output-dir", str(out), *argv])
    return rc, json.loads((out / "ab.json").read_text()), stdout.getvalue()


def _tiny_llama_params() -> tuple[int, int]:
    """(matmul parameters a token passes through, every parameter) of tiny-llama, counted
    by hand from its config.json: hidden 64, intermediate 128, 2 layers, 4 query and 2 KV
    heads of 16, vocabulary 512, untied LM head."""
    hidden, inter, layers, vocab = 64, 128, 2, 512
    attention = hidden * (4 * 16) * 2 + hidden * (2 * 16) * 2  # q, o; k, v
    mlp = 3 * hidden * inter  # gate, up, down
    matmul = layers * (attention + mlp)
    norms = layers * 2 * hidden + hidden
    return matmul, matmul + norms + 2 * vocab * hidden  # + embedding and LM head


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`runnerlab ab --workloads embed` with the CPU defaults."""
    return _run(tmp_path_factory.mktemp("ab-embed"), "--workloads", "embed")


@pytest.mark.skipif(not ON_CPU, reason="the CPU default sizes")
def test_the_default_run_writes_the_embed_entry(default_run) -> None:
    rc, report, text = default_run
    assert rc == 0, text
    assert report["failures"] == [] and "tokens_identical" not in report  # no tokens here
    [entry] = report["workloads"]["embed"]
    sizes = CPU_EMBED_SIZES
    assert (entry["prompts"], entry["min_len"], entry["max_len"]) == (
        sizes.prompts, sizes.min_len, sizes.max_len)
    lengths = [len(p) for p in embed_prompts(sizes.prompts, sizes.min_len, sizes.max_len, 512)]
    assert entry["prompt_tokens"] == sum(lengths)
    assert all(sizes.min_len <= n <= sizes.max_len for n in lengths)
    # the pooling engines are the report's own (embed alone), sync, with no FULL graphs
    assert report["engine_loops"] == ["sync"] and list(report["engines"]) == ["v1", "v2"]
    for runner in ("v1", "v2"):
        info = entry["engines"][runner]
        assert info["engine_loop"] == "sync" and "FULL" not in info["cudagraph_mode"]
        assert info["pooler"]["pooling_type"] == "LAST"  # the embed task's default
        assert report["engines"][runner]["cudagraph_mode"] == info["cudagraph_mode"]
    gpu = GPU_EMBED_SIZES
    assert (f"embed {sizes.prompts} prompts (GPU {gpu.prompts}); embed prompt lengths "
            f"{sizes.min_len}..{sizes.max_len} (GPU {gpu.min_len}..{gpu.max_len})"
            in report["settings"]["defaults_note"])
    assert "engines: V1 sync loop, graphs NONE; V2 sync loop, graphs NONE" in text


def test_each_runners_rates_follow_from_its_times(default_run) -> None:
    _, report, _ = default_run
    [entry] = report["workloads"]["embed"]
    prompts, tokens = entry["prompts"], entry["prompt_tokens"]
    for runner in ("v1", "v2"):
        st = entry[runner]
        for key in RATE_KEYS:
            assert st[key]["n"] == 2, key  # A-B-B-A, the warm-up excluded
            assert st[key]["min"] <= st[key]["median"] <= st[key]["max"]
        assert len(entry["run_s"][runner]) == 2
        assert st["embeddings_per_s"]["median"] > 0
        # the fastest run has the highest rates
        assert st["embeddings_per_s"]["max"] == pytest.approx(prompts / st["seconds"]["min"])
        assert st["prompt_tokens_per_s"]["max"] == pytest.approx(tokens / st["seconds"]["min"])
        assert st["steps"]["min"] >= 1


def test_the_floor_is_prompt_tokens_times_twice_the_matmul_parameters(default_run) -> None:
    _, report, text = default_run
    [entry] = report["workloads"]["embed"]
    f = entry["floor"]
    matmul, everything = _tiny_llama_params()
    assert (f["matmul_params"], f["parameters"]) == (matmul, everything)
    assert f["gemm_flops_per_s"] == pytest.approx(report["gemm_TFLOPs"] * 1e12)
    assert f["prompt_tokens"] == entry["prompt_tokens"]
    assert f["seconds"] == pytest.approx(entry["prompt_tokens"] * 2 * matmul
                                         / f["gemm_flops_per_s"])
    for runner in ("v1", "v2"):
        fraction = entry[runner]["floor_fraction"]
        # not clamped: above 1 would be reported as it is
        assert fraction > 0
        assert fraction == pytest.approx(f["seconds"] / entry[runner]["seconds"]["median"])
        assert f"{fraction:.3g}" in text
    assert f"{f['embeddings_per_s']:,.1f} embeddings/s" in text


def test_v1_and_v2_embeddings_agree_in_float32(default_run) -> None:
    _, report, text = default_run
    check = report["workloads"]["embed"][0]["agreement"]
    assert check["dtype"] == "float32" and check["tolerance"] == 1e-5
    assert check["v1_vs_v2"] <= 1e-5 and check["agree"] is True
    assert all(d <= 1e-5 for d in check["runs"].values())
    assert "(float32: must be <= 1e-05): agree" in text


def test_the_table_and_the_chart(default_run) -> None:
    _, report, text = default_run
    [entry] = report["workloads"]["embed"]
    assert "== embed, sync loop ==" in text and "V2/V1" in text
    fig = build_figure(report)
    [ax] = fig.axes
    assert ax.get_title() == f"embed ({entry['label']})"
    heights = [p.get_height() for p in ax.patches]
    assert heights == pytest.approx([entry[r]["embeddings_per_s"]["median"] for r in ("v1", "v2")])
    [floor_line] = ax.collections[-1:]  # the dotted floor over the bars
    assert floor_line.get_segments()[0][0][1] == pytest.approx(entry["floor"]["embeddings_per_s"])


def test_embeddings_that_differ_fail_the_run(tmp_path, monkeypatch) -> None:
    """V2's timed embeddings shifted by 1e-3: the run fails like a token mismatch."""
    real = embed_workload.embed_run

    def shifted(engine, prompts, tag):
        run = real(engine, prompts, tag)
        if tag.startswith("v2-embed-") and "warm" not in tag:
            run.embeddings = {k: v + 1e-3 for k, v in run.embeddings.items()}
        return run

    monkeypatch.setattr(embed_workload, "embed_run", shifted)
    rc, report, text = _run(tmp_path, "--quick", "--repeats", "1", "--workloads", "embed")
    check = report["workloads"]["embed"][0]["agreement"]
    assert rc == 1 and check["agree"] is False
    assert check["v1_vs_v2"] == pytest.approx(1e-3, rel=1e-3)
    assert report["failures"] == [
        f"embed: V1 and V2 embeddings differ by up to {check['v1_vs_v2']:.3g} (> 1e-05 in float32)"]
    assert "DIFFER" in text


def test_embed_beside_another_workload_runs_after_its_engines(tmp_path) -> None:
    rc, report, text = _run(tmp_path, "--quick", "--repeats", "1", "--workloads", "churn,embed",
                            "--pooler-config", '{"pooling_type": "MEAN"}')
    assert rc == 0, text
    assert list(report["workloads"]) == ["churn", "embed"] and report["tokens_identical"] is True
    [entry] = report["workloads"]["embed"]
    assert all(entry[r]["embeddings_per_s"]["median"] > 0 for r in ("v1", "v2"))
    assert entry["engines"]["v1"]["pooler"]["pooling_type"] == "MEAN"
    assert "embed engines (pooling_task='embed'): V1 sync loop" in text
    if report["engine_loops"] != ["sync"]:  # churn ran async: the embed engines could not
        assert any("embed workload's engines ran the sync loop" in w for w in report["warnings"])


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(("argv", "expected"), [
    (["--embed-prompts", "8"], "--embed-prompts sets the embed workload, which --workloads "),
    (["--workloads", "churn", "--embed-max-len", "8"], "--embed-max-len sets the embed workload"),
    (["--workloads", "decode", "--embed-min-len", "8"], "--embed-min-len sets the embed workload"),
    (["--workloads", "embed", "--embed-prompts", "0"], "--embed-prompts: 0 is not valid"),
    (["--workloads", "embed", "--embed-min-len", "x"], "--embed-min-len: "),
    (["--workloads", "embed", "--embed-max-len", "-3"], "--embed-max-len: -3 is not valid"),
    (["--workloads", "embed", "--embed-min-len", "9", "--embed-max-len", "8"],
     "--embed-min-len and --embed-max-len: the shortest prompt (9) is longer than the longest (8)"),
    (["--workloads", "embed", "--embed-max-len", "4096"],
     "the embed workload needs requests of 4096 tokens"),
    (["--workloads", "embed", "--pooling-task", "embed"], "--pooling-task embed: ab's engines"),
    (["--workloads", "embed", "--engine-loop", "async"],
     "--engine-loop async: the embed workload's engines run the sync loop only"),
    (["--workloads", "embed", "--engine-loop", "both"],
     "--engine-loop both: the embed workload's engines run the sync loop only"),
    (["--workloads", "embed", "--async-scheduling"],
     "--async-scheduling: the embed workload's engines run the sync loop only"),
])
def test_refused_flags_are_one_line_with_exit_2(argv, expected, tmp_path, capsys) -> None:
    # ab's own check: one line, exit 2, nothing written
    refused_in_one_line(argv, expected, tmp_path, capsys)


def test_a_pooler_config_without_the_embed_workload_is_refused(tmp_path, capsys) -> None:
    rc = cli_main(["ab", "--workloads", "churn", "--pooler-config", '{"pooling_type": "MEAN"}',
                   "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("runnerlab ab: error: --pooler-config sets the embed "
                                      "workload, which --workloads churn leaves out"), err


@pytest.fixture
def v2_cannot_embed(monkeypatch):
    """The feature table with V2 unable to run the embed task."""
    rows = [f for f in features.FEATURES if "pooling" in f.label and f.label.endswith(" embed")]
    assert len(rows) == 1, [f.label for f in features.FEATURES]
    table = tuple(dataclasses.replace(f, v2=features.UNSUPPORTED) if f is rows[0] else f
                  for f in features.FEATURES)
    monkeypatch.setattr(features, "FEATURES", table)


def test_a_runner_the_policy_refuses_to_embed_is_named_before_measuring(
        v2_cannot_embed, tmp_path, capsys) -> None:
    rc = cli_main(["ab", "--workloads", "embed", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("runnerlab ab: error: --workloads embed: V2's pooling engine: "), err
    assert err.rstrip().endswith("; measure --runners v1"), err
    assert not (tmp_path / "out" / "ab.json").exists()


# ------------------------------------------------------------------ pieces, by hand


def test_the_floor_worked_by_hand() -> None:
    """3 prompts of 1,000 tokens in all through 3e6 matmul parameters at 2 TFLOP/s:
    1,000 x 2 x 3e6 = 6e9 FLOP, 3 ms; 1,000 embeddings/s, 333,333 tokens/s."""
    f = GemmFloor(prompts=3, prompt_tokens=1000, matmul_params=3e6, parameters=5_000_000,
                  gemm_flops_per_s=2e12)
    assert f.flops == 6e9
    assert f.seconds == pytest.approx(3e-3)
    out = f.to_json()
    assert out["embeddings_per_s"] == pytest.approx(1000.0)
    assert out["prompt_tokens_per_s"] == pytest.approx(1000 / 3e-3)
    assert out["parameters"] == 5_000_000 and out["seconds"] == f.seconds


def test_prompts_are_seeded_and_within_the_lengths() -> None:
    a = embed_prompts(200, 3, 9, vocab=50)
    assert a == embed_prompts(200, 3, 9, vocab=50) != embed_prompts(200, 3, 9, 50, seed=6)
    lengths = [len(p) for p in a]
    assert min(lengths) == 3 and max(lengths) == 9  # both ends drawn over 200 prompts
    ids = np.concatenate([np.asarray(p) for p in a])
    assert ids.min() >= 1 and ids.max() < 50


def test_max_abs_diff_against_numpy() -> None:
    rng = np.random.default_rng(0)
    a = {str(i): torch.from_numpy(rng.standard_normal(8)).float() for i in range(5)}
    b = {k: v + torch.from_numpy(rng.standard_normal(8) * 1e-3).float() for k, v in a.items()}
    expected = max(np.abs(a[k].double().numpy() - b[k].double().numpy()).max() for k in a)
    assert max_abs_diff(a, b) == pytest.approx(expected, rel=0, abs=0)
    assert max_abs_diff(a, a) == 0.0
    assert max_abs_diff(a, {k: a[k] for k in list(a)[:4]}) == float("inf")  # one missing


def test_the_agreement_check_holds_float32_and_float64_and_reports_bfloat16() -> None:
    def vectors(dtype: torch.dtype, shift: float) -> dict[str, torch.Tensor]:
        return {"0": torch.zeros(4, dtype=dtype) + shift, "1": torch.ones(4, dtype=dtype) * 0.5 + shift}

    for dtype in (torch.float32, torch.float64):
        x, near, far = (vectors(dtype, shift) for shift in (0.0, 5e-6, 2e-5))
        assert agreement({"v1": [x], "v2": [near]}, dtype)["agree"] is True
        check = agreement({"v1": [x, x], "v2": [far, far]}, dtype)
        assert check["agree"] is False and check["v1_vs_v2"] == pytest.approx(2e-5, rel=1e-2)
        assert len(disagreements(check)) == 1
        runs = agreement({"v1": [x, far], "v2": [x, x]}, dtype)  # V1's second run drifted
        assert runs["agree"] is False and runs["v1_vs_v2"] == 0.0
        assert disagreements(runs) == [
            f"embed: V1's runs differ by up to {runs['runs']['v1']:.3g} (> 1e-05 in "
            f"{str(dtype).removeprefix('torch.')})"]
    bf16 = agreement({"v1": [vectors(torch.bfloat16, 0.0)], "v2": [vectors(torch.bfloat16, 0.01)]},
                     torch.bfloat16)
    assert bf16["agree"] is None and bf16["tolerance"] is None and bf16["v1_vs_v2"] > 0
    assert disagreements(bf16) == []
    alone = agreement({"v2": [x]}, torch.float32)
    assert alone["v1_vs_v2"] is None and alone["agree"] is True
