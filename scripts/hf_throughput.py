"""The peer baseline for the README: nano-vllm's offline throughput workload through Hugging
Face transformers' own continuous batching (its paged KV cache, scheduler and CUDA graphs).

  python3 scripts/hf_throughput.py --out hf_throughput.json        # H200: docs/results/raw/1f8e650/h200_hf_throughput.json
  python3 scripts/hf_throughput.py --model tiny-llama --quick --device cpu      # smoke test

Workload (shared.harness.workloads.nano_vllm_workload): 256 requests, prompt and output
lengths uniform in [100, 1024], token ids in [0, 10000], temperature 0.6, EOS ignored.
Model: a preset's config.json with random weights (qwen3-0.6b by default, bf16, SDPA).
Throughput = output tokens / wall time of the measured run, prefill included, after a
warm-up run on workload-shaped prompts (same length distribution, another seed).

transformers' continuous-batching API moves between releases (5.17 on the GPU machine,
5.24 on the CPU machine): every optional keyword is passed only when the installed
signature takes it, and the KV cache is always sized explicitly (unsized, it sizes itself
from free memory, 9 GB of host RAM on CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import torch  # noqa: E402

PRESETS_DIR = Path(__file__).resolve().parent.parent / "policy" / "presets"


# ---- workload -----------------------------------------------------------------------------
@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(num_requests: int, min_len: int, max_len: int, vocab_size: int) -> Workload:
    """nano-vllm's draw (the project's copy of it), token ids folded into the vocabulary
    (a no-op for the real shapes: their vocabularies are far above 10000)."""
    from shared.harness.workloads import nano_vllm_workload

    prompts, max_tokens = nano_vllm_workload(num_requests, min_len, max_len)
    prompts = [[t % vocab_size for t in p] for p in prompts]
    return Workload(prompts, max_tokens)


def make_warmup(workload: Workload, num_requests: int, max_new_tokens: int, seed: int = 1) -> Workload:
    """Prompts resampled (another seed) from the measured workload's lengths and ids, so
    warm-up exercises the same prefill shapes; short outputs keep it quick."""
    rng = random.Random(seed)
    lengths = [len(p) for p in workload.prompts]
    ids = [t for p in workload.prompts[:8] for t in p]
    prompts = [[rng.choice(ids) for _ in range(rng.choice(lengths))] for _ in range(num_requests)]
    return Workload(prompts, [max_new_tokens] * num_requests)


# ---- model ------------------------------------------------------------------------------
def load_random_model(config_path: Path, dtype: torch.dtype, device: str, attn: str, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(config_path) as f:
        raw = json.load(f)
    model_type = raw.pop("model_type")
    raw.pop("architectures", None)
    config = AutoConfig.for_model(model_type, **raw)
    # EOS is ignored by the workload: no stop token at all (CB reads -1 as "none").
    config.eos_token_id = None
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn}
    # transformers 5 spells it `dtype`, 4.x `torch_dtype`.
    dtype_key = "dtype" if _accepts(AutoModelForCausalLM.from_config, "dtype") else "torch_dtype"
    kwargs[dtype_key] = dtype
    with torch.device(device):  # initialise on the device: a CPU init of 0.6B params is slow
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model = model.to(device=device, dtype=dtype).eval()
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = None
    return model


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _filter_kwargs(fn: Any, kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """kwargs the installed fn declares by name (a **kwargs catch-all does not count: older
    releases swallow unknown keys silently); -> (kept, dropped names)."""
    params = inspect.signature(fn).parameters
    kept = {k: v for k, v in kwargs.items() if k in params}
    return kept, sorted(set(kwargs) - set(kept))


# ---- continuous-batching configuration -------------------------------------------------
def generation_config(args: argparse.Namespace, max_new_tokens: int):
    from transformers import GenerationConfig

    # top_k / top_p off: nano-vllm samples from the full temperature-scaled distribution
    # (GenerationConfig's historical default is top_k=50).
    return GenerationConfig(
        do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
        max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
    )


def cache_settings(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    """Blocks for every request resident at once (no eviction or offload), plus slack; the
    page is both 5.17+'s `page_size` and older releases' `block_size`."""
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.max_tokens))
    total = sum(len(p) + n for p, n in zip(workload.prompts, workload.max_tokens))
    page = args.page_size
    num_blocks = args.num_blocks or (total // page + len(workload.prompts) + 8)
    return {
        "num_blocks": num_blocks,
        "page_size": page,
        "max_batch_tokens": args.max_batch_tokens,
        "max_requests_per_batch": args.max_requests_per_batch,
        "longest_request_tokens": longest,
        "kv_tokens": num_blocks * page,
    }


def cb_config(settings: dict[str, Any], args: argparse.Namespace):
    """A ContinuousBatchingConfig with the fields this release has, or None where the
    release predates the class (then the settings ride on the GenerationConfig)."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        try:
            from transformers.generation import ContinuousBatchingConfig
        except ImportError:
            return None, []
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)} \
        if dataclasses.is_dataclass(ContinuousBatchingConfig) \
        else set(inspect.signature(ContinuousBatchingConfig).parameters)
    wanted = {
        "num_blocks": settings["num_blocks"],
        "max_batch_tokens": settings["max_batch_tokens"],
        "max_requests_per_batch": settings["max_requests_per_batch"],
        # never let it swap the attention implementation under us (flash is not installed
        # on the GPU machine, and the baseline is defined as SDPA)
        "auto_switch_to_flash": False,
        "seed": args.seed,
    }
    if "page_size" in fields:
        wanted["page_size"] = settings["page_size"]
    else:
        wanted["block_size"] = settings["page_size"]
    if args.no_cuda_graphs and "use_cuda_graph" in fields:
        wanted["use_cuda_graph"] = False
    kept = {k: v for k, v in wanted.items() if k in fields and v is not None}
    return ContinuousBatchingConfig(**kept), sorted(set(wanted) - set(kept))


