"""EngineArgs: what a user asks for. create_engine_config() validates it all, once, resolves
every "auto", decides the runner and logs the decision line.

Types and enumerations are checked by pydantic when EngineArgs is built (a ValidationError,
which is a ValueError, naming the field, the input and the accepted literals); ranges and
cross-field rules are checked in create_engine_config() by the resolve_* functions of
policy.config, with messages of the form "<field>=<value> is not valid (why); accepted: ...".
"""

from __future__ import annotations

import argparse
import json
import logging
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from policy import config as config_module
from policy import envs
from policy import features as feature_table
from policy.batch_invariance import resolve_batch_invariance
from policy.config import (
    EngineConfig,
    LoadConfig,
    SpeculativeConfig,
    resolve_attention_backend,
    resolve_cache,
    resolve_compilation,
    resolve_device,
    resolve_parallel,
    resolve_scheduler,
)
from policy.kernel_options import KernelOptions
from policy.logits_processors import resolve_logits_processors
from policy.model_config import (
    RUNNERLAB_ARCHITECTURES,
    ModelConfig,
    build_model_config,
    weight_source,
)
from policy.pooling import PoolerConfig, PoolingTask, refuse_with_pooling, resolve_pooler
from policy.presets import gguf_install_hint
from policy.selection import decide_runner
from policy.speculative import SpeculativeSettings, resolve_speculative

logger = logging.getLogger("runnerlab")

