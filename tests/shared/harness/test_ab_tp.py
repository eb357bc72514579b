"""`runnerlab ab --tensor-parallel-size 2` on CPU (gloo): both runners measured under TP,
their tokens identical, the engines built one at a time (a process joins one group at a
time) with no worker left behind; the workloads that keep several engines alive are
refused by name."""

from __future__ import annotations

import contextlib
import io
import json

from shared.harness import ab_engines
from shared.harness.ab import ab_main
from tests.shared.serving.tp_fakes import live_children


def test_ab_under_tensor_parallelism(tmp_path, monkeypatch):
    builds = []
    real = ab_engines.OneEngineAtATime.__getitem__

    def counting(self, label):
        live = self._live[0] if self._live is not None else None
        if live != label:
            builds.append(label)
        return real(self, label)

    monkeypatch.setattr(ab_engines.OneEngineAtATime, "__getitem__", counting)
    before = {p.pid for p in live_children()}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = ab_main(["--quick", "--steps", "2", "--batch-sizes", "1,2", "--workloads", "decode",
                      "--repeats", "1",
                      "--tensor-parallel-size", "2", "--output-dir", str(tmp_path)])
    assert rc == 0, stdout.getvalue()
    report = json.loads((tmp_path / "ab.json").read_text())
    assert report["tokens_identical"] is True
    assert {e["tensor_parallel_size"] for e in report["engines"].values()} == {2}
    assert any("one at a time" in w for w in report["warnings"])
    assert "tensor parallel 2" in stdout.getvalue()
    # every decode batch size measured for both runners, beside each other
    assert [e["label"] for e in report["workloads"]["decode"]] == ["b1", "b2"]
    for entry in report["workloads"]["decode"]:
        assert {"v1", "v2"} <= entry.keys()
    # the head visits each engine once, then one rebuild per workload boundary at most
    assert builds[:2] == ["v1", "v2"] and len(builds) <= 2 + 1 + 2
    assert {p.pid for p in live_children()} <= before


def test_ab_refuses_spec_under_tensor_parallelism(capsys):
    rc = ab_main(["--quick", "--workloads", "spec", "--tensor-parallel-size", "2",
                  "--spec-configs", '[{"method": "ngram", "num_speculative_tokens": 2}]'])
    err = capsys.readouterr().err
    assert rc == 2 and "--tensor-parallel-size 2" in err and "spec" in err