def init_manager(model, gen_cfg, settings: dict[str, Any], args: argparse.Namespace,
                 workload: Workload) -> tuple[Any, dict[str, Any]]:
    cb_cfg, dropped = cb_config(settings, args)
    kwargs: dict[str, Any] = {"generation_config": gen_cfg}
    if cb_cfg is not None:
        kwargs["continuous_batching_config"] = cb_cfg
    else:
        # Pre-ContinuousBatchingConfig releases read the cache sizing from the
        # GenerationConfig itself.
        for key in ("num_blocks", "max_batch_tokens"):
            setattr(gen_cfg, key, settings[key])
        gen_cfg.block_size = settings["page_size"]
    hints = _workload_hints(workload)
    if hints is not None:
        kwargs["workload_hints"] = hints
    kept, dropped_init = _filter_kwargs(model.init_continuous_batching, kwargs)
    if cb_cfg is not None and "continuous_batching_config" not in kept:
        raise RuntimeError(
            "this transformers release has ContinuousBatchingConfig but init_continuous_batching "
            "does not take it: the KV cache cannot be sized explicitly; refusing to run unsized"
        )
    manager = model.init_continuous_batching(**kept)
    info = {
        "cb_config": repr(cb_cfg) if cb_cfg is not None else None,
        "cb_config_fields_unavailable": dropped,
        "init_kwargs_unavailable": dropped_init,
    }
    return manager, info


def _workload_hints(workload: Workload):
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    try:
        return WorkloadHints(
            max_prompt_length=max(len(p) for p in workload.prompts),
            max_generated_length=max(workload.max_tokens),
            num_requests=len(workload.prompts),
        )
    except TypeError:
        return None


# ---- running ------------------------------------------------------------------------------
def run_requests(manager, workload: Workload, tag: str, timeout_s: float) -> dict[str, Any]:
    """Submit every request (each with its own max_new_tokens), wait for all of them;
    -> wall time and output tokens. A failed or missing request is an error."""
    add_kwargs = {}
    if _accepts(manager.add_request, "eos_token_id"):
        add_kwargs["eos_token_id"] = -1  # ignore_eos: CB treats -1 as "no stop token"
    if _accepts(manager.add_request, "streaming"):
        add_kwargs["streaming"] = False
    ids = []
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens)):
        req_id = manager.add_request(prompt, request_id=f"{tag}{i}", max_new_tokens=n, **add_kwargs)
        ids.append(req_id if req_id is not None else f"{tag}{i}")
    results: dict[str, Any] = {}
    deadline = start + timeout_s
    while len(results) < len(ids):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{tag}: {len(results)}/{len(ids)} requests done after {timeout_s} s")
        result = manager.get_result(timeout=1)
        if result is None:
            if not getattr(manager, "is_running", lambda: True)():
                raise RuntimeError(f"{tag}: the continuous-batching thread stopped early")
            continue
        if _is_finished(result):
            results[result.request_id] = result
    elapsed = time.perf_counter() - start
    errors = {r: str(results[r].error) for r in ids if getattr(results[r], "error", None)}
    if errors:
        raise RuntimeError(f"{tag}: {len(errors)} requests failed, e.g. {next(iter(errors.items()))}")
    produced = [len(results[r].generated_tokens) for r in ids]
    return {
        "seconds": elapsed,
        "output_tokens": sum(produced),
        "requests_short": sum(p < n for p, n in zip(produced, workload.max_tokens)),
        "output_tokens_per_s": sum(produced) / elapsed,
        "total_tokens_per_s": (sum(produced) + workload.num_prompt_tokens) / elapsed,
    }


