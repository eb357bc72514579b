"""`runnerlab ab --quick` end to end on CPU: the table, ab.json with its documented
fields, ab.png, and identical tokens from both runners."""

from __future__ import annotations

import json

from shared.bench.ab import ab_main


def test_ab_quick_writes_json_and_png(tmp_path, capsys) -> None:
    rc = ab_main(["--quick", "--output-dir", str(tmp_path), "--workloads", "decode,churn"])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "ab.json").read_text())
    for key in ("model", "dtype", "device", "settings", "workloads", "tokens_identical",
                "startup_s", "graph_capture_s", "weight_bytes"):
        assert key in report, key
    assert report["tokens_identical"] is True
    decode = report["workloads"]["decode"]
    assert [e["label"] for e in decode] == ["b1", "b4"]
    for entry in decode:
        for runner in ("v1", "v2"):
            stats = entry[runner]
            assert stats["wall_ms"]["n"] == 2 * report["settings"]["steps"]  # A-B-B-A: 2 runs each
            for stage in ("preprocess", "forward", "postprocess", "sample"):
                assert stats["stages_ms"][stage]["median"] > 0
    assert "churn" in report["workloads"]
    png = (tmp_path / "ab.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "V2/V1" in out and "tokens identical across runners: True" in out


def test_ab_profile_writes_a_trace_per_runner(tmp_path) -> None:
    rc = ab_main(["--quick", "--output-dir", str(tmp_path), "--workloads", "churn", "--profile"])
    assert rc == 0
    traces = sorted(p.name for p in tmp_path.glob("trace_*.json"))
    assert traces == ["trace_v1_live4.json", "trace_v2_live4.json"]
    trace = json.loads((tmp_path / traces[1]).read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("model_runner" in n or "runner_v2" in n or "aten::" in n for n in names)
