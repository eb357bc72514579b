"""runnerlab's configuration and runner-selection policy.

    from policy import EngineArgs
    cfg = EngineArgs(model="tiny-llama", dtype="float32", device="cpu").create_engine_config()
    cfg.use_v2_model_runner, cfg.runner_decision, cfg.v2_unsupported_features()

Imports nothing else of the project (the import direction is policy <- shared <- runners).
Importing it configures the "runnerlab" logger (stderr, INFO, RUNNERLAB_LOGGING_LEVEL).
"""

from policy.logging_setup import configure_logging

configure_logging()

from policy.config import (  # noqa: E402
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    SpeculativeSettings,
)
from policy.engine_args import EngineArgs, add_engine_args, engine_args_from_namespace  # noqa: E402
from policy.envs import EnvVarError  # noqa: E402
from policy.model_config import RUNNERLAB_ARCHITECTURES, ModelConfig  # noqa: E402
from policy.pooling import PoolerConfig, PoolerSettings  # noqa: E402
from policy.presets import list_presets  # noqa: E402
from policy.selection import (  # noqa: E402
    DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES,
    RUNNER_CLASSES,
    RunnerDecision,
    RunnerSelectionError,
    decide_runner,
)

__all__ = [
    "CacheConfig",
    "CompilationConfig",
    "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES",
    "DeviceConfig",
    "EngineArgs",
    "EngineConfig",
    "EnvVarError",
    "LoadConfig",
    "ModelConfig",
    "ParallelConfig",
    "PoolerConfig",
    "PoolerSettings",
    "RUNNERLAB_ARCHITECTURES",
    "RUNNER_CLASSES",
    "RunnerDecision",
    "RunnerSelectionError",
    "SchedulerConfig",
    "SpeculativeConfig",
    "SpeculativeSettings",
    "add_engine_args",
    "decide_runner",
    "engine_args_from_namespace",
    "list_presets",
]
