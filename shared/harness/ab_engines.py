"""`runnerlab ab`'s engines: one per (runner, engine loop), what each runs with, and the
warnings when the engines compared with each other are not configured alike.

An engine's label is its runner ("v1") when the run has one loop, and runner-loop
("v1-sync", "v2-async") with --engine-loop both; ab.json keys every per-engine result
by it. Engines are ordered loop by loop, V1 before V2 within a loop, so a loop's engines
form one group of the report and one block of the A-B-B-A order.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.harness.ab_args import _engine_args, concurrency

if TYPE_CHECKING:
    from shared.serving.engine import LLMEngine


@dataclass(frozen=True)
class EngineSpec:
    label: str
    runner: str
    loop: str  # "sync" | "async"


def engine_specs(runners: list[str], loops: list[str]) -> list[EngineSpec]:
    both = len(loops) > 1
    return [EngineSpec(f"{r}-{loop}" if both else r, r, loop) for loop in loops for r in runners]


def engine_groups(labels: list[str]) -> list[list[str]]:
    """The engines compared with each other: those of one loop, in order."""
    groups: dict[str, list[str]] = {}
    for label in labels:
        groups.setdefault(label.partition("-")[2], []).append(label)
    return list(groups.values())


def build_engines(args: argparse.Namespace, settings: dict) -> dict[str, LLMEngine]:
    from shared.serving.engine import LLMEngine

    specs = engine_specs(settings["runners"], settings["engine_loops"])
    return {s.label: LLMEngine.from_engine_args(_engine_args(
        args, s.runner, s.loop, concurrency(settings), num_engines=len(specs))) for s in specs}


def run_order(labels: list[str], runs: int) -> list[str]:
    """A-B-B-A-A-B...: `runs` runs of each engine, alternating which goes first."""
    order: list[str] = []
    for i in range(runs):
        order += labels if i % 2 == 0 else labels[::-1]
    return order


def free_engines(engines: dict[str, LLMEngine]) -> None:
    """Drop the engines (the caller holds no other reference) and give their memory back
    to the device, so that the next engines find it: model, KV cache and graphs."""
    import gc

    import torch

    engines.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def describe_engines(engines: dict[str, LLMEngine], settings: dict) -> dict[str, dict[str, Any]]:
    """What each engine runs with, read back from the engine itself (for ab.json)."""
    out = {}
    for spec in engine_specs(settings["runners"], settings["engine_loops"]):
        engine = engines[spec.label]
        cc = engine.config.compilation_config
        out[spec.label] = {
            "runner": spec.runner,
            "engine_loop": "async" if engine.async_scheduling else "sync",
            "cudagraph_mode": cc.cudagraph_mode,
            "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes),
            "capture_sizes": summarize_sizes(cc.cudagraph_capture_sizes),
            "max_num_seqs": engine.config.scheduler_config.max_num_seqs,
        }
    return out


def summarize_sizes(sizes: list[int]) -> str:
    """'1,2,4,8..512 (n=67)': the ladder's start, its end and its length."""
    if not sizes:
        return "none"
    if len(sizes) <= 5:
        return ",".join(map(str, sizes))
    return f"{','.join(map(str, sizes[:4]))}..{sizes[-1]} (n={len(sizes)})"


# What the engines compared with each other must share, and the words for it.
COMPARED = (("engine_loop", "engine loop"), ("cudagraph_mode", "graph mode"),
            ("cudagraph_capture_sizes", "capture sizes"))


def difference_warnings(engines: dict[str, dict[str, Any]]) -> list[str]:
    """One line per setting in which the runners of one group (one loop) differ."""
    warnings = []
    for labels in engine_groups(list(engines)):
        for key, words in COMPARED:
            values = [engines[label][key] for label in labels]
            if any(v != values[0] for v in values):
                shown = "capture_sizes" if key == "cudagraph_capture_sizes" else key
                each = ", ".join(f"{label.upper()} {engines[label][shown]}" for label in labels)
                warnings.append(f"the runners differ in {words} ({each}): their times compare "
                                "different engines, not only different runners")
    return warnings
