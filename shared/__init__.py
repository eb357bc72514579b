"""Everything both runners use. The public names are imported lazily so that
`import shared.<module>` stays cheap (no model or transformers import)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Decide Triton's mode (the interpreter on a machine without a CUDA GPU) before anything
# else can import triton: transformers imports it too, and a triton imported first
# without TRITON_INTERPRET leaves every later kernel unable to run on such a machine.
import shared.triton_utils  # noqa: E402, F401

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]

_LAZY = {
    "LLM": "shared.llm",
    "LLMEngine": "shared.engine",
    "SamplingParams": "shared.sampling_params",
    "RequestOutput": "shared.outputs",
    "CompletionOutput": "shared.outputs",
}

if TYPE_CHECKING:
    from shared.engine import LLMEngine
    from shared.llm import LLM
    from shared.outputs import CompletionOutput, RequestOutput
    from shared.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shared' has no attribute {name!r}")
