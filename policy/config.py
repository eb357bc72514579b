"""The resolved, validated configuration: sub-configs and EngineConfig.

Every value here is final (no "auto" left except in the *_requested fields kept for
reporting). EngineArgs.create_engine_config() builds them through the resolve_* functions
below, each of which validates its own fields with messages that name the field, the bad
value and the accepted values.
"""

from __future__ import annotations

from dataclasses import field
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter
from pydantic.dataclasses import dataclass

from policy import features as feature_table
from policy.batch_invariance import BatchInvariance
from policy.errors import field_error as _fail
from policy.kernel_options import KernelOptions
from policy.logits_processors import LogitsProcessorSpec
from policy.model_config import ModelConfig, WeightSource
from policy.parallel import ParallelConfig, resolve_parallel  # noqa: F401 (re-export)
from policy.pooling import PoolerSettings
from policy.selection import RunnerDecision
from policy.speculative import SpeculativeConfig, SpeculativeSettings  # noqa: F401 (re-export)

CudaGraphMode = Literal["NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"]
_FROZEN = ConfigDict(frozen=True)


@cache
def cuda_available() -> bool:
    """torch.cuda.is_available(), imported lazily (policy must import fast without a GPU)."""
    import torch

    return torch.cuda.is_available()


def visible_cuda_devices() -> int:
    """torch.cuda.device_count(), imported lazily like cuda_available."""
    import torch

    return torch.cuda.device_count()


class DeviceConfig(BaseModel):
    model_config = _FROZEN
    device: Literal["cpu", "cuda"]


class LoadConfig(BaseModel):
    model_config = _FROZEN
    load_format: Literal["auto", "dummy"]
    seed: int
    # Where the weights come from, resolved (policy.model_config.WeightSource).
    weight_source: WeightSource


class CacheConfig(BaseModel):
    model_config = _FROZEN
    block_size: int
    num_gpu_blocks_override: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool


class SchedulerConfig(BaseModel):
    model_config = _FROZEN
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    # Overlap: the scheduler plans step N+1 before step N's tokens reach the host
    # (placeholders for the tokens in flight); the runner reads them on the device.
    async_scheduling: bool = False


class CompilationConfig(BaseModel):
    model_config = _FROZEN
    cudagraph_mode: CudaGraphMode                  # resolved: "auto" -> a mode
    cudagraph_mode_requested: str                  # as asked ("auto" or a mode)
    cudagraph_capture_sizes: list[int]             # ascending; [] when cudagraph_mode is NONE
    enforce_eager: bool

    @property
    def max_capture_size(self) -> int:
        return self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0


