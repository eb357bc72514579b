"""`runnerlab ab --workloads embed`'s flags, default sizes and checks. The rest of ab's
command line is shared/harness/ab_args.py (which calls these); the run itself is
shared/harness/embed_workload.py.

The embed workload: one pooling engine per runner (pooling_task='embed'), --embed-prompts
prompts of lengths uniform in [--embed-min-len, --embed-max-len] (seeded) embedded
together, beside the GEMM-rate floor.

Checks return the refusal's words (or None) rather than raising: ab_args turns them into
its Refused, and this module stays below it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from policy.cli_args import bounded_int

EMBED = "embed"
# ab's flags that only the embed workload reads (refused without it)
EMBED_FLAGS = {"embed_prompts": "--embed-prompts", "embed_min_len": "--embed-min-len",
               "embed_max_len": "--embed-max-len"}
# A step holds at most this many prompts: with the GPU's shortest prompt (32 tokens) 256
# fill ab's 8192-token budget, so the token budget, not the seat count, bounds a step.
MAX_EMBED_SEATS = 256
# Why every pooling engine runs the sync loop: the policy refuses async_scheduling with a
# pooling_task (policy/engine_args.py).
SYNC_ONLY = ("a pooling engine runs prefill only and samples no token, so it has no next "
             "step to schedule ahead (the policy refuses async scheduling with pooling_task)")


@dataclass(frozen=True)
class EmbedSizes:
    prompts: int
    min_len: int
    max_len: int


GPU_EMBED_SIZES = EmbedSizes(1024, 32, 512)
# On the CPU V2's kernels run under the Triton interpreter, and every prompt token goes
# through the model on one torch thread: 32 short prompts keep the run to a few seconds.
CPU_EMBED_SIZES = EmbedSizes(32, 8, 64)
QUICK_EMBED_SIZES = EmbedSizes(8, 4, 16)


def add_embed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("embed workload (--workloads embed; not in the default list)")
    g.add_argument("--embed-prompts", type=bounded_int(1), default=None,
                   help=f"prompts embedded together per run (default {GPU_EMBED_SIZES.prompts} "
                   f"on a GPU, {CPU_EMBED_SIZES.prompts} on the CPU)")
    g.add_argument("--embed-min-len", type=bounded_int(1), default=None,
                   help="shortest prompt, in tokens; lengths are uniform in [min, max], "
                   f"seeded (default {GPU_EMBED_SIZES.min_len} on a GPU, "
                   f"{CPU_EMBED_SIZES.min_len} on the CPU)")
    g.add_argument("--embed-max-len", type=bounded_int(1), default=None,
                   help=f"longest prompt, in tokens (default {GPU_EMBED_SIZES.max_len} on a "
                   f"GPU, {CPU_EMBED_SIZES.max_len} on the CPU)")


def default_embed_sizes(device: str, quick: bool) -> EmbedSizes:
    if quick:
        return QUICK_EMBED_SIZES
    return GPU_EMBED_SIZES if device == "cuda" else CPU_EMBED_SIZES


def embed_settings(args: argparse.Namespace, device: str, loops: tuple[str, ...]) -> dict[str, Any]:
    """The embed workload's part of ab's settings (ab.json's settings["embed"]). Its
    engines run the sync loop whatever the others run (SYNC_ONLY)."""
    sizes = default_embed_sizes(device, args.quick)
    note = None if tuple(loops) == ("sync",) else (
        f"the embed workload's engines ran the sync loop (the others: {' and '.join(loops)}): "
        + SYNC_ONLY)
    prompts = args.embed_prompts or sizes.prompts
    return {
        "prompts": prompts,
        "min_len": args.embed_min_len or sizes.min_len,
        "max_len": args.embed_max_len or sizes.max_len,
        "max_num_seqs": min(prompts, MAX_EMBED_SEATS),
        "engine_loop": "sync",
        "engine_loop_note": note,
    }


def embed_cpu_cut(args: argparse.Namespace) -> str | None:
    """What the CPU default cut from the GPU's, for the sizes no flag set."""
    cpu, gpu = CPU_EMBED_SIZES, GPU_EMBED_SIZES
    cuts = []
    if args.embed_prompts is None:
        cuts.append(f"embed {cpu.prompts} prompts (GPU {gpu.prompts})")
    if args.embed_min_len is None and args.embed_max_len is None:
        cuts.append(f"embed prompt lengths {cpu.min_len}..{cpu.max_len} "
                    f"(GPU {gpu.min_len}..{gpu.max_len})")
    return "; ".join(cuts) or None


def embed_flag_refusal(args: argparse.Namespace, workloads: list[str],
                       settings: dict[str, Any]) -> str | None:
    """An embed flag (or the engine flag --pooler-config) without the embed workload;
    lengths out of order; the engine flag --pooling-task (it would make every engine a
    pooling engine)."""
    if EMBED not in workloads:
        # (--pooler-config: an engine flag that only the embed workload's engines get)
        for name, flag in {**EMBED_FLAGS, "pooler_config": "--pooler-config"}.items():
            if getattr(args, name, None) is not None:
                return (f"{flag} sets the embed workload, which --workloads "
                        f"{','.join(workloads)} leaves out")
        return None
    if getattr(args, "pooling_task", None) is not None:
        return (f"--pooling-task {args.pooling_task}: ab's engines generate; the embed workload "
                "builds its own pooling engines (pooling_task='embed'); leave it out")
    s = settings[EMBED]
    if s["min_len"] > s["max_len"]:
        given = [f for n, f in EMBED_FLAGS.items() if n != "embed_prompts" and getattr(args, n)]
        return (f"{' and '.join(given) or 'the embed lengths'}: the shortest prompt "
                f"({s['min_len']}) is longer than the longest ({s['max_len']}); give "
                "--embed-min-len <= --embed-max-len")
    return None


def embed_loop_refusal(requested: str | None, source: str) -> str | None:
    """The embed workload alone: its engines are the run's, and they run sync only."""
    if requested in (None, "sync"):
        return None
    return f"{source}: the embed workload's engines run the sync loop only: {SYNC_ONLY}; " \
           "give --engine-loop sync, or leave it out"
