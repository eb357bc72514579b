"""`runnerlab ab`'s command line: its flags, the default sizes per device, and the checks
that refuse a flag that cannot be honoured (one line, naming the flag) before anything
is measured. shared/harness/ab.py runs what these settings describe."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from policy.cli_args import (
    OneLineArgumentParser,
    bounded_int,
    cpu_noop_refusal,
    int_list,
    name_list,
)
from policy.kernel_options import KernelOptions
from shared.harness import workloads as wl
from shared.harness.embed_args import (
    EMBED,
    add_embed_args,
    embed_cpu_cut,
    embed_flag_refusal,
    embed_settings,
)
from shared.harness.measure import decode_max_tokens
from shared.harness.spec_args import (
    CPU_SPEC_SIZES,
    GPU_SPEC_SIZES,
    SPEC,
    add_spec_args,
    spec_flag_refusal,
    spec_settings,
    split_kernel_options,
)

if TYPE_CHECKING:
    from shared.harness.ab_loops import EngineLoops

PROG = "runnerlab ab"
RUNNERS = ("v1", "v2")
WORKLOADS = ("decode", "prefill", "churn", "throughput")  # the defaults' (GPU: all four)
# spec and embed only when asked for (shared/harness/spec_args.py, embed_args.py)
ALL_WORKLOADS = WORKLOADS + (SPEC, EMBED)
ENGINE_LOOPS = ("sync", "async", "both")
# ab's own flags that only the decode workload reads (refused without it)
DECODE_FLAGS = {"batch_sizes": "--batch-sizes", "prompt_len": "--prompt-len",
                "steps": "--steps", "warmup": "--warmup"}


@dataclass(frozen=True)
class Sizes:
    """What a run measures when no flag says otherwise."""

    batches: tuple[int, ...]  # decode batch ladder
    prompt_len: int  # decode prompt length
    steps: int  # measured decode steps per run
    warmup: int  # excluded decode warm-up steps per run
    prefill: tuple[int, int]  # prompts x prompt length
    churn: tuple[int, int]  # live requests x measured steps
    workloads: tuple[str, ...]


GPU_SIZES = Sizes((1, 8, 32, 64, 128, 256, 512, 1024), 128, 30, 5, (16, 2048), (64, 100),
                  WORKLOADS)
# Without a GPU, V2's kernels run under the Triton interpreter, where a decode step of
# a few dozen requests costs tens of times V1's, and V2's decode at batch 32 was the
# largest part of the older CPU default (batch sizes 1,8,32). Together with one torch
# thread (set_threads) these sizes keep the default run to seconds on two cores.
CPU_SIZES = Sizes((1, 4, 16), 16, 6, 1, (4, 256), (8, 16), ("decode", "prefill", "churn"))
QUICK_SIZES = Sizes((1, 4), 16, 3, 1, (2, 64), (4, 6), ("decode", "prefill", "churn"))
RUNS_PER_RUNNER = 2  # A-B-B-A
THROUGHPUT_RUNS_PER_RUNNER = 3


class Refused(Exception):
    """A flag that cannot be honoured as given; the message names it."""


def build_parser() -> argparse.ArgumentParser:
    from policy.explain import add_engine_args

    p = OneLineArgumentParser(prog=PROG, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, require_model=False)  # `runnerlab ab` alone: the small default
    g = p.add_argument_group("A/B")
    g.add_argument("--runners", type=name_list("runner", RUNNERS), default=None,
                   help="comma list of the runners to measure (default v1,v2; one runner: "
                   "its stage times, no ratios). --model-runner v1|v2 is the same as "
                   "--runners v1|v2")
    g.add_argument("--workloads", type=name_list("workload", ALL_WORKLOADS), default=None,
                   help="comma list of " + ",".join(ALL_WORKLOADS) + " (default: decode,"
                   "prefill,churn, plus throughput on a GPU; spec and embed only when named)")
    g.add_argument("--engine-loop", choices=ENGINE_LOOPS, default=None,
                   help="the engine loop every runner runs: sync, async (async scheduling) or "
                   "both (each workload under each loop; engines v1-sync, v1-async, ...). "
                   "Default: async where every runner has it (policy.features), else sync")
    g.add_argument("--batch-sizes", type=int_list("batch size", 1), default=None,
                   help="decode batch ladder, e.g. 1,8,32,64")
    g.add_argument("--prompt-len", type=bounded_int(1), default=None, help="decode prompt length")
    g.add_argument("--steps", type=bounded_int(1), default=None,
                   help="measured decode steps per run")
    g.add_argument("--warmup", type=bounded_int(0), default=None,
                   help="excluded decode warm-up steps per run")
    g.add_argument("--repeats", type=bounded_int(1), default=None,
                   help=f"runs per runner of every workload, in alternating order (default "
                   f"{RUNS_PER_RUNNER}; throughput {THROUGHPUT_RUNS_PER_RUNNER})")
    g.add_argument("--threads", type=bounded_int(1), default=None,
                   help="torch intra-op CPU threads (default on CPU: 1, unless OMP_NUM_THREADS "
                   "is set; on CUDA: torch's default)")
    g.add_argument("--quick", action="store_true", help="a few seconds: tiny sizes (CI)")
    g.add_argument("--output-dir", default="ab-results", help="where ab.json and ab.png go")
    g.add_argument("--profile", action="store_true", help="write a torch.profiler trace per runner")
    g.add_argument("--nvtx", action="store_true", help="emit NVTX ranges (for nsys; CUDA only)")
    add_spec_args(p)
    add_embed_args(p)
    return p


def select_runners(args: argparse.Namespace) -> list[str]:
    """The runners to measure, in V1, V2 order: --runners, or --model-runner's one."""
    forced = getattr(args, "model_runner", None)
    if forced is not None:
        if args.runners is not None:
            raise Refused("--model-runner and --runners both name the runners; give --runners only")
        if forced == "auto":
            raise Refused("--model-runner auto: ab measures the runners it is told to; "
                          "use --runners v1,v2 (the default), --runners v1 or --runners v2")
        return [forced]
    return sorted(args.runners or RUNNERS, key=RUNNERS.index)


