"""Import Triton through this module in every kernel file.

On a machine without a CUDA GPU, Triton kernels can only run under the Triton
interpreter, and the interpreter is chosen when `@triton.jit` is applied (it reads
TRITON_INTERPRET then). So this module sets TRITON_INTERPRET=1 before any kernel module
decorates its kernels, and logs that once. On a GPU machine it changes nothing.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("runnerlab")

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    logger.info("No CUDA GPU: Triton kernels run under the Triton interpreter (TRITON_INTERPRET=1).")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["HAS_CUDA", "INTERPRET", "triton", "tl", "next_power_of_2"]


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
