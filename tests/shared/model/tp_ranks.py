"""Tensor-parallel ranks for the model tests: N spawned processes on gloo over 127.0.0.1,
each building its rank's model and stepping it through a paged KV cache (TORCH backend).

`run_ranks` starts the processes, waits for them with a timeout and kills whatever is
left in a `finally`; each rank saves its results (or its traceback) in a folder the test
reads back. The same `run_case` computes the one-process (SINGLE) reference.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import torch

STARTUP_TIMEOUT_S = 60  # dist.init_process_group, and every collective
JOIN_TIMEOUT_S = 120

# (tokens of this row, start position, block ids), decodes first; the last two steps are
# batch-1 decodes (the GEMV path where it is on).
_A = [11, 12, 13, 14, 15, 16, 17]
_B = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
STEPS = [
    [(_A, 0, [5, 2, 6]), (_B[:5], 0, [7, 0, 3])],
    [([40], 7, [5, 2, 6]), (_B[5:], 5, [7, 0, 3])],
    [([41], 8, [5, 2, 6])],
    [([42], 9, [5, 2, 6])],
]


GEMV_EPILOGUES = ("rope", "silu", "residual", None)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    preset: str
    overrides: tuple[tuple[str, object], ...] = ()
    dtype: str = "float64"
    gemv: bool = False  # batch-1 steps through the fused GEMVs (Triton interpreter on CPU)


def preset_config(preset: str, overrides=()):
    from policy.model_config import parse_hf_config
    from policy.presets import preset_config_path

    raw = json.loads(preset_config_path(preset).read_text())
    raw.update(dict(overrides))
    hf_config, _ = parse_hf_config(raw)
    return hf_config


def run_case(case: Case) -> dict[str, torch.Tensor]:
    """Build the case's model for the group in force (`building_for`), dummy weights
    seed 0, and step it -> {"logits": [T, V], "gemv_calls": GEMV launches per epilogue
    (GEMV_EPILOGUES order)}."""
    from shared.model import load_model
    from shared.model.kernels import fused_ops, gemv
    from tests.oracles.paged_attention import PagedHarness

    dtype = getattr(torch, case.dtype)
    model = load_model(preset_config(case.preset, case.overrides), load_format="dummy",
                       dtype=dtype, device="cpu", seed=0)
    harness = PagedHarness(model, num_blocks=8, block_size=4)
    real_use_fused, real_gemv = fused_ops.use_fused, gemv.gemv
    calls = []
    if case.gemv:  # the CUDA dispatch, on CPU: every fused kernel under the interpreter
        fused_ops.use_fused = lambda t: True
        gemv.gemv = lambda *a, **kw: calls.append(kw.get("epilogue")) or real_gemv(*a, **kw)
    try:
        logits = torch.cat([harness.step(rows) for rows in STEPS])
    finally:
        fused_ops.use_fused, gemv.gemv = real_use_fused, real_gemv
    return {"logits": logits,
            "gemv_calls": torch.tensor([calls.count(e) for e in GEMV_EPILOGUES])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world_size: int, port: int, out_dir: str, cases: list[Case]) -> None:
    """One rank: join the gloo group, run every case for its TPGroup, save the results."""
    import torch.distributed as dist

    from shared.distributed.group import TPGroup, building_for

    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        try:
            cpu_group = dist.new_group(backend="gloo")
            group = TPGroup(rank, world_size, device_group=dist.group.WORLD, cpu_group=cpu_group)
            results = {}
            for case in cases:
                with building_for(group):
                    for key, value in run_case(case).items():
                        results[f"{case.name}/{key}"] = value
            torch.save(results, out / f"rank{rank}.pt")
        finally:
            dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(world_size: int, cases: list[Case], out_dir: Path) -> tuple[list[dict], list[int]]:
    """Spawn `world_size` ranks, wait (bounded) -> (each rank's results, their pids). No
    rank outlives this call: stragglers are killed and reaped in the finally."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world_size, port, str(out_dir), cases),
                         daemon=True) for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(JOIN_TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    errors = [(out_dir / f"rank{r}.err") for r in range(world_size)]
    messages = [f"rank {r}:\n{e.read_text()}" for r, e in enumerate(errors) if e.exists()]
    codes = [p.exitcode for p in procs]
    assert not messages and codes == [0] * world_size, (codes, "\n".join(messages))
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)], [p.pid for p in procs]


def pids_alive(pids: list[int]) -> list[int]:
    """The pids among `pids` that still exist (a reaped process has no /proc entry)."""
    return [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
