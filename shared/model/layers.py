"""Building blocks shared by every model: the replicated linear layer, RMSNorm, rotary
embedding (default / linear / llama3), SiLU-and-mul, config helpers, and the Hugging Face
name -> fused (and sharded) parameter weight loader.

Parameters are allocated with `torch.empty` and left uninitialised: the loader fills them
from a checkpoint or with seeded dummy values, so building a Llama-3-8B-sized model on a
GPU costs no init kernels. A module built by hand must be loaded before it is run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.kernels import batch_invariant_matmul, fused_ops, gemv
from shared.model.kernels.batch_invariant_cpu import invariant_linear_cpu
from shared.model.sharding import (
    copy_logical_rows,
    logical_rows,
    row_width,
    shard_spec,
    zero_padding,
)
from shared.runtime.kernel_options import kernel_options

# ---------------------------------------------------------------------------------------
# config helpers


def get_head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def get_rope_parameters(cfg) -> dict:
    """transformers 5.x keeps theta and scaling in `rope_parameters`; older configs use
    `rope_theta` + `rope_scaling`. Returns one dict with at least rope_type and rope_theta."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    legacy = getattr(cfg, "rope_scaling", None)
    if legacy:
        params = {**legacy, **params}
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(cfg, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def check_no_sliding_window(cfg) -> None:
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        raise NotImplementedError(
            f"{type(cfg).__name__}: sliding-window attention is not implemented "
            "(set use_sliding_window=False)"
        )


# ---------------------------------------------------------------------------------------
# the replicated linear layer


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b): the GEMV kernel for a small batch on CUDA (e.g. the LM head at batch 1),
    else `matmul` (never the GEMV in batch-invariant mode: use_gemv says no)."""
    if x.dim() == 2 and x.stride(-1) == 1 and x.dtype == weight.dtype and gemv.use_gemv(x):
        return gemv.gemv(x, weight, bias)
    return matmul(x, weight, bias)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) without the GEMV path: in batch-invariant mode the fixed-order matmul
    (cuBLAS and MKL pick their reduction order by the row count), else F.linear."""
    if kernel_options().batch_invariant:
        if x.is_cuda:
            return batch_invariant_matmul.invariant_linear(x, weight, bias)
        # the interpreter's float32 dot is not invariant (batch_invariant_matmul's docstring)
        return invariant_linear_cpu(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """y = x W^T (+ b), weight [out, in], allocated uninitialised. Replicated: every rank
    holds all of it (the tensor-parallel layers are in shared/model/parallel_layers.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# ---------------------------------------------------------------------------------------
# norms and activation


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half types reduce in float32; float32 and float64 keep their own precision."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x) * weight; with `residual` (the decoder's fused pattern):
        (norm(x + residual) * weight, x + residual), the sum kept in the model dtype."""
        if fused_ops.use_fused(x) and x.dim() == 2 and x.stride(-1) == 1:
            return fused_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in (at least) float32, round back to the model dtype, then scale:
        # the same order as the reference implementation, so bf16 results line up.
        # For float32/float64 models both `.to` calls are no-ops (no copy).
        xc = x.to(compute_dtype(x.dtype))
        xc = xc * torch.rsqrt(xc.square().mean(-1, keepdim=True).add_(self.eps))
        return self.weight * xc.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate | up) -> [..., I]: silu(gate) * up; one Triton launch on CUDA."""
    if fused_ops.use_fused(x) and x.dim() == 2 and x.stride(-1) == 1:
        return fused_ops.silu_and_mul(x)
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


class SiluAndMul(nn.Module):
    """[T, 2I] (gate | up) -> [T, I]: silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


def check_silu(cfg) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act={act!r} is not supported (only 'silu')")