def warm_up_graphs(manager, model) -> float | None:
    """The manager's own warm-up (CUDA-graph capture at the largest shapes), where this
    release has one; -> seconds, None when skipped. The request-level warm-up on
    workload-shaped prompts runs afterwards either way."""
    fn = getattr(manager, "warmup", None)
    if fn is None:
        return None
    t0 = time.perf_counter()
    try:
        fn(model) if "model" in inspect.signature(fn).parameters else fn()
    except TypeError as exc:
        print(f"hf_throughput: manager.warmup() skipped ({exc})", file=sys.stderr)
        return None
    return time.perf_counter() - t0


def _is_finished(result) -> bool:
    fn = getattr(result, "is_finished", None)
    if callable(fn):
        return bool(fn())
    status = getattr(result, "status", None)
    return status is not None and getattr(status, "name", str(status)) in ("FINISHED", "FAILED")


# ---- main ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", help="a preset under policy/presets")
    p.add_argument("--config", default=None, help="a config.json instead of a preset")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--attn", default="sdpa", help="attn_implementation (the baseline: sdpa)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=32)
    p.add_argument("--warmup-tokens", type=int, default=32)
    p.add_argument("--page-size", type=int, default=256, help="KV page (block) size in tokens")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks; default: every request resident at once, plus slack")
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--max-requests-per-batch", type=int, default=256)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--timeout", type=float, default=3000.0, help="seconds per run")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 8 requests of 16-48 tokens, 2 warm-up requests, page 16")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = min(args.num_requests, 8)
        args.min_len, args.max_len = 16, 48
        args.warmup_requests, args.warmup_tokens = 2, 4
        args.page_size = min(args.page_size, 16)
        args.max_batch_tokens = min(args.max_batch_tokens, 256)
    return args


def main(argv: list[str] | None = None) -> int:
    import transformers

    args = parse_args(argv)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    config_path = Path(args.config) if args.config else PRESETS_DIR / args.model / "config.json"
    if not config_path.is_file():
        print(f"hf_throughput: no config at {config_path}", file=sys.stderr)
        return 2
    model = load_random_model(config_path, dtype, args.device, args.attn, args.seed)
    vocab = model.config.vocab_size
    max_pos = getattr(model.config, "max_position_embeddings", None) or 10**9
    if 2 * args.max_len > max_pos:
        print(f"hf_throughput: prompt + output up to {2 * args.max_len} tokens exceeds "
              f"max_position_embeddings={max_pos}; lower --max-len", file=sys.stderr)
        return 2
    workload = make_workload(args.num_requests, args.min_len, args.max_len, vocab)
    warmup = make_warmup(workload, args.warmup_requests, args.warmup_tokens)
    settings = cache_settings(args, workload)
    gen_cfg = generation_config(args, max(workload.max_tokens))
    manager, info = init_manager(model, gen_cfg, settings, args, workload)
    print(f"hf_throughput: {args.model} {dtype} {args.device} attn={args.attn} "
          f"transformers {transformers.__version__}; {len(workload.prompts)} requests, "
          f"{workload.num_prompt_tokens} prompt / {workload.num_output_tokens} output tokens; "
          f"KV {settings['num_blocks']} x {settings['page_size']}", file=sys.stderr)
    try:
        info["manager_warmup_s"] = warm_up_graphs(manager, model)
        manager.start()
        warm = run_requests(manager, warmup, "warmup", args.timeout) if warmup.prompts else None
        result = run_requests(manager, workload, "req", args.timeout)
    finally:
        manager.stop(block=True, timeout=30)
    record = {
        "what": "Hugging Face transformers continuous batching, nano-vllm throughput workload",
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "model": args.model, "config": str(config_path), "weights": "random",
        "dtype": str(dtype).replace("torch.", ""), "device": args.device,
        "device_name": (torch.cuda.get_device_name() if args.device == "cuda"
                        else platform.processor() or platform.machine()),
        "attn_implementation": getattr(model.config, "_attn_implementation", args.attn),
        "transformers": transformers.__version__, "torch": torch.__version__,
        "num_requests": len(workload.prompts), "prompt_tokens": workload.num_prompt_tokens,
        "requested_output_tokens": workload.num_output_tokens,
        "temperature": args.temperature, "ignore_eos": True,
        "kv_cache": settings, "warmup": warm, **info, **result,
    }
    print(f"output tokens/s: {result['output_tokens_per_s']:.1f} "
          f"({result['output_tokens']} tokens in {result['seconds']:.2f} s; "
          f"total tokens/s {result['total_tokens_per_s']:.1f})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0 if result["requests_short"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
