"""The model both runners share: Llama-family and MoE decoders (and the Llama-family
classification models), their weight loading
(safetensors, the SmolLM2 GGUF, seeded dummy init) and the architecture registry."""

from shared.model.loader import load_model
from shared.model.registry import SUPPORTED_ARCHITECTURES, get_model_class, resolve_architecture

__all__ = ["SUPPORTED_ARCHITECTURES", "get_model_class", "load_model", "resolve_architecture"]
