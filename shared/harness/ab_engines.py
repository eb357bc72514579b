"""`runnerlab ab`'s engines: one per (runner, engine loop), what each runs with, and the
warnings when the engines compared with each other are not configured alike.

An engine's label is its runner ("v1") when the run has one loop, and runner-loop
("v1-sync", "v2-async") with --engine-loop both; ab.json keys every per-engine result
by it. Engines are ordered loop by loop, V1 before V2 within a loop, so a loop's engines
form one group of the report and one block of the A-B-B-A order.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Iterator, Mapping
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


def build_engines(args: argparse.Namespace,
                  settings: dict) -> dict[str, LLMEngine] | OneEngineAtATime:
    """Every engine up front; under tensor parallelism one at a time (OneEngineAtATime)."""
    from shared.serving.engine import LLMEngine

    specs = engine_specs(settings["runners"], settings["engine_loops"])
    alive = 1 if one_at_a_time(args) else len(specs)  # engines sharing the GPU at once
    builders = {s.label: functools.partial(LLMEngine.from_engine_args, _engine_args(
        args, s.runner, s.loop, concurrency(settings), num_engines=alive)) for s in specs}
    if one_at_a_time(args):
        return OneEngineAtATime(builders)
    return {label: build() for label, build in builders.items()}


def one_at_a_time(args: argparse.Namespace) -> bool:
    """Tensor parallelism: a process joins one torch.distributed group at a time, so ab's
    engines (each with its own worker processes) cannot be alive together."""
    return (getattr(args, "tensor_parallel_size", 1) or 1) > 1


class OneEngineAtATime(Mapping):
    """ab's engines by label, at most one alive: asking for another shuts the live one
    down and builds the other. Each engine's set-up times are those of its first build.
    run_order(..., grouped=True) keeps the rebuilds to about one per workload."""

    def __init__(self, builders: dict[str, Any]):
        self._builders = builders
        self._live: tuple[str, LLMEngine] | None = None
        self.builds: dict[str, int] = dict.fromkeys(builders, 0)

    def __getitem__(self, label: str) -> LLMEngine:
        if self._live is not None and self._live[0] == label:
            return self._live[1]
        self.release()
        engine = self._builders[label]()
        self.builds[label] += 1
        self._live = (label, engine)
        return engine

    def __iter__(self) -> Iterator[str]:
        return iter(self._builders)

    def __len__(self) -> int:
        return len(self._builders)

    def release(self) -> None:
        if self._live is not None:
            # no local may name the engine while free_engines collects: the runner's
            # graphs and buffers are reference cycles, freed by that collection only
            engines, self._live = dict([self._live]), None
            free_engines(engines)


def run_order(labels: list[str], runs: int, grouped: bool = False, flip: bool = False) -> list[str]:
    """A-B-B-A-A-B...: `runs` runs of each engine, alternating which goes first.
    grouped: A-A-A-B-B-B (B first when flip), for engines built one at a time."""
    if grouped:
        return [label for label in (labels[::-1] if flip else labels) for _ in range(runs)]
    order: list[str] = []
    for i in range(runs):
        order += labels if i % 2 == 0 else labels[::-1]
    return order


def free_engines(engines: dict[str, LLMEngine] | OneEngineAtATime) -> None:
    """Drop the engines (the caller holds no other reference) and give their memory back
    to the device, so that the next engines find it: model, KV cache and graphs. The
    dict is emptied."""
    import gc

    import torch

    if isinstance(engines, OneEngineAtATime):
        engines.release()
    else:
        while engines:  # no loop variable: it would keep the last engine past the collection
            engines.popitem()[1].shutdown()
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
            "tensor_parallel_size": engine.config.parallel_config.tensor_parallel_size,
            "batch_invariant": engine.config.batch_invariance.enabled,
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
