"""`runnerlab ab`'s engine loop: which loop (sync, async or both) every runner runs, from
--engine-loop, the engine flag --[no-]async-scheduling and what the policy's feature
table says each runner can run; the spec and embed workloads' own rules on top."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from policy import features
from shared.harness.ab_args import Refused
from shared.harness.embed_args import EMBED, embed_loop_refusal
from shared.harness.spec_args import SPEC, SpecLoop, spec_engine_loop

ASYNC_FEATURE = "async scheduling"  # the policy.features row that says which runner has it


@dataclass(frozen=True)
class EngineLoops:
    """The engine loops every runner runs, in measuring order, and why."""

    loops: tuple[str, ...]  # ("sync",), ("async",) or ("sync", "async")
    requested: str  # "default" or the --engine-loop value (--async-scheduling: "async")
    warning: str | None = None  # the default fell back to sync: which runner forced it
    spec: SpecLoop | None = None  # the spec workload's loop, when it runs


def async_capable(runner: str) -> bool:
    """Whether the policy's feature table says `runner` can run async scheduling."""
    return features.feature(ASYNC_FEATURE).status(runner) == features.SUPPORTED


def resolve_engine_loops(args: argparse.Namespace, runners: list[str]) -> EngineLoops:
    """--engine-loop (or the engine flag --[no-]async-scheduling, which must agree with it)
    against what each runner can run. Every runner runs the same loop: a runner that
    cannot run async scheduling makes the default sync and refuses async and both. The
    spec workload runs one loop (spec_args.spec_engine_loop); alone, it is the run's."""
    requested, source = _requested_loop(args)
    loops = _runner_loops(requested, source, runners)
    workloads = args.workloads or []
    if workloads == [EMBED]:  # its pooling engines are the report's, and run sync only
        refusal = embed_loop_refusal(requested, source)
        if refusal:
            raise Refused(refusal)
        return EngineLoops(("sync",), loops.requested)
    if SPEC not in workloads:
        return loops
    # the default configs are draft_model ones (spec_args.default_spec_configs)
    configs = getattr(args, "spec_configs", None) or [{"method": "draft_model"}]
    spec = spec_engine_loop(requested, runners, alone=workloads == [SPEC],
                            methods=[c.get("method", "draft_model") for c in configs])
    if spec.refusal:
        raise Refused(spec.refusal)
    if workloads == [SPEC]:  # (its engines are the report's: spec_workload.run_spec)
        return EngineLoops((spec.loop,), loops.requested, spec.note, spec)
    return dataclasses.replace(loops, spec=spec)


def _runner_loops(requested: str | None, source: str, runners: list[str]) -> EngineLoops:
    unable = [r for r in runners if not async_capable(r)]
    if requested is None:
        if not unable:
            return EngineLoops(("async",), "default")
        status = features.feature(ASYNC_FEATURE).status(unable[0])
        return EngineLoops(("sync",), "default", warning=(
            f"engine loop sync for every runner: {_names(unable)} cannot run async scheduling "
            f"(policy.features '{ASYNC_FEATURE}': {status}), and ab compares the runners "
            "under one loop"))
    if requested != "sync" and unable:
        able = [r for r in runners if r not in unable]
        fix = "--engine-loop sync" + (f", or --runners {','.join(able)}" if able else "")
        raise Refused(f"{source}: {_names(unable)} cannot run async scheduling (policy.features "
                      f"'{ASYNC_FEATURE}': {features.feature(ASYNC_FEATURE).status(unable[0])}); "
                      f"use {fix}")
    loops = ("sync", "async") if requested == "both" else (requested,)
    return EngineLoops(loops, requested)


def _requested_loop(args: argparse.Namespace) -> tuple[str | None, str]:
    """(the loop asked for or None, the flag that asked) from --engine-loop and the
    engine flag --[no-]async-scheduling, refusing a contradiction."""
    loop = args.engine_loop
    flag = getattr(args, "async_scheduling", None)  # absent unless given
    if flag is None:
        return loop, f"--engine-loop {loop}"
    name, implied = ("--async-scheduling", "async") if flag else ("--no-async-scheduling", "sync")
    if loop is not None and loop != implied:
        raise Refused(f"{name} contradicts --engine-loop {loop}; give --engine-loop only")
    return implied, name if loop is None else f"--engine-loop {loop}"


def _names(runners: list[str]) -> str:
    return " and ".join(r.upper() for r in runners)
