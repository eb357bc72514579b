"""Every policy test starts from a clean RUNNERLAB_* environment and a CPU-only machine
(unless it patches CUDA in on purpose with the `fake_cuda` fixture)."""

import pytest

from policy import config as config_module
from policy import envs


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in envs.ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend CUDA GPUs are visible: the policy only asks `cuda_available()` and (for
    tensor parallelism) `visible_cuda_devices()`."""
    monkeypatch.setattr(config_module, "cuda_available", lambda: True)
    monkeypatch.setattr(config_module, "visible_cuda_devices", lambda: 8)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(config_module, "cuda_available", lambda: False)
