"""Build a model on its device and dtype, then fill its weights: a local Hugging Face
safetensors directory, the SmolLM2 GGUF file, or seeded dummy values.

Safety: only `*.safetensors` and GGUF are read. Pickled checkpoints (*.bin, *.pt) are
refused, never unpickled, and no code from a model directory is ever run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator

import torch
from torch import nn

from shared.model.layers import RMSNorm
from shared.model.registry import get_model_class, resolve_architecture
from shared.model.sharding import (
    ShardSpec,
    copy_logical_rows,
    row_width,
    shard_spec,
    zero_padding,
)

logger = logging.getLogger("runnerlab")

LOAD_FORMATS = ("auto", "dummy")
DUMMY_BIAS_STD = 0.02
DUMMY_ATTN_OUT_SCALE = 0.25
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint files of `model_dir`: the shards its index lists, else every
    *.safetensors file. A clear error when there are none."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        pickled = sorted(n for n in os.listdir(model_dir) if n.endswith(_PICKLE_SUFFIXES))
        hint = (
            f" (found pickled checkpoint files {pickled}, which runnerlab refuses to unpickle)"
            if pickled
            else ""
        )
        raise FileNotFoundError(f"no *.safetensors weight files in {model_dir!r}{hint}")
    paths = [os.path.join(model_dir, n) for n in names]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(
            f"{model_dir!r}: the safetensors index lists missing files {missing}"
        )
    return paths


def iter_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the directory's safetensors files, on the CPU."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int) -> None:
    """Seeded random weights that behave like a trained model's in scale.

    - norm weights: ones; biases: N(0, 0.02);
    - every matrix: N(0, 1/fan_in) (fan_in = the last dim), about 0.02 at Llama sizes
      (0.016 at hidden 4096). Each projection then maps O(1) activations to O(1) ones
      whatever the model size, and the residual stream grows like sqrt(layers): finite
      in bf16 over 30+ layers;
    - attention o_proj: a further x0.25. A random model's attention is diffuse, so its
      output is nearly the same context average at every position; at full scale that
      common part swamps the per-token signal after a few dozen layers and greedy decoding
      repeats one token. Damped, the per-token MLP path keeps the tokens varied.

    Values are drawn in float32 on the parameter's device with a torch.Generator (fast for
    an 8B model on a GPU), then cast: one seed gives the same model in float32 and float64
    on one device type.

    Tensor parallel: each parameter's LOGICAL (single-GPU) values are drawn, in the same
    order and chunks whatever the number of ranks, and each rank keeps its part of every
    chunk (its shard spec), so rank r of N holds exactly its shard of the one-rank model;
    fan_in is the logical last dim; vocab padding rows are zero."""
    norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name in norms:
            param.fill_(1.0)
            continue
        spec = shard_spec(param)
        if len(spec.logical_shape) == 1:
            std = DUMMY_BIAS_STD
        else:
            std = spec.logical_shape[-1] ** -0.5
            if name.endswith(".o_proj.weight"):
                std *= DUMMY_ATTN_OUT_SCALE
        gen = generators.get(param.device)
        if gen is None:
            gen = torch.Generator(device=param.device).manual_seed(seed)
            generators[param.device] = gen
        zero_padding(param.data, spec)
        _fill_logical(param.data, spec, gen, std)


_DUMMY_CHUNK = 1 << 24  # bounds the float32 scratch for the largest matrices


def _fill_logical(dst: torch.Tensor, spec: ShardSpec, gen: torch.Generator, std: float) -> None:
    """Draw the logical tensor's values flat, in chunks of _DUMMY_CHUNK (the stream a
    one-rank model has always drawn), and keep this rank's part of each chunk's whole
    rows; a row cut by the chunk boundary waits for the next chunk (scratch: one chunk
    plus less than a row)."""
    width = row_width(spec.logical_shape)
    numel = math.prod(spec.logical_shape)
    pending = None
    row = 0
    for start in range(0, numel, _DUMMY_CHUNK):
        noise = torch.randn(min(_DUMMY_CHUNK, numel - start), generator=gen,
                            dtype=torch.float32, device=dst.device).mul_(std)
        if pending is not None and pending.numel():
            noise = torch.cat([pending, noise])
        whole = noise.numel() // width * width
        rows = noise[:whole].view(-1, width)
        copy_logical_rows(dst, spec, row, rows)
        row += rows.shape[0]
        pending = noise[whole:]


def load_model(
    hf_config,
    *,
    load_format: str = "auto",
    model_dir: str | None = None,
    gguf_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> nn.Module:
    """Build the architecture named by `hf_config` on `device` in `dtype`, fill its
    weights, and return it in eval mode.

    load_format "auto" reads `gguf_path` when given, else the safetensors in `model_dir`;
    "dummy" draws seeded random weights (the only way to get random weights)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is unknown; accepted: {LOAD_FORMATS}")
    weights = None
    if load_format == "auto":
        if gguf_path is not None:
            from shared.model.gguf import load_gguf_weights

            if not os.path.isfile(gguf_path):
                raise FileNotFoundError(f"GGUF file {gguf_path!r} does not exist")
            weights = load_gguf_weights(gguf_path)
        elif model_dir is not None:
            safetensors_files(model_dir)  # fail before allocating the model
            weights = iter_safetensors_weights(model_dir)
        else:
            raise ValueError(
                "load_format='auto' needs model_dir (a directory of *.safetensors) or "
                "gguf_path; pass load_format='dummy' for seeded random weights"
            )
    model_cls = get_model_class(resolve_architecture(hf_config))
    device = torch.device(device)
    with default_dtype(dtype), device:
        model = model_cls(hf_config)
    if weights is None:
        initialize_dummy_weights(model, seed)
    else:
        model.load_weights(weights)
    logger.info(
        "Loaded %s (%s weights, %s, %s)",
        model_cls.__name__,
        load_format if weights is None else ("gguf" if gguf_path else "safetensors"),
        dtype,
        device,
    )
    return model.eval()