def _settings(args: argparse.Namespace, device: str, runners: list[str],
              loops: EngineLoops) -> dict[str, Any]:
    sizes = _default_sizes(args, device)
    workloads = args.workloads or list(sizes.workloads)
    repeats = {w: args.repeats or (THROUGHPUT_RUNS_PER_RUNNER if w == "throughput"
                                   else RUNS_PER_RUNNER) for w in workloads}
    settings = {
        "runners": runners,
        "engine_loops": list(loops.loops),
        "engine_loop_requested": loops.requested,
        "engine_loop_warning": loops.warning,
        "batches": sorted(set(args.batch_sizes or sizes.batches)),  # a ladder, drawn in order
        "workloads": workloads,
        "prompt_len": args.prompt_len or sizes.prompt_len,
        "steps": args.steps or sizes.steps,
        "warmup": args.warmup if args.warmup is not None else sizes.warmup,
        "prefill": sizes.prefill,
        "churn": sizes.churn,
        "repeats": repeats,
        "defaults": "quick" if args.quick else device,
        "defaults_note": _cpu_default_note(args, sizes, workloads) if sizes is CPU_SIZES else None,
    }
    if SPEC in workloads:
        settings[SPEC] = spec_settings(args, device, loops.spec)
    if EMBED in workloads:
        settings[EMBED] = embed_settings(args, device, loops.loops)
    return settings


def _default_sizes(args: argparse.Namespace, device: str) -> Sizes:
    if args.quick:  # the GPU keeps its prompt length: kernels for its shapes
        return QUICK_SIZES if device != "cuda" else dataclasses.replace(
            QUICK_SIZES, prompt_len=GPU_SIZES.prompt_len)
    return GPU_SIZES if device == "cuda" else CPU_SIZES