@dataclass(frozen=True, config=ConfigDict(arbitrary_types_allowed=True))
class EngineConfig:
    """Everything an engine needs, validated once. A pydantic *dataclass* rather than a
    BaseModel because BaseModel reserves the attribute `model_config`, and vLLM's name for
    the model's configuration is `model_config`."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    compilation_config: CompilationConfig
    parallel_config: ParallelConfig
    load_config: LoadConfig
    device_config: DeviceConfig
    attention_backend: Literal["TORCH", "TRITON", "FLASH_ATTN", "NULL"]
    attention_backend_source: Literal["argument", "env", "auto"]
    runner_decision: RunnerDecision
    # Resolved against the target: the draft's ModelConfig is
    # speculative_config.draft_model_config (method="draft_model").
    speculative_config: SpeculativeSettings | None = None
    kernel_options: KernelOptions = field(default_factory=KernelOptions)
    # resolved from kernel_options.batch_invariant: what stays variant under this config
    batch_invariance: BatchInvariance = field(default_factory=BatchInvariance)
    # resolved: class names and the runner interface each implements
    logits_processors: list[LogitsProcessorSpec] = field(default_factory=list)
    pooling_task: str | None = None
    # resolved for pooling_task (None without one): pooling type, normalize / softmax, head
    pooler_config: PoolerSettings | None = None
    enable_prompt_embeds: bool = False

    @property
    def use_v2_model_runner(self) -> bool:
        return self.runner_decision.runner == "v2"

    @property
    def runner_name(self) -> str:
        return self.runner_decision.runner

    @property
    def device(self) -> str:
        return self.device_config.device

    def requested_features(self) -> list[str]:
        return feature_table.requested_features(self)

    def v2_unsupported_features(self) -> list[str]:
        """The honest inventory: requested features that V2 cannot honour."""
        return feature_table.unsupported_for("v2", self.requested_features())

    def model_dump(self) -> dict[str, Any]:
        """JSON-ready dict (the transformers config object is left out)."""
        return TypeAdapter(EngineConfig).dump_python(self, mode="json")


# ---------------------------------------------------------------- resolution + checks


def resolve_device(device: str, *, check_available: bool = True) -> str:
    """auto -> cuda when a CUDA GPU is visible, else cpu."""
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device == "cuda" and check_available and not cuda_available():
        raise _fail("device", device, "'auto', 'cpu'", "no CUDA GPU is available here")
    return device


def resolve_cache(block_size: int, num_gpu_blocks_override: int | None,
                  gpu_memory_utilization: float, enable_prefix_caching: bool) -> CacheConfig:
    if block_size < 1 or block_size > 1024 or block_size & (block_size - 1):
        raise _fail("block_size", block_size, "a power of two from 1 to 1024")
    if num_gpu_blocks_override is not None and num_gpu_blocks_override < 1:
        raise _fail("num_gpu_blocks_override", num_gpu_blocks_override, "None or an integer >= 1")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise _fail("gpu_memory_utilization", gpu_memory_utilization, "a fraction in (0, 1]")
    return CacheConfig(block_size=block_size, num_gpu_blocks_override=num_gpu_blocks_override,
                       gpu_memory_utilization=gpu_memory_utilization,
                       enable_prefix_caching=enable_prefix_caching)


# Defaults per device. CPU runs are tests and small A/Bs; 32 sequences and 2048 tokens
# keep V1's dense tables and the interpreter's work small.
DEFAULT_MAX_NUM_SEQS = {"cpu": 32, "cuda": 256}
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}


def resolve_scheduler(device: str, max_model_len: int, max_num_seqs: int | None,
                      max_num_batched_tokens: int | None,
                      enable_chunked_prefill: bool,
                      async_scheduling: bool = False) -> SchedulerConfig:
    """Defaults: max_num_seqs 256 on CUDA / 32 on CPU; max_num_batched_tokens 8192 on CUDA /
    2048 on CPU, raised to max_num_seqs (every running sequence can decode in one step) and,
    without chunked prefill, to max_model_len (a whole prompt must fit one step)."""
    seqs = DEFAULT_MAX_NUM_SEQS[device] if max_num_seqs is None else max_num_seqs
    if seqs < 1:
        raise _fail("max_num_seqs", seqs, "an integer >= 1")
    tokens = max_num_batched_tokens
    if tokens is None:
        tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS[device], seqs)
        if not enable_chunked_prefill:
            tokens = max(tokens, max_model_len)
    if tokens < 1:
        raise _fail("max_num_batched_tokens", tokens, "an integer >= 1")
    if tokens < seqs:
        raise _fail("max_num_batched_tokens", tokens, f"an integer >= max_num_seqs={seqs}",
                    "a step must be able to decode every running sequence")
    if not enable_chunked_prefill and tokens < max_model_len:
        raise _fail("max_num_batched_tokens", tokens,
                    f"an integer >= max_model_len={max_model_len} when "
                    "enable_chunked_prefill=False", "a long prompt could never be scheduled")
    return SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens,
                           max_model_len=max_model_len,
                           enable_chunked_prefill=enable_chunked_prefill,
                           async_scheduling=async_scheduling)


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to 256, then multiples of 16, all <= max_size; max_size
    itself is appended so every batch up to max_num_seqs has a graph to pad into."""
    ladder = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max_size + 1, 16))
    sizes = [s for s in ladder if s <= max_size]
    if max_size >= 1 and (not sizes or sizes[-1] != max_size):
        sizes.append(max_size)
    return sizes


