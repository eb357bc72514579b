"""The decision, rule by rule and source by source, against a hand-written table of what
DESIGN §7 says each case must give."""

import importlib.util
import logging
from dataclasses import dataclass, field

import pytest

from policy import (
    DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES,
    EngineArgs,
    RunnerSelectionError,
    decide_runner,
    selection,
)
from policy import features as feature_table
from policy.features import SUPPORTED, UNSUPPORTED, Feature


@dataclass
class Traits:
    """A stand-in for ModelConfig: only the attributes the policy reads."""

    architecture: str
    model_type: str
    is_moe: bool = False
    is_hybrid: bool = False
    is_attention_free: bool = False
    supported_by_runnerlab: bool = True
    architectures: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.architectures = self.architectures or [self.architecture]


DENSE = Traits("LlamaForCausalLM", "llama")
MIXTRAL = Traits("MixtralForCausalLM", "mixtral", is_moe=True)
QWEN2_MOE = Traits("Qwen2MoeForCausalLM", "qwen2_moe", is_moe=True)
JAMBA = Traits("JambaForCausalLM", "jamba", is_moe=True, is_hybrid=True, supported_by_runnerlab=False)
HYBRID_LISTED = Traits("GraniteMoeForCausalLM", "granitemoe", is_moe=True, is_hybrid=True)
MAMBA = Traits("MambaForCausalLM", "mamba", is_attention_free=True, supported_by_runnerlab=False)

V1_ONLY = "v1-only test feature"     # V1 supports it, V2 does not (fixture v1_only_feature)
NO_RUNNER = "prompt embeds"  # no runner supports it yet

# (id, model, model_runner, env, features, triton, expected runner, source, text in reasons[0])
CASES = [
    ("dense", DENSE, "auto", None, [], True, "v2", "policy", "dense architecture LlamaForCausalLM"),
    ("moe-off-list", MIXTRAL, "auto", None, [], True, "v1", "policy",
     "not on DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES"),
    ("moe-on-list", QWEN2_MOE, "auto", None, [], True, "v2", "policy",
     "Qwen2MoeForCausalLM is on DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES"),
    ("hybrid-off-list", JAMBA, "auto", None, [], True, "v1", "policy", "hybrid"),
    ("hybrid-on-list", HYBRID_LISTED, "auto", None, [], True, "v2", "policy", "hybrid"),
    ("attention-free", MAMBA, "auto", None, [], True, "v1", "policy", "attention-free"),
    ("env-0", DENSE, "auto", False, [], True, "v1", "env", "RUNNERLAB_USE_V2_MODEL_RUNNER=0"),
    ("env-1-moe", MIXTRAL, "auto", True, [], True, "v2", "env", "RUNNERLAB_USE_V2_MODEL_RUNNER=1"),
    ("env-1-attention-free", MAMBA, "auto", True, [], True, "v2", "env", "=1"),
    ("arg-v1-beats-env-1", DENSE, "v1", True, [], True, "v1", "argument", "model_runner='v1'"),
    ("arg-v2-beats-env-0", MIXTRAL, "v2", False, [], True, "v2", "argument", "model_runner='v2'"),
    ("arg-v1", DENSE, "v1", None, [], True, "v1", "argument", "model_runner='v1'"),
    ("no-triton", DENSE, "auto", None, [], False, "v1", "policy", "requires Triton"),
    ("no-triton-v1-anyway", MIXTRAL, "auto", None, [], False, "v1", "policy", "MoE"),
    ("no-triton-arg-v1", DENSE, "v1", None, [], False, "v1", "argument", "model_runner='v1'"),
    ("v2-feature-fallback", DENSE, "auto", None, [V1_ONLY], True, "v1", "policy",
     f"V2 does not yet support {V1_ONLY}"),
    ("v2-feature-v1-model", MIXTRAL, "auto", None, [V1_ONLY], True, "v1", "policy", "MoE"),
    ("v2-feature-arg-v1", DENSE, "v1", None, [V1_ONLY], True, "v1", "argument", "model_runner"),
    ("v2-feature-env-0", DENSE, "auto", False, [V1_ONLY], True, "v1", "env", "=0"),
]