def _cpu_default_note(args: argparse.Namespace, cpu: Sizes, workloads: list[str]) -> str | None:
    """What the CPU default cut from the GPU's, for the sizes no flag set."""
    gpu, cuts = GPU_SIZES, []
    if "decode" in workloads:
        if args.batch_sizes is None:
            cuts.append(f"decode batch sizes {','.join(map(str, cpu.batches))} "
                        f"(GPU {gpu.batches[0]}..{gpu.batches[-1]})")
        if args.steps is None:
            cuts.append(f"{cpu.steps} measured steps (GPU {gpu.steps})")
        if args.warmup is None:
            cuts.append(f"{cpu.warmup} warm-up step (GPU {gpu.warmup})")
        if args.prompt_len is None:
            cuts.append(f"decode prompts of {cpu.prompt_len} tokens (GPU {gpu.prompt_len})")
    if "prefill" in workloads:
        cuts.append(f"prefill {cpu.prefill[0]}x{cpu.prefill[1]} (GPU {gpu.prefill[0]}x{gpu.prefill[1]})")
    if "churn" in workloads:
        cuts.append(f"churn {cpu.churn[0]} live for {cpu.churn[1]} steps "
                    f"(GPU {gpu.churn[0]} for {gpu.churn[1]})")
    if SPEC in workloads and args.spec_prompt_len is None and args.spec_max_tokens is None:
        cuts.append(f"spec prompts of {CPU_SPEC_SIZES.prompt_len} tokens, "
                    f"{CPU_SPEC_SIZES.max_tokens} output tokens (GPU {GPU_SPEC_SIZES.prompt_len}, "
                    f"{GPU_SPEC_SIZES.max_tokens})")
    if EMBED in workloads and embed_cpu_cut(args):
        cuts.append(embed_cpu_cut(args))
    if args.workloads is None:
        cuts.append("no throughput workload (GPU: nano-vllm's 256 requests)")
    if not cuts:
        return None
    return "CPU default, smaller than a GPU's (each flag overrides its part): " + "; ".join(cuts)


def needed_len(settings: dict, workload: str) -> int:
    """The longest request (prompt + output tokens) a workload adds."""
    if workload == "decode":
        return settings["prompt_len"] + decode_max_tokens(settings["warmup"], settings["steps"])
    if workload == "prefill":
        return settings["prefill"][1] + 1
    if workload == "churn":
        return wl.CHURN_PROMPT_LEN[1] + wl.CHURN_MAX_TOKENS[1]
    if workload == SPEC:  # (the scheduler trims drafts at max_model_len)
        return settings[SPEC]["prompt_len"] + settings[SPEC]["max_tokens"]
    if workload == EMBED:  # prompts only: a pooling request generates nothing
        return settings[EMBED]["max_len"]
    return wl.THROUGHPUT_MAX_LEN


def concurrency(settings: dict) -> int:
    """How many requests must run together for the workloads to be what they say."""
    needs = [1]
    if "decode" in settings["workloads"]:
        needs.append(max(settings["batches"]))
    if "churn" in settings["workloads"]:
        needs.append(settings["churn"][0])
    if SPEC in settings["workloads"]:
        needs.append(settings[SPEC]["batch"])
    if "throughput" in settings["workloads"]:
        # nano-vllm's workload runs as many of its 256 requests at once as the engine
        # admits: the engine gets the decode ladder's top (the default's 1024 on a GPU),
        # whether or not the ladder itself runs, as every published throughput run had.
        needs.append(max(settings["batches"]))
    return max(needs)


def check_flags(args: argparse.Namespace, settings: dict, device: str) -> None:
    """Refuse what would be ignored or would quietly change what is measured."""
    workloads, runners = settings["workloads"], settings["runners"]
    if "decode" not in workloads:
        for name, flag in DECODE_FLAGS.items():
            if getattr(args, name) is not None:
                raise Refused(f"{flag} sets the decode workload, which --workloads "
                              f"{','.join(workloads)} leaves out")
    refusal = spec_flag_refusal(args, workloads) or embed_flag_refusal(args, workloads, settings)
    if refusal:
        raise Refused(refusal)
    tp = getattr(args, "tensor_parallel_size", 1) or 1
    if tp > 1 and (SPEC in workloads or EMBED in workloads):
        raise Refused(f"--workloads {','.join(workloads)} with --tensor-parallel-size {tp}: the "
                      "spec and embed workloads keep several engines alive at once, and a "
                      "process joins one tensor-parallel group at a time; run them with "
                      "--tensor-parallel-size 1, or measure decode, prefill, churn and "
                      "throughput under TP")
    share = getattr(args, "gpu_memory_utilization", None)
    engines = len(runners) * len(settings["engine_loops"])
    if share is not None and device == "cuda" and share * engines > 1:
        raise Refused(f"--gpu-memory-utilization {share} is each engine's share of the GPU, and "
                      f"{engines} engines share it ({share * engines:.2f} in all); give at "
                      f"most {1 / engines:.2f}, or leave it out")
    if device != "cuda":
        if args.nvtx:
            raise Refused("--nvtx: NVTX ranges need a CUDA device; this run is on the CPU")
        refusal = cpu_noop_refusal(args, device)
        if refusal:
            raise Refused(refusal)
    seqs = getattr(args, "max_num_seqs", None)
    if seqs is not None and seqs < concurrency(settings):
        raise Refused(f"--max-num-seqs {seqs} is below the {concurrency(settings)} requests the "
                      "workloads run together (the largest --batch-sizes, churn's live "
                      "requests or --spec-batch); raise it or leave it out")


