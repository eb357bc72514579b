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
    """Pretend a CUDA GPU is visible: the policy only asks `cuda_available()`."""
    monkeypatch.setattr(config_module, "cuda_available", lambda: True)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(config_module, "cuda_available", lambda: False)
