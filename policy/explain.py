"""`python -m policy explain`: the whole runner decision, without a GPU and without weights.

Works for presets and for any directory or file holding a config.json, including
architectures neither runner implements (it says so). Prints text, or JSON with --json
(the RunnerDecision fields at the top level, plus "model", "config", "speculative_config"
(null, or the resolved settings with the draft's model traits), "pooler_config" (null, or
the resolved pooler of pooling_task), "run_blockers", "env").
The speculative-decoding rows of the feature table a config asks for are among its
"requested_features", so the decision names them.
Nothing is logged: the explanation is the output (on stdout).

Exit status: 0 explained; 1 explained, but the decision itself is an error (a forced
runner that cannot honour the configuration, or a feature no runner supports); 2 bad
arguments or environment variables (message on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from policy import envs
from policy import features as feature_table
from policy.cli_args import OneLineArgumentParser, usage_error
from policy.config import EngineConfig
from policy.engine_args import add_engine_args, engine_args_from_namespace


def build_parser(prog: str = "python -m policy explain") -> argparse.ArgumentParser:
    env_help = "\n".join(f"  {name}: {text}" for name, text in envs.ENV_VARS.items())
    parser = OneLineArgumentParser(
        prog=prog,
        description="Explain which model runner (V1 or V2) runnerlab would use, and why.",
        epilog="environment variables:\n" + env_help,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--features", action="store_true", help="also print the feature table")
    add_engine_args(parser)
    return parser


def explain_report(config: EngineConfig, blockers: list[str]) -> dict[str, Any]:
    """JSON-ready: the RunnerDecision fields, then the model, the resolved config and more."""
    decision = config.runner_decision
    sched, comp = config.scheduler_config, config.compilation_config
    report: dict[str, Any] = decision.model_dump()
    report["model"] = config.model_config.summary()
    report["config"] = {
        "device": config.device,
        "dtype": config.model_config.dtype,
        "max_model_len": sched.max_model_len,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "enable_chunked_prefill": sched.enable_chunked_prefill,
        "async_scheduling": sched.async_scheduling,
        "block_size": config.cache_config.block_size,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "cudagraph_mode": comp.cudagraph_mode,
        "cudagraph_capture_sizes": comp.cudagraph_capture_sizes,
        "attention_backend": config.attention_backend,
        "attention_backend_source": config.attention_backend_source,
        "load_format": config.load_config.load_format,
        "weight_source": config.load_config.weight_source,
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "batch_invariant": config.batch_invariance.enabled,
    }
    report["batch_invariance"] = config.batch_invariance.model_dump(mode="json")
    spec = config.speculative_config
    report["speculative_config"] = None if spec is None else _speculative_report(spec)
    pooler = config.pooler_config
    report["pooler_config"] = None if pooler is None else pooler.model_dump(mode="json")
    report["run_blockers"] = blockers
    report["env"] = envs.describe()
    return report


def _speculative_report(spec: Any) -> dict[str, Any]:
    out = spec.model_dump(mode="json", exclude={"draft_model_config"})
    draft = spec.draft_model_config
    out["draft_model"] = None if draft is None else draft.summary()
    return out


def _speculative_line(spec: dict[str, Any]) -> str:
    words = [f"method {spec['method']}", f"{spec['num_speculative_tokens']} tokens per step",
             f"rejection {spec['rejection_sample_method']}"]
    if spec["method"] == "ngram":
        words.append(f"n-grams {spec['prompt_lookup_min']}..{spec['prompt_lookup_max']}")
    if spec["synthetic_acceptance_rates"] is not None:
        words.append(f"acceptance rates {spec['synthetic_acceptance_rates']}")
    line = "Speculative decoding: " + ", ".join(words)
    draft = spec["draft_model"]
    if draft is not None:
        line += (f"\n  draft: {draft['model']} ({draft['architecture']}, weights "
                 f"{spec['draft_weight_source']}); dims: {_dims(draft)}")
    return line


def _pooler_line(pooler: dict[str, Any]) -> str:
    words = [f"task {pooler['task']}", f"pooling {pooler['pooling_type']}"]
    if pooler["normalize"] is not None:
        words.append(f"normalize {'yes' if pooler['normalize'] else 'no'}")
    if pooler["use_activation"] is not None:
        words.append(f"softmax {'yes' if pooler['use_activation'] else 'no'}")
    head = pooler["head"]
    if head != "hidden":
        head += f" ({pooler['num_labels']} labels)"
    source = "the head's output" if pooler["applies_head"] else "the hidden states"
    return "Pooling: " + ", ".join(words) + f"; model head {head}; pools {source}"


def _traits(model: dict[str, Any]) -> str:
    kinds = []
    if model["is_attention_free"]:
        kinds.append("attention-free")
    if model["is_hybrid"]:
        kinds.append("hybrid (attention + mamba/linear layers)")
    if model["is_moe"]:
        kinds.append(f"MoE ({model['num_experts']} experts, top-{model['num_experts_per_tok']})")
    return ", ".join(kinds) or "dense"


def _dims(model: dict[str, Any]) -> str:
    names = [("num_hidden_layers", "layers"), ("hidden_size", "hidden"),
             ("num_attention_heads", "heads"), ("num_kv_heads", "kv heads"),
             ("head_dim", "head_dim"), ("intermediate_size", "intermediate"),
             ("vocab_size", "vocab"), ("max_position_embeddings", "max positions")]
    parts = [f"{label} {model[key]}" for key, label in names if model[key] is not None]
    parts.append(f"tied embeddings {'yes' if model['tie_word_embeddings'] else 'no'}")
    return ", ".join(parts)


def _listing(items: list[str]) -> str:
    return ", ".join(items) if items else "none"


def format_text(report: dict[str, Any]) -> str:
    model, cfg = report["model"], report["config"]
    lines = [f"Model runner: {report['runner'].upper()} ({report['runner_class']})",
             f"  source: {report['source']}", "  why:"]
    lines += [f"    - {reason}" for reason in report["reasons"]]
    lines += [f"  requested features: {_listing(report['requested_features'])}",
              f"  unsupported by V2: {_listing(report['unsupported_v2'])}",
              f"  unsupported by V1: {_listing(report['unsupported_v1'])}"]
    lines += [f"  warning: {w}" for w in report["warnings"]]
    if report["error"]:
        lines.append(f"  error: {report['error']}")
    origin = f"preset, {model['preset_kind']}" if model["preset"] else model["config_path"]
    implemented = "yes" if model["supported_by_runnerlab"] else "no (neither runner)"
    lines += [
        f"Model: {model['model']} ({origin})",
        f"  architecture: {model['architecture']} (model_type {model['model_type']}, "
        f"parsed by {model['parsed_by']}); implemented by runnerlab: {implemented}",
        f"  traits: {_traits(model)}",
        f"  dims: {_dims(model)}",
        "Config: " + ", ".join(f"{k} {v}" for k, v in cfg.items() if k != "cudagraph_capture_sizes"),
    ]
    invariance = report["batch_invariance"]
    if invariance["enabled"]:
        lines.append("Batch-invariant mode: on (a request's logits do not depend on its batch)")
        lines += [f"  not invariant: {v}" for v in invariance["not_invariant"]]
    if report["speculative_config"] is not None:
        lines.append(_speculative_line(report["speculative_config"]))
    if report["pooler_config"] is not None:
        lines.append(_pooler_line(report["pooler_config"]))
    if report["run_blockers"]:
        lines.append("Would not run as configured:")
        lines += [f"  - {b}" for b in report["run_blockers"]]
    lines.append(f"Override: {envs.RUNNERLAB_USE_V2_MODEL_RUNNER}=0|1 or --model-runner v1|v2")
    return "\n".join(lines)


def format_feature_table() -> str:
    rows = feature_table.table()
    width = max(len(r["feature"]) for r in rows)
    lines = [f"{'feature':<{width}}  {'v1':<15}  {'v2':<15}  vLLM"]
    lines += [f"{r['feature']:<{width}}  {r['v1']:<15}  {r['v2']:<15}  {r['vllm']}" for r in rows]
    return "\n".join(lines)


def explain_main(argv: list[str] | None = None, prog: str = "python -m policy explain") -> int:
    ns = build_parser(prog).parse_args(argv)
    try:
        envs.validate_all()
        config, blockers = engine_args_from_namespace(ns).create_explain_config()
    except ValueError as err:  # EnvVarError, pydantic's ValidationError, config errors
        return usage_error(prog, err)
    report = explain_report(config, blockers)
    if ns.json:
        if ns.features:
            report["feature_table"] = feature_table.table()
        print(json.dumps(report, indent=2))
    else:
        print(format_text(report))
        if ns.features:
            print(format_feature_table())
    return 1 if report["error"] else 0
