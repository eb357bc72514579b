"""Pick the attention backend by name ("auto" | "TORCH" | "TRITON" | "FLASH_ATTN" | "NULL";
NULL is for benchmarks only and is never what "auto" means)."""

from __future__ import annotations

import logging

import torch

from shared.attention.backend import AttentionBackend

logger = logging.getLogger("runnerlab")

BACKEND_NAMES = ("TORCH", "TRITON", "FLASH_ATTN", "NULL")


class AttentionBackendError(RuntimeError):
    pass


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`auto` is TRITON on CUDA and TORCH on CPU."""
    if name == "auto":
        return "TRITON" if device.type == "cuda" else "TORCH"
    if name not in BACKEND_NAMES:
        raise AttentionBackendError(
            f"attention_backend={name!r} is unknown; accepted: 'auto', "
            + ", ".join(repr(n) for n in BACKEND_NAMES)
        )
    return name


def get_attn_backend(name: str, device: torch.device) -> AttentionBackend:
    resolved = resolve_backend_name(name, device)
    if resolved == "TORCH":
        from shared.attention.torch_backend import TorchBackend

        backend: AttentionBackend = TorchBackend()
    elif resolved == "TRITON":
        from shared.attention.triton_backend import TritonBackend

        backend = TritonBackend()
    elif resolved == "NULL":
        from shared.attention.null_backend import NullBackend

        backend = NullBackend()
        logger.warning("Attention backend NULL: attention launches nothing and leaves its "
                       "output unwritten; for pricing a step's attention share only")
    else:
        from shared.attention.flash_attn_backend import FlashAttnBackend

        backend = FlashAttnBackend()  # raises with install advice when flash_attn is absent
    logger.info("Attention backend: %s (asked for %s, device %s)", resolved, name, device.type)
    return backend