# dtype spellings vLLM takes besides the canonical names
DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(description="preset name, or a directory / file holding a config.json")
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="auto: the model's weights (tiny presets: seeded random); dummy: random")
    dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = Field(
        "auto", description="auto: float32 on CPU; on CUDA the checkpoint's half type, else "
                            "bfloat16; vLLM's aliases half, float and double are taken too")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    seed: int = Field(0, description="seed of random weights and of unseeded requests")
    model_runner: Literal["auto", "v1", "v2"] = Field(
        "auto", description="force a runner; auto: RUNNERLAB_USE_V2_MODEL_RUNNER, then the policy")
    max_model_len: int | None = Field(
        None, description="default min(max_position_embeddings, 4096)")
    max_num_seqs: int | None = Field(None, description="default 256 on CUDA, 32 on CPU")
    max_num_batched_tokens: int | None = Field(
        None, description="default 8192 on CUDA, 2048 on CPU (at least max_num_seqs)")
    block_size: int = Field(16, description="KV-cache block size in tokens (a power of two)")
    num_gpu_blocks_override: int | None = Field(
        None, description="number of KV blocks instead of sizing from memory")
    gpu_memory_utilization: float = Field(0.9, description="fraction of GPU memory to use")
    enable_prefix_caching: bool = Field(True, description="reuse cached KV blocks of shared prefixes")
    enable_chunked_prefill: bool = Field(True, description="split long prefills across steps")
    async_scheduling: bool = Field(
        False, description="schedule step N+1 while step N runs on the GPU (both runners)")
    enforce_eager: bool = Field(False, description="never use CUDA graphs")
    cudagraph_mode: Literal["auto", "NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"] = Field(
        "auto", description="auto: FULL_AND_PIECEWISE (both runners), NONE on CPU or when "
                            "eager")
    cudagraph_capture_sizes: list[int] | None = Field(
        None, description="token counts to capture; default 1,2,4,8..256 step 8, then step "
                          "16, up to max_num_seqs for FULL graphs and min(max_num_seqs x "
                          "(1 + k) x 2, 512) for piecewise ones (k: speculative tokens)")
    attention_backend: Literal["auto", "TORCH", "TRITON", "FLASH_ATTN", "NULL"] = Field(
        "auto", description="auto: RUNNERLAB_ATTENTION_BACKEND, else TRITON on CUDA, TORCH on "
                            "CPU; NULL: benchmarks only, attention launches nothing and the "
                            "tokens are meaningless")
    tensor_parallel_size: int = Field(
        1, description="shard the model over this many ranks (torch.distributed: NCCL on "
                       "CUDA, gloo on CPU); rank 0 spawns the others, or joins torchrun's")
    distributed_timeout_s: float = Field(
        120.0, description="tensor parallelism: seconds rank 0 waits on a worker or a "
                           "collective before it raises")
    pipeline_parallel_size: int = Field(1, description="only 1 is supported")
    # Feature fields the selection gate reads: each is honoured by the runners the feature
    # table (policy.features) names and refused by name by the others, never ignored.
    speculative_config: SpeculativeConfig | None = Field(
        None, description='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 3} or '
                          '{"method": "draft_model", "model": "tiny-llama-draft", '
                          '"num_speculative_tokens": 2, "rejection_sample_method": "block"} '
                          "(policy/speculative.py)")
    logits_processors: list[str] = Field(
        default_factory=list, description="qualified names of custom logits processors")
    pooling_task: PoolingTask | None = Field(
        None, description="run one pooling task for every request instead of generation "
                          "(V2: embed, classify, score; V1: all)")
    pooler_config: PoolerConfig | None = Field(
        None, description='JSON, e.g. {"pooling_type": "MEAN", "normalize": false} or '
                          '{"use_activation": false}; needs pooling_task (policy/pooling.py)')
    enable_prompt_embeds: bool = Field(False, description="accept prompt embeddings as input")
    batch_invariant: bool = Field(
        False, description="batch-invariant kernels: a request's logits are bitwise the same "
                           "alone or in any batch, at any position, in both runners "
                           "(RUNNERLAB_BATCH_INVARIANT=1 also turns it on; "
                           "policy/batch_invariance.py)")
    kernel_options: KernelOptions = Field(
        default_factory=KernelOptions,
        description='JSON: how the CUDA kernels are chosen and launched, e.g. {"pdl": false} '
                    '(policy/kernel_options.py; RUNNERLAB_NVTX=1 turns on its nvtx)')

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        """vLLM's spellings of a dtype -> the canonical name (stored, logged, explained)."""
        return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value

    def create_engine_config(self) -> EngineConfig:
        """Validate, resolve and decide, for running. Raises ValueError on anything that
        would stop a run; logs exactly one INFO decision line (after any fallback warning)."""
        config, _ = self._build(strict=True)
        for warning in config.runner_decision.warnings:
            logger.warning("%s", warning)
        line = config.runner_decision.log_line()
        if config.batch_invariance.enabled:
            for variant in config.batch_invariance.not_invariant:
                logger.warning("Batch-invariant mode: not invariant: %s", variant)
            line += "; batch-invariant mode on"
        logger.info("%s", line)
        return config

    def create_explain_config(self) -> tuple[EngineConfig, list[str]]:
        """For `explain`: the same resolution and decision without logging, where what would
        only stop a run here (no GPU, no weights, an architecture runnerlab does not
        implement, a forced runner that cannot honour the config) is reported, not raised:
        -> (config, run blockers); a blocking decision is in config.runner_decision.error."""
        return self._build(strict=False)

    def _build(self, strict: bool) -> tuple[EngineConfig, list[str]]:
        env_use_v2 = envs.use_v2_model_runner()
        env_backend = envs.attention_backend()
        blockers: list[str] = []
        device = resolve_device(self.device, check_available=strict)
        if device == "cuda" and not strict and not config_module.cuda_available():
            blockers.append("device='cuda': no CUDA GPU is available here")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} is not valid; accepted: an integer >= 0")
        model = build_model_config(self.model, self.dtype, device, self.max_model_len)
        pooler = resolve_pooler(self.pooling_task, self.pooler_config, model)
        refuse_with_pooling(self.pooling_task, speculative_config=self.speculative_config,
                            logits_processors=list(self.logits_processors),
                            async_scheduling=self.async_scheduling)
        cache = resolve_cache(self.block_size, self.num_gpu_blocks_override,
                              self.gpu_memory_utilization, self.enable_prefix_caching)
        scheduler = resolve_scheduler(device, model.max_model_len, self.max_num_seqs,
                                      self.max_num_batched_tokens, self.enable_chunked_prefill,
                                      self.async_scheduling)
        parallel = resolve_parallel(
            self.tensor_parallel_size, self.pipeline_parallel_size, model=model, device=device,
            visible_devices=config_module.visible_cuda_devices() if strict and device == "cuda" else None,
            distributed_timeout_s=self.distributed_timeout_s)
        speculative = resolve_speculative(self.speculative_config, model, device,
                                          self.load_format)
        processors = resolve_logits_processors(list(self.logits_processors))
        if processors and speculative is not None:
            raise ValueError(
                f"logits_processors={[p.name for p in processors]} with speculative decoding is "
                "not supported yet (the rejection samplers do not run custom processors); set "
                "logits_processors=[] or speculative_config=None"
            )
        decision = decide_runner(
            model, feature_table.requested_features(self), model_runner=self.model_runner,
            env_use_v2=env_use_v2, device=device, strict=strict,
            details=feature_table.feature_details(self),
        )
        compilation = resolve_compilation(device, self.cudagraph_mode, self.enforce_eager,
                                          self.cudagraph_capture_sizes, scheduler,
                                          pooling_task=self.pooling_task,
                                          num_speculative_tokens=(
                                              0 if speculative is None
                                              else speculative.num_speculative_tokens))
        backend, backend_source = resolve_attention_backend(self.attention_backend, env_backend,
                                                            device)
        kernel_opts = self._kernel_options()
        invariance = resolve_batch_invariance(
            kernel_opts.batch_invariant, attention_backend=backend,
            tensor_parallel_size=parallel.tensor_parallel_size)
        load = LoadConfig(load_format=self.load_format, seed=self.seed,
                          weight_source=weight_source(model, self.load_format))
        blockers += run_blockers(model, load, backend) + _draft_blockers(speculative, load)
        if strict and blockers:
            raise ValueError("; ".join(blockers))
        config = EngineConfig(
            model_config=model, cache_config=cache, scheduler_config=scheduler,
            compilation_config=compilation, parallel_config=parallel, load_config=load,
            device_config={"device": device}, attention_backend=backend,
            attention_backend_source=backend_source, runner_decision=decision,
            speculative_config=speculative,
            kernel_options=kernel_opts, batch_invariance=invariance,
            logits_processors=processors, pooling_task=self.pooling_task,
            pooler_config=pooler,
            enable_prompt_embeds=self.enable_prompt_embeds,
        )
        return config, blockers


    def _kernel_options(self) -> KernelOptions:
        """The kernel options with the switches that also have an argument or a variable:
        each turns its option on, none turns one off."""
        update = {}
        if envs.nvtx():
            update["nvtx"] = True
        if self.batch_invariant or envs.batch_invariant():
            update["batch_invariant"] = True
        return self.kernel_options.model_copy(update=update) if update else self.kernel_options


