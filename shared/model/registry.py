"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

import importlib

# name -> "module:Class"; imported on demand so the registry itself stays cheap to import
_MODELS = {
    "LlamaForCausalLM": "shared.model.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "shared.model.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "shared.model.llama:Qwen3ForCausalLM",
    "MixtralForCausalLM": "shared.model.moe:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "shared.model.moe:Qwen2MoeForCausalLM",
    # classification models (pooling): the causal LM's decoder with a score head
    "LlamaForSequenceClassification": "shared.model.pooling_models:LlamaForSequenceClassification",
    "LlamaForTokenClassification": "shared.model.pooling_models:LlamaForTokenClassification",
    "Qwen2ForSequenceClassification": "shared.model.pooling_models:Qwen2ForSequenceClassification",
    "Qwen2ForTokenClassification": "shared.model.pooling_models:Qwen2ForTokenClassification",
    "Qwen3ForSequenceClassification": "shared.model.pooling_models:Qwen3ForSequenceClassification",
    "Qwen3ForTokenClassification": "shared.model.pooling_models:Qwen3ForTokenClassification",
}

SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset(_MODELS)


def get_model_class(arch: str) -> type:
    if arch not in _MODELS:
        raise ValueError(
            f"architecture {arch!r} is not implemented; supported: "
            + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        )
    module_name, class_name = _MODELS[arch].split(":")
    return getattr(importlib.import_module(module_name), class_name)


# model_type -> architecture, for configs that carry no `architectures` (a GGUF's config)
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}


def resolve_architecture(hf_config) -> str:
    """`architectures[0]`, or the architecture implied by `model_type` when it is unset."""
    archs = getattr(hf_config, "architectures", None)
    if archs:
        return archs[0]
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"the config names no architecture (architectures={archs!r}, model_type={model_type!r}); "
        "set config.architectures to one of: " + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    )