# what lowers each workload's longest request (the others: drop the workload)
SHORTER = {"decode": "lower --prompt-len / --steps",
           SPEC: "lower --spec-prompt-len / --spec-max-tokens", EMBED: "lower --embed-max-len"}


def check_lengths(settings: dict, max_model_len: int) -> None:
    for workload in settings["workloads"]:
        need = needed_len(settings, workload)
        if need > max_model_len:
            raise Refused(
                f"the {workload} workload needs requests of {need} tokens (prompt + output), "
                f"more than max_model_len={max_model_len}; raise --max-model-len, or "
                + SHORTER.get(workload, f"drop {workload} from --workloads"))


def set_threads(requested: int | None, device: str) -> int:
    """Set torch's intra-op threads; returns the number in use.

    The CPU default is one thread: with two, every OpenMP region waits for its other
    thread, and when another process holds a core that thread is descheduled — on a
    shared two-core machine V1's decode step then took ten to a hundred times longer, and
    the default run about three times as long. One thread per runner keeps the A/B
    steady and fair."""
    if requested is None and device != "cuda" and "OMP_NUM_THREADS" not in os.environ:
        requested = 1
    if requested is not None:
        torch.set_num_threads(requested)
    return torch.get_num_threads()


def check_output_dir(path: str) -> None:
    """Before measuring anything: a run that cannot write its results is refused at once."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise Refused(f"--output-dir {path!r} is not a writable directory "
                      f"({exc.strerror or exc})") from None


def _engine_args(args: argparse.Namespace, runner: str, loop: str, max_batch: int = 0,
                 num_engines: int = 2, speculative: dict | None = None):
    """The EngineArgs of one of ab's engines; `speculative`: the spec workload's
    speculative_config for it (check_flags has refused --speculative-config beside it),
    with its own KernelOptions changes, if any, over the run's --kernel-options."""
    from policy.explain import engine_args_from_namespace

    base = engine_args_from_namespace(args).model_dump()
    base["model_runner"] = runner
    if base.get("pooler_config") is not None:  # the embed workload's engines' only
        base["pooler_config"] = None
    if speculative is not None:
        # a --spec-configs object's own kernel options go to its engines only
        base["speculative_config"], changes = split_kernel_options(speculative)
        if changes:
            options = KernelOptions.model_validate(base.get("kernel_options") or {})
            base["kernel_options"] = options.model_copy(update=changes)
    # (resolve_engine_loops has checked that --async-scheduling agrees with the loop)
    base["async_scheduling"] = loop == "async"
    if getattr(args, "max_num_seqs", None) is None:
        base["max_num_seqs"] = max(max_batch, 16)
    if getattr(args, "enable_prefix_caching", None) is None:
        # Runs repeat the same prompts (A-B-B-A): a warm prefix cache would make later runs
        # cheaper and run different kernels (other GEMM shapes) than the first.
        base["enable_prefix_caching"] = False
    if getattr(args, "gpu_memory_utilization", None) is None:
        # the engines share the device: each sizes its KV cache from its own share (0.42
        # each for two; --engine-loop both keeps four)
        base["gpu_memory_utilization"] = round(0.84 / max(num_engines, 2), 3)
    if getattr(args, "max_num_batched_tokens", None) is None:
        base["max_num_batched_tokens"] = max(base["max_num_seqs"], 2048 if args.quick else 8192)
    if args.nvtx:  # each engine's own option, not a process-wide switch
        options = base.get("kernel_options")
        options = KernelOptions() if options is None else KernelOptions.model_validate(options)
        base["kernel_options"] = options.model_copy(update={"nvtx": True})
    from policy import EngineArgs

    return EngineArgs(**base)