@pytest.fixture
def v1_only_feature(monkeypatch):
    """A feature only V1 supports, independent of the real table's rows (whose one
    V1-only row, ngram speculative decoding, has its own tests in test_speculative.py):
    cudagraph_mode='PIECEWISE' V1-only, as the table stood before V2 got piecewise graphs,
    for the fallback rule and its messages."""
    extra = Feature(V1_ONLY, SUPPORTED, UNSUPPORTED, "cudagraph_mode='auto'",
                    lambda s: s["cudagraph_mode"] == "PIECEWISE", "test")
    monkeypatch.setattr(feature_table, "FEATURES", feature_table.FEATURES + (extra,))


def _no_triton(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(selection, "find_spec", lambda name: None if name == "triton" else real(name))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decision_table(monkeypatch, v1_only_feature, case):
    _, model, arg, env, requested, triton, runner, source, headline = case
    if not triton:
        _no_triton(monkeypatch)
    decision = decide_runner(model, requested, model_runner=arg, env_use_v2=env)
    assert (decision.runner, decision.source) == (runner, source)
    assert headline in decision.reasons[0]
    assert decision.runner_class == f"runner_{runner}.model_runner:GPUModelRunner"
    assert decision.unsupported_v2 == [f for f in requested if f == V1_ONLY]
    assert decision.error is None


def test_moe_reason_names_the_allow_list():
    reason = decide_runner(MIXTRAL, []).reasons[0]
    for arch in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES:
        assert arch in reason


def test_allow_list_is_moe_only_and_excludes_mixtral():
    assert "MixtralForCausalLM" not in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES
    assert "Qwen2MoeForCausalLM" in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES
    assert "LlamaForCausalLM" not in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES


def test_argument_reports_the_overridden_env_and_the_policy():
    reasons = decide_runner(DENSE, [], model_runner="v1", env_use_v2=True).reasons
    assert any("RUNNERLAB_USE_V2_MODEL_RUNNER=1 is overridden" in r for r in reasons)
    assert any("policy would choose V2" in r for r in reasons)


def test_warnings_on_fallbacks(monkeypatch, v1_only_feature):
    fallback = decide_runner(DENSE, [V1_ONLY])
    assert len(fallback.warnings) == 1
    assert V1_ONLY in fallback.warnings[0] and "cudagraph_mode='auto'" in fallback.warnings[0]
    assert decide_runner(DENSE, []).warnings == []
    _no_triton(monkeypatch)
    no_triton = decide_runner(DENSE, [])
    assert len(no_triton.warnings) == 1 and "Triton" in no_triton.warnings[0]


# (id, model, model_runner, env, features, triton, texts the error must contain)
ERRORS = [
    ("env-1-no-triton", DENSE, "auto", True, [], False,
     ["RUNNERLAB_USE_V2_MODEL_RUNNER=1", "Triton"]),
    ("arg-v2-no-triton", DENSE, "v2", None, [], False, ["model_runner='v2'", "Triton"]),
    ("env-1-v2-unsupported", DENSE, "auto", True, [V1_ONLY], True,
     [V1_ONLY, "V1 supports them", "model_runner='v1'", "cudagraph_mode='auto'"]),
    ("arg-v2-v2-unsupported", MIXTRAL, "v2", None, [V1_ONLY], True, [V1_ONLY, "V1"]),
    ("auto-no-runner", DENSE, "auto", None, [NO_RUNNER], True,
     [NO_RUNNER, "No model runner supports", "enable_prompt_embeds=False"]),
    ("arg-v1-no-runner", DENSE, "v1", None, [NO_RUNNER], True,
     [NO_RUNNER, "enable_prompt_embeds=False"]),
    ("env-0-no-runner", MIXTRAL, "auto", False, [NO_RUNNER, V1_ONLY], True, [NO_RUNNER]),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_decision_errors(monkeypatch, v1_only_feature, case):
    _, model, arg, env, requested, triton, texts = case
    if not triton:
        _no_triton(monkeypatch)
    with pytest.raises(RunnerSelectionError) as err:
        decide_runner(model, requested, model_runner=arg, env_use_v2=env)
    for text in texts:
        assert text in str(err.value)
    # explain's non-strict mode records the same message instead of raising
    decision = decide_runner(model, requested, model_runner=arg, env_use_v2=env, strict=False)
    assert decision.error == str(err.value)


V2_ONLY = "v2-only test feature"


@pytest.fixture
def v2_only_feature(monkeypatch):
    """A feature only V2 supports, independent of the real table's rows (block
    verification is tested in test_speculative.py): the forcing rule."""
    extra = Feature(V2_ONLY, UNSUPPORTED, SUPPORTED, "test_feature=False",
                    lambda s: False, "test")
    monkeypatch.setattr(feature_table, "FEATURES", feature_table.FEATURES + (extra,))


def test_forced_by_v2_only_feature(v2_only_feature):
    decision = decide_runner(MIXTRAL, [V2_ONLY])
    assert (decision.runner, decision.source) == ("v2", "forced")
    assert V2_ONLY in decision.reasons[0]
    assert any("policy would choose V1" in r for r in decision.reasons)


def test_forcing_rule_loses_to_env_and_argument(v2_only_feature):
    for kwargs in ({"env_use_v2": False}, {"model_runner": "v1"}):
        with pytest.raises(RunnerSelectionError, match=V2_ONLY):
            decide_runner(DENSE, [V2_ONLY], **kwargs)


@pytest.mark.parametrize("kwargs", [{}, {"env_use_v2": True}, {"env_use_v2": False},
                                    {"model_runner": "v1"}, {"model_runner": "v2"}])
def test_features_that_split_the_runners_are_an_error_whatever_the_source(
        v1_only_feature, v2_only_feature, kwargs):
    with pytest.raises(RunnerSelectionError) as err:
        decide_runner(DENSE, [V2_ONLY, V1_ONLY], **kwargs)
    assert str(err.value) == (
        f"No model runner supports {V1_ONLY} together with {V2_ONLY}: {V1_ONLY} is supported "
        f"only by V1, {V2_ONLY} only by V2; drop one side: set cudagraph_mode='auto' or "
        "test_feature=False.")


def test_forced_v2_without_triton_is_an_error(monkeypatch, v2_only_feature):
    _no_triton(monkeypatch)
    with pytest.raises(RunnerSelectionError, match="forcing rule.*Triton"):
        decide_runner(DENSE, [V2_ONLY])


def test_unimplemented_architecture_is_reported():
    decision = decide_runner(MAMBA, [])
    assert "runnerlab implements neither runner for MambaForCausalLM" in decision.reasons


# ------------------------------------------------------------ end to end through EngineArgs

def _config(monkeypatch, env=None, **kwargs):
    if env is not None:
        monkeypatch.setenv("RUNNERLAB_USE_V2_MODEL_RUNNER", env)
    return EngineArgs(dtype="float32", device="cpu", **kwargs).create_engine_config()


@pytest.mark.parametrize("model, env, arg, runner, source", [
    ("tiny-llama", None, "auto", "v2", "policy"),
    ("tiny-qwen3", None, "auto", "v2", "policy"),
    ("tiny-mixtral", None, "auto", "v1", "policy"),
    ("tiny-qwen2-moe", None, "auto", "v2", "policy"),
    ("tiny-llama", "0", "auto", "v1", "env"),
    ("tiny-mixtral", "true", "auto", "v2", "env"),
    ("tiny-llama", "1", "v1", "v1", "argument"),
    ("tiny-mixtral", "0", "v2", "v2", "argument"),
])
def test_engine_config_decisions(monkeypatch, model, env, arg, runner, source):
    cfg = _config(monkeypatch, env, model=model, model_runner=arg)
    assert cfg.runner_decision.runner == runner and cfg.runner_decision.source == source
    assert cfg.use_v2_model_runner is (runner == "v2")
    assert cfg.v2_unsupported_features() == []


def test_bad_env_value_fails_create_engine_config(monkeypatch):
    with pytest.raises(ValueError, match="RUNNERLAB_USE_V2_MODEL_RUNNER='maybe'.*'true'"):
        _config(monkeypatch, "maybe", model="tiny-llama")


def test_forced_v2_with_unsupported_feature_fails_at_config_time(monkeypatch):
    v1_proc = "runner_v1.example_logits_processors:NoRepeatNGram"
    with pytest.raises(RunnerSelectionError, match=r"custom logits processors \(V1 interface\) "
                                                   r"\[runner_v1.example_logits_processors"):
        _config(monkeypatch, "1", model="tiny-llama", logits_processors=[v1_proc])
    with pytest.raises(RunnerSelectionError, match="custom logits processors"):
        _config(monkeypatch, model="tiny-llama", model_runner="v2", logits_processors=[v1_proc])


def test_fallback_end_to_end_on_cuda(fake_cuda, v1_only_feature):
    cfg = EngineArgs(model="tiny-llama", device="cuda", cudagraph_mode="PIECEWISE",
                     ).create_engine_config()
    assert cfg.runner_decision.runner == "v1" and cfg.runner_decision.source == "policy"
    assert cfg.v2_unsupported_features() == [V1_ONLY]
    assert cfg.compilation_config.cudagraph_mode == "PIECEWISE"


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_piecewise_modes_keep_v2_on_cuda(fake_cuda, mode):
    cfg = EngineArgs(model="tiny-llama", device="cuda", cudagraph_mode=mode).create_engine_config()
    assert (cfg.runner_decision.runner, cfg.runner_decision.source) == ("v2", "policy")
    assert cfg.v2_unsupported_features() == []
    assert cfg.compilation_config.cudagraph_mode == mode


# ------------------------------------------------------------------------- the log line

def _decision_lines(caplog):
    return [r for r in caplog.records if r.name == "runnerlab" and r.levelno == logging.INFO
            and r.getMessage().startswith("Model runner:")]


def test_log_line_once_per_create_engine_config(caplog):
    caplog.set_level(logging.INFO, logger="runnerlab")
    args = EngineArgs(model="tiny-llama", dtype="float32", device="cpu")
    args.create_engine_config()
    lines = _decision_lines(caplog)
    assert [r.getMessage() for r in lines] == [
        "Model runner: V2 (runner_v2.model_runner:GPUModelRunner) — "
        "policy: dense architecture LlamaForCausalLM is eligible"
    ]
    args.create_engine_config()
    assert len(_decision_lines(caplog)) == 2


@pytest.mark.parametrize("env, arg, expected", [
    ("0", "auto", "Model runner: V1 (runner_v1.model_runner:GPUModelRunner) — env: "
                  "RUNNERLAB_USE_V2_MODEL_RUNNER=0"),
    (None, "v1", "Model runner: V1 (runner_v1.model_runner:GPUModelRunner) — argument: "
                 "model_runner='v1'"),
])
def test_log_line_sources(monkeypatch, caplog, env, arg, expected):
    caplog.set_level(logging.INFO, logger="runnerlab")
    _config(monkeypatch, env, model="tiny-llama", model_runner=arg)
    assert [r.getMessage() for r in _decision_lines(caplog)] == [expected]


def test_log_line_moe_names_allow_list(caplog):
    caplog.set_level(logging.INFO, logger="runnerlab")
    EngineArgs(model="tiny-mixtral", device="cpu").create_engine_config()
    (line,) = _decision_lines(caplog)
    assert line.getMessage().startswith("Model runner: V1 (runner_v1.model_runner:GPUModelRunner)"
                                        " — policy: MoE architecture MixtralForCausalLM is not on "
                                        "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES")


def test_fallback_logs_warning_and_one_decision_line(fake_cuda, v1_only_feature, caplog):
    caplog.set_level(logging.INFO, logger="runnerlab")
    EngineArgs(model="tiny-llama", device="cuda", cudagraph_mode="PIECEWISE"
               ).create_engine_config()
    (line,) = _decision_lines(caplog)
    assert "V1" in line.getMessage() and V1_ONLY in line.getMessage()
    assert "cudagraph_mode='auto'" in line.getMessage()  # how to drop the feature
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and V1_ONLY in warnings[0].getMessage()


def test_explain_config_does_not_log(caplog):
    caplog.set_level(logging.INFO, logger="runnerlab")
    EngineArgs(model="tiny-llama", device="cpu").create_explain_config()
    assert _decision_lines(caplog) == []
