"""Everything both runners use. The public names are imported lazily so that
`import shared.<module>` stays cheap (no model or transformers import)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Decide Triton's mode (the interpreter on a machine without a CUDA GPU) before anything
# else can import triton: transformers imports it too, and a triton imported first
# without TRITON_INTERPRET leaves every later kernel unable to run on such a machine.
import shared.runtime.triton_utils  # noqa: E402, F401

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput"]

_LAZY = {
    "LLM": "shared.serving.llm",
    "LLMEngine": "shared.serving.engine",
    "SamplingParams": "shared.contract.sampling_params",
    "RequestOutputKind": "shared.contract.sampling_params",
    "RequestOutput": "shared.contract.outputs",
    "CompletionOutput": "shared.contract.outputs",
}

if TYPE_CHECKING:
    from shared.contract.outputs import CompletionOutput, RequestOutput
    from shared.contract.sampling_params import RequestOutputKind, SamplingParams
    from shared.serving.engine import LLMEngine
    from shared.serving.llm import LLM


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shared' has no attribute {name!r}")