def run_blockers(model: ModelConfig, load: LoadConfig, attention_backend: str) -> list[str]:
    """Everything that stops a run but not an explanation, each naming the field to change."""
    out = weight_blockers(model, load.load_format, load.weight_source)
    if attention_backend == "FLASH_ATTN":
        from importlib.util import find_spec

        if find_spec("flash_attn") is None:
            out.append("attention_backend='FLASH_ATTN' needs the flash_attn package, which is not "
                       "importable here; accepted: 'auto', 'TORCH', 'TRITON'")
    return out


def _draft_blockers(speculative: SpeculativeSettings | None, load: LoadConfig) -> list[str]:
    """The draft's weights are loaded under the same load_format as the target's."""
    if speculative is None or speculative.draft_model_config is None:
        return []
    draft = speculative.draft_model_config
    return [f"speculative_config.model={draft.model!r} (the draft): {b}"
            for b in weight_blockers(draft, load.load_format, speculative.draft_weight_source)]


def weight_blockers(model: ModelConfig, load_format: str, source: str) -> list[str]:
    """What stops a model's weights from loading (and an architecture nobody implements)."""
    out: list[str] = []
    if not model.supported_by_runnerlab:
        out.append(
            f"model={model.model!r}: runnerlab implements neither runner for "
            f"{model.architecture} (implemented: {', '.join(sorted(RUNNERLAB_ARCHITECTURES))}); "
            f"`python -m policy explain --model {model.model}` still judges it")
    if model.is_shape_only and load_format == "auto":
        out.append(
            f"load_format='auto' is not valid for the shape-only preset {model.preset!r} (it "
            'ships no weights); accepted: load_format="dummy" (seeded random weights; '
            '--load-format dummy on the command line)')
    if source == "gguf" and model.gguf_path is None:
        out.append(
            f"model={model.model!r} needs its GGUF weights: {gguf_install_hint(model.preset)}, "
            'or load_format="dummy" for random weights')
    if source == "safetensors" and model.model_dir is not None:
        from pathlib import Path

        if not any(Path(model.model_dir).glob("*.safetensors")):
            out.append(
                f"model={model.model!r}: no *.safetensors in {model.model_dir} (weights are never "
                'unpickled); accepted: load_format="dummy" for random weights')
    return out


# ------------------------------------------------------------------ command-line flags


def _unwrap_optional(annotation: Any) -> Any:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


def add_engine_args(parser: argparse.ArgumentParser, *, require_model: bool = True) -> None:
    """One flag per EngineArgs field (dashes for underscores; bools as --flag/--no-flag).
    Every default is argparse.SUPPRESS, so only flags actually given reach EngineArgs and
    its own defaults apply to the rest."""
    group = parser.add_argument_group("engine arguments")
    for name, info in EngineArgs.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": info.description}
        kind = _unwrap_optional(info.annotation)
        if name == "model":
            kwargs["required"] = require_model
        elif kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            kwargs["choices"] = list(typing.get_args(kind))
            if name == "dtype":
                kwargs["choices"] += list(DTYPE_ALIASES)
        elif kind in (int, float):
            kwargs["type"] = kind
        elif typing.get_origin(kind) is list:
            kwargs.update(nargs="*", type=typing.get_args(kind)[0])
        elif kind in (SpeculativeConfig, KernelOptions, PoolerConfig):
            kwargs.update(type=json.loads, metavar="JSON")
        group.add_argument(flag, **kwargs)


def engine_args_from_namespace(ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """EngineArgs from the flags present in ns (plus overrides)."""
    given = {name: getattr(ns, name) for name in EngineArgs.model_fields if hasattr(ns, name)}
    given.update(overrides)
    return EngineArgs(**given)
