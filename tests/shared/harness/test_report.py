"""The ab report's per-step rows: the GPU-time rows appear where the run measured them,
each runner's median / p90 under its column and the V2/V1 ratio of medians beside."""

from __future__ import annotations

from shared.harness.report import _print_entry


def _engine(wall: float, fwd: float | None, step: float | None) -> dict:
    e = {"wall_ms": {"median": wall, "p90": wall + 0.5}}
    if fwd is not None:
        e["forward_gpu_ms"] = {"median": fwd, "p90": fwd + 0.25}
    if step is not None:
        e["step_gpu_ms"] = {"median": step, "p90": step + 0.125}
    return e


def _rows(capsys, v1: dict, v2: dict) -> dict[str, list[str]]:
    _print_entry({"label": "b1", "v1": v1, "v2": v2}, ["v1", "v2"], both=True)
    return {line.split()[1] + (" GPU" if "GPU" in line else ""): line.split()[-3:]
            for line in capsys.readouterr().out.splitlines()}


def test_step_gpu_row_beside_the_forward(capsys):
    rows = _rows(capsys, _engine(2.0, 1.5, 1.75), _engine(1.0, 0.75, 1.25))
    assert rows["fwd GPU"] == ["1.500/1.750", "0.750/1.000", "0.50"]
    assert rows["step GPU"] == ["1.750/1.875", "1.250/1.375", "0.71"]


def test_no_gpu_rows_where_none_was_measured(capsys):
    rows = _rows(capsys, _engine(2.0, None, None), _engine(1.0, None, None))
    assert "fwd GPU" not in rows and "step GPU" not in rows and rows["wall"][-1] == "0.50"
