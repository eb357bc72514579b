import logging

import pytest

import policy  # noqa: F401 - importing it configures the runnerlab logger
from policy import envs
from policy.logging_setup import LOGGER_NAME, configure_logging

VAR = "RUNNERLAB_USE_V2_MODEL_RUNNER"


def test_unset_and_empty_mean_policy(monkeypatch):
    assert envs.use_v2_model_runner() is None
    monkeypatch.setenv(VAR, "")
    assert envs.use_v2_model_runner() is None


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), ("TRUE", True), (" True ", True),
    ("0", False), ("false", False), ("False", False),
])
def test_tri_state_values(monkeypatch, value, expected):
    monkeypatch.setenv(VAR, value)
    assert envs.use_v2_model_runner() is expected


@pytest.mark.parametrize("value", ["maybe", "2", "yes", "on", "-1"])
def test_bad_value_names_variable_value_and_accepted(monkeypatch, value):
    monkeypatch.setenv(VAR, value)
    with pytest.raises(envs.EnvVarError) as err:
        envs.use_v2_model_runner()
    message = str(err.value)
    assert VAR in message and repr(value) in message
    for accepted in ("'1'", "'true'", "'0'", "'false'"):
        assert accepted in message


def test_read_at_call_time_not_import_time(monkeypatch):
    monkeypatch.setenv(VAR, "0")
    assert envs.use_v2_model_runner() is False
    monkeypatch.setenv(VAR, "1")
    assert envs.use_v2_model_runner() is True


def test_attention_backend(monkeypatch):
    assert envs.attention_backend() is None
    monkeypatch.setenv("RUNNERLAB_ATTENTION_BACKEND", "triton")
    assert envs.attention_backend() == "TRITON"
    monkeypatch.setenv("RUNNERLAB_ATTENTION_BACKEND", "auto")
    assert envs.attention_backend() is None
    monkeypatch.setenv("RUNNERLAB_ATTENTION_BACKEND", "xformers")
    with pytest.raises(envs.EnvVarError, match="RUNNERLAB_ATTENTION_BACKEND.*'TORCH'"):
        envs.attention_backend()


def test_logging_level(monkeypatch):
    assert envs.logging_level() == "INFO"
    monkeypatch.setenv("RUNNERLAB_LOGGING_LEVEL", "debug")
    assert envs.logging_level() == "DEBUG"
    monkeypatch.setenv("RUNNERLAB_LOGGING_LEVEL", "loud")
    with pytest.raises(envs.EnvVarError, match="RUNNERLAB_LOGGING_LEVEL.*'WARNING'"):
        envs.logging_level()


def test_logger_configured_on_import(monkeypatch):
    logger = logging.getLogger(LOGGER_NAME)  # `policy` (imported above) configured it
    ours = [h for h in logger.handlers if getattr(h, "_runnerlab", False)]
    assert len(ours) == 1 and logger.propagate and logger.level == logging.INFO
    try:
        monkeypatch.setenv("RUNNERLAB_LOGGING_LEVEL", "WARNING")
        configure_logging()  # idempotent: still one handler, new level
        assert logger.level == logging.WARNING
        assert len([h for h in logger.handlers if getattr(h, "_runnerlab", False)]) == 1
        monkeypatch.setenv("RUNNERLAB_LOGGING_LEVEL", "loud")
        configure_logging()  # a bad value must not break import: INFO, with a warning
        assert logger.level == logging.INFO
    finally:
        monkeypatch.delenv("RUNNERLAB_LOGGING_LEVEL")
        configure_logging()


def test_handler_writes_to_stderr(capsys):
    logging.getLogger(LOGGER_NAME).info("hello from the test")
    captured = capsys.readouterr()
    assert "hello from the test" in captured.err and "INFO" in captured.err
    assert "hello from the test" not in captured.out