def resolve_compilation(device: str, cudagraph_mode: str, enforce_eager: bool,
                        capture_sizes: list[int] | None, scheduler: SchedulerConfig,
                        pooling_task: str | None = None,
                        num_speculative_tokens: int = 0) -> CompilationConfig:
    """cudagraph_mode "auto" -> FULL_AND_PIECEWISE for either runner (FULL graphs for
    uniform decode, piecewise graphs for the other batches that fit, eager above the largest
    size), PIECEWISE with a pooling task, NONE on CPU or with enforce_eager. An explicit mode
    that cannot take effect (CPU, enforce_eager, FULL graphs for a pooling engine) and
    capture sizes with no graphs are errors, not no-ops."""
    if cudagraph_mode != "auto" and cudagraph_mode != "NONE":
        if device == "cpu":
            raise _fail("cudagraph_mode", cudagraph_mode, "'auto', 'NONE' on device='cpu'",
                        "CUDA graphs need device='cuda'")
        if enforce_eager:
            raise _fail("cudagraph_mode", cudagraph_mode, "'auto', 'NONE' with enforce_eager=True",
                        "enforce_eager=True disables CUDA graphs")
    # A pooling engine runs prefill only, never a uniform decode batch, so a FULL graph
    # would be captured and never replayed; piecewise graphs still serve the prefill
    # batches that fit.
    if pooling_task is not None and cudagraph_mode in ("FULL", "FULL_AND_PIECEWISE"):
        raise _fail("cudagraph_mode", cudagraph_mode,
                    f"'auto', 'NONE', 'PIECEWISE' with pooling_task={pooling_task!r}",
                    "a pooling engine runs prefill only and never replays a FULL graph, "
                    "which serves uniform decode batches")
    if cudagraph_mode == "auto":
        if device == "cpu" or enforce_eager:
            mode = "NONE"
        else:
            mode = "FULL_AND_PIECEWISE" if pooling_task is None else "PIECEWISE"
    else:
        mode = cudagraph_mode
    sizes = _resolve_capture_sizes(mode, capture_sizes, scheduler, num_speculative_tokens)
    return CompilationConfig(cudagraph_mode=mode, cudagraph_mode_requested=cudagraph_mode,
                             cudagraph_capture_sizes=sizes, enforce_eager=enforce_eager)


def default_max_capture_size(mode: str, scheduler: SchedulerConfig,
                             num_speculative_tokens: int = 0) -> int:
    """The largest default capture size. FULL graphs serve uniform decodes, so max_num_seqs
    bounds them. Piecewise graphs serve the mixed batches, which hold more tokens than
    requests: a decode batch beside a prefill chunk, or speculative verifies whose rows
    carry different draft counts (ngram drafts are often shorter than k). vLLM's bound is
    min(max_num_seqs x (1 + k) x 2, 512); below it such a step runs eagerly at the real
    size, which costs a small model several times its graphed step. Unlike vLLM we never
    go below max_num_seqs, so that every uniform decode batch keeps a FULL graph (vLLM
    caps those at 512 too)."""
    seqs, tokens = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
    size = seqs
    if mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        size = max(seqs, min(seqs * (1 + num_speculative_tokens) * 2, 512))
    return min(size, tokens)


def _resolve_capture_sizes(mode: str, capture_sizes: list[int] | None,
                           scheduler: SchedulerConfig, num_speculative_tokens: int) -> list[int]:
    seqs, tokens = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
    if mode == "NONE":
        if capture_sizes:
            raise _fail("cudagraph_capture_sizes", capture_sizes, "None when cudagraph_mode "
                        "resolves to 'NONE' (device='cpu', enforce_eager=True or "
                        "cudagraph_mode='NONE')", "no graphs are captured, the sizes would be ignored")
        return []
    if capture_sizes is None:
        sizes = default_capture_sizes(default_max_capture_size(mode, scheduler,
                                                               num_speculative_tokens))
        # max_num_seqs off the ladder (100, say) is added, so that the largest uniform
        # decode batches have a FULL graph too instead of padding past max_num_seqs
        return sorted(set(sizes) | {min(seqs, tokens)})
    # FULL graphs serve uniform decode only, where num_tokens == num_reqs <= max_num_seqs;
    # piecewise graphs serve mixed batches up to max_num_batched_tokens.
    bound, bound_name = (seqs, "max_num_seqs") if mode == "FULL" else (tokens, "max_num_batched_tokens")
    bad = [s for s in capture_sizes if s < 1 or s > bound]
    if not capture_sizes or bad:
        raise _fail("cudagraph_capture_sizes", capture_sizes,
                    f"a non-empty list of integers in 1..{bound_name}={bound} for "
                    f"cudagraph_mode={mode!r}", f"out of range: {bad}" if bad else "empty")
    return sorted(set(capture_sizes))


def resolve_attention_backend(requested: str, env_value: str | None,
                              device: str) -> tuple[str, str]:
    """-> (backend name, source). An explicit argument wins; RUNNERLAB_ATTENTION_BACKEND
    overrides "auto"; "auto" is TRITON on CUDA and TORCH on CPU (the pure-PyTorch oracle;
    TRITON also runs on CPU, under the interpreter, when asked for by name)."""
    if requested != "auto":
        name, source, field = requested, "argument", "attention_backend"
    elif env_value is not None:
        name, source, field = env_value, "env", "RUNNERLAB_ATTENTION_BACKEND"
    else:
        return ("TRITON" if device == "cuda" else "TORCH"), "auto"
    if name == "FLASH_ATTN" and device == "cpu":
        raise _fail(field, name, "'TORCH', 'TRITON' on device='cpu'", "flash-attn needs CUDA")
    return name, source