# ---------------------------------------------------------------------------------------
# rotary embedding

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(rotary_dim: int, params: dict, dtype: torch.dtype) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] for the supported RoPE types."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=dtype, device="cpu") / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    raise NotImplementedError(
        f"rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_scale(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: wavelengths longer than the original context / low
    factor are stretched by `factor`; shorter than original / high factor are kept; the band
    in between blends the two linearly in (original context / wavelength)."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    orig = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    blend = ((orig / wavelen) - low) / (high - low)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    out = torch.where(wavelen > orig / low, inv_freq / factor, blended)
    return torch.where(wavelen < orig / high, inv_freq, out)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves) over the first `rotary_dim` dims of each head.

    The cos|sin cache [max_position, rotary_dim] is precomputed and indexed by positions,
    so forward is pure gathers and elementwise math (graph-capturable). It stays float32
    (float64 when the model is float64) even in a bf16 model: `_apply` keeps it there."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, params: dict):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.params = dict(params)
        cache_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        self.register_buffer("cos_sin_cache", self._build_cache(cache_dtype), persistent=False)

    def _build_cache(self, dtype: torch.dtype) -> torch.Tensor:
        # Computed on the CPU in float64 and rounded once: identical on every device.
        inv_freq = rope_inv_freq(self.rotary_dim, self.params, torch.float64)
        pos = torch.arange(self.max_position, dtype=torch.float64, device="cpu")
        freqs = torch.outer(pos, inv_freq)
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)
        return cache.to(torch.empty(0).device)  # the default device (loader's context)

    def _apply(self, fn, recurse=True):
        cache = self._buffers.pop("cos_sin_cache")
        super()._apply(fn, recurse)
        probe = fn(torch.empty(0, dtype=torch.float32, device=cache.device))
        want = torch.float64 if probe.dtype == torch.float64 else torch.float32
        if cache.dtype != want:
            cache = self._build_cache(want)
        self._buffers["cos_sin_cache"] = cache.to(probe.device)
        return self

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_dim)
        rot = x[..., : self.rotary_dim].to(cos.dtype)
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        if self.rotary_dim < self.head_dim:
            rotated = torch.cat([rotated, x[..., self.rotary_dim :]], dim=-1)
        return rotated.reshape(num_tokens, -1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T]; q [T, H*D], k [T, Hkv*D] -> rotated, same shapes/dtypes."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, R/2]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def make_rope(cfg) -> RotaryEmbedding:
    head_dim = get_head_dim(cfg)
    params = get_rope_parameters(cfg)
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    rope_inv_freq(rotary_dim, params, torch.float64)  # fail early on an unsupported type
    return RotaryEmbedding(head_dim, rotary_dim, cfg.max_position_embeddings, params)


# ---------------------------------------------------------------------------------------
# weight loading: Hugging Face names -> fused parameters

# Checkpoint projection -> (fused parameter, part index in its total_output_sizes)
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Per-expert projection -> (fused [E, ...] parameter, half of gate_up, or None for down).
# Mixtral names them w1 (gate), w3 (up), w2 (down).
EXPERT_PARAMS = {
    "gate_proj": ("gate_up_proj", 0),
    "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w2": ("down_proj", None),
}
_EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def _resolve(name: str, params: dict, modules: dict) -> tuple[str, tuple] | None:
    """Map an (already renamed) checkpoint name to (parameter name, index into its LOGICAL
    single-GPU tensor); the parameter's shard spec then picks this rank's part."""
    if name in params:
        return name, ()
    m = _EXPERT_KEY.match(name)
    if m and m["proj"] in EXPERT_PARAMS:
        fused, half = EXPERT_PARAMS[m["proj"]]
        target = f"{m['prefix']}.{fused}"
        if target not in params:
            return None
        expert = int(m["expert"])
        if half is None:
            return target, (expert,)
        return target, (expert, modules[m["prefix"]].gate_up_rows(half))
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in STACKED_PARAMS:
        fused, shard = STACKED_PARAMS[parts[-2]]
        module_name = ".".join([*parts[:-2], fused])
        target = f"{module_name}.{parts[-1]}"
        if target in params:
            return target, (modules[module_name].shard_rows(shard),)
    return None


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None] = lambda n: n,
) -> None:
    """Copy checkpoint tensors into `model`, fusing q/k/v, gate/up and per-expert tensors.

    Each tensor arrives whole on the CPU; only this rank's rows / columns of it are copied
    into the local parameter (shared/model/sharding.py), and vocab padding rows are zero.
    `rename` maps a checkpoint name to the model's naming, or None to skip it (e.g. a tied
    lm_head). Raises on an unknown name, a shape mismatch, or a parameter left unloaded."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    for param in params.values():
        zero_padding(param.data, shard_spec(param))
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        resolved = _resolve(name, params, modules)
        if resolved is None:
            raise KeyError(
                f"checkpoint tensor {hf_name!r} matches no parameter of {type(model).__name__}"
            )
        target, index = resolved
        spec = shard_spec(params[target])
        start, _, expected = logical_rows(spec.logical_shape, index)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}; "
                f"{target}{list(index) if index else ''} expects {expected}"
            )
        rows = tensor.reshape(-1, row_width(spec.logical_shape))
        copy_logical_rows(params[target].data, spec, start, rows)
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(
            f"the checkpoint has no tensor for {len(missing)} parameter(s) of "
            f"{type(model).__name__}: {', '.join(missing[:8])}{more}"
        )
