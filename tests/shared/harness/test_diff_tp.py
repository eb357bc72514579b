"""`runnerlab diff --tensor-parallel-size 2`: every runner engine gets a twin on 2 gloo
ranks, compared exactly with the others; the flag's bad values are refused."""

from __future__ import annotations

import contextlib
import io
import json

from shared.harness.diff import split_engine, with_tp_twins
from shared.harness.diff_cli import diff_main


def test_engine_names_carry_the_size():
    assert split_engine("v2-async-tp2") == ("v2-async", 2)
    assert split_engine("v1") == ("v1", 1)
    assert with_tp_twins(["v1", "v2", "hf"], 2) == ["v1", "v2", "hf", "v1-tp2", "v2-tp2"]
    assert with_tp_twins(["v1"], 1) == ["v1"]


def test_diff_compares_each_runner_with_its_tp_twin():
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = diff_main(["--scenarios", "seeded_preemption", "--engines", "v1,v2",
                        "--tensor-parallel-size", "2", "--json"])
    doc = json.loads(stdout.getvalue())
    assert rc == 0 and doc["all_agree"], stdout.getvalue()[-2000:]
    for scenario in doc["scenarios"]:
        assert scenario["engines"] == ["v1", "v2", "v1-tp2", "v2-tp2"]
        pairs = {(p["a"], p["b"]): p for p in scenario["pairs"]}
        for pair in (("v1", "v1-tp2"), ("v2", "v2-tp2"), ("v1-tp2", "v2-tp2")):
            assert pairs[pair]["identical"] and pairs[pair]["requests_compared"] > 0


def test_a_size_below_one_is_refused(capsys):
    assert diff_main(["--tensor-parallel-size", "0"]) == 2
    assert "--tensor-parallel-size 0" in capsys.readouterr().err
