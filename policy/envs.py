"""Every RUNNERLAB_* environment variable, parsed in one place.

Each getter reads os.environ when called, never at import time, so a test can
monkeypatch the environment and the next create_engine_config() sees it. A value that
cannot be parsed is an EnvVarError naming the variable, the value and the accepted values:
a typo must never silently mean "unset".
"""

from __future__ import annotations

import os

RUNNERLAB_USE_V2_MODEL_RUNNER = "RUNNERLAB_USE_V2_MODEL_RUNNER"
RUNNERLAB_ATTENTION_BACKEND = "RUNNERLAB_ATTENTION_BACKEND"
RUNNERLAB_LOGGING_LEVEL = "RUNNERLAB_LOGGING_LEVEL"
RUNNERLAB_NVTX = "RUNNERLAB_NVTX"
RUNNERLAB_BATCH_INVARIANT = "RUNNERLAB_BATCH_INVARIANT"

_TRUE = ("1", "true")
_FALSE = ("0", "false")
ATTENTION_BACKEND_VALUES = ("auto", "TORCH", "TRITON", "FLASH_ATTN")
LOGGING_LEVEL_VALUES = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# name -> one line of help, for `explain --help` and the README.
ENV_VARS = {
    RUNNERLAB_USE_V2_MODEL_RUNNER: "unset = selection policy; 1/true = force V2; 0/false = force V1",
    RUNNERLAB_ATTENTION_BACKEND: "overrides attention_backend='auto': " + ", ".join(ATTENTION_BACKEND_VALUES),
    RUNNERLAB_LOGGING_LEVEL: "level of the 'runnerlab' logger: " + ", ".join(LOGGING_LEVEL_VALUES),
    RUNNERLAB_NVTX: "1/true: NVTX ranges around each runner stage (KernelOptions.nvtx)",
    RUNNERLAB_BATCH_INVARIANT: "1/true: batch-invariant kernels (EngineArgs.batch_invariant); "
                               "0/false or unset: the argument decides",
}


class EnvVarError(ValueError):
    """A RUNNERLAB_* variable holds a value we do not accept."""


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    # An empty string is how shells "unset" a variable inline (VAR= cmd): treat it as unset.
    if value is None or value.strip() == "":
        return None
    return value.strip()


def _bad(name: str, value: str, accepted: tuple[str, ...], extra: str = "") -> EnvVarError:
    shown = ", ".join(repr(a) for a in accepted)
    return EnvVarError(f"{name}={value!r} is not valid; accepted values: {shown}{extra}")


def use_v2_model_runner() -> bool | None:
    """Tri-state: None (unset: the policy decides), True (force V2), False (force V1)."""
    value = _raw(RUNNERLAB_USE_V2_MODEL_RUNNER)
    if value is None:
        return None
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise _bad(
        RUNNERLAB_USE_V2_MODEL_RUNNER, value, _TRUE + _FALSE,
        " (case-insensitive), or unset to let the policy decide",
    )


def attention_backend() -> str | None:
    """The backend name asked for in the environment (canonical upper case), or None."""
    value = _raw(RUNNERLAB_ATTENTION_BACKEND)
    if value is None:
        return None
    for name in ATTENTION_BACKEND_VALUES:
        if value.lower() == name.lower():
            return None if name == "auto" else name
    raise _bad(RUNNERLAB_ATTENTION_BACKEND, value, ATTENTION_BACKEND_VALUES)


def logging_level() -> str:
    """The 'runnerlab' logger level name; INFO when unset."""
    value = _raw(RUNNERLAB_LOGGING_LEVEL)
    if value is None:
        return "INFO"
    if value.upper() in LOGGING_LEVEL_VALUES:
        return value.upper()
    raise _bad(RUNNERLAB_LOGGING_LEVEL, value, LOGGING_LEVEL_VALUES)


def nvtx() -> bool:
    """RUNNERLAB_NVTX: NVTX ranges around each runner stage; False when unset."""
    return _flag(RUNNERLAB_NVTX)


def _flag(name: str) -> bool:
    value = _raw(name)
    if value is None:
        return False
    if value.lower() in _TRUE or value.lower() in _FALSE:
        return value.lower() in _TRUE
    raise _bad(name, value, _TRUE + _FALSE)


def batch_invariant() -> bool:
    """RUNNERLAB_BATCH_INVARIANT: turns the batch-invariant mode on; False when unset (it
    never turns off a mode the arguments ask for)."""
    return _flag(RUNNERLAB_BATCH_INVARIANT)


def validate_all() -> None:
    """Parse every variable once; raises the first EnvVarError (used by the CLI up front)."""
    use_v2_model_runner()
    attention_backend()
    logging_level()
    nvtx()
    batch_invariant()


def describe() -> dict[str, str | None]:
    """The raw values as set, for `explain` output."""
    return {name: os.environ.get(name) for name in ENV_VARS}
