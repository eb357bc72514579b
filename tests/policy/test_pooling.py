"""Pooling at config time, against tables written here by hand from vLLM's behaviour: which
runner pools which task from each source (V1 every task; V2 embed, classify and score),
the pooler each task gets on each kind of model and what it refuses, the settings that
cannot go with pooling, and the CUDA graphs a pooling engine captures."""

import argparse
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from policy import EngineArgs, RunnerSelectionError
from policy import features as feature_table
from policy.config import SchedulerConfig, resolve_compilation
from policy.explain import explain_main
from policy.pooling import PoolerConfig, PoolerSettings, model_head, resolve_pooler
from tests.policy.pooling_models import (
    NUM_LABELS,
    SEQ_CLS,
    TOKEN_CLS,
    classifier_dir,
)

CAUSAL = "LlamaForCausalLM"
ENV = "RUNNERLAB_USE_V2_MODEL_RUNNER"


def _model_args(architecture: str) -> dict:
    if architecture == CAUSAL:
        return {"model": "tiny-llama"}
    return {"model": classifier_dir(architecture), "load_format": "dummy"}


# ---- which runner, per task x source --------------------------------------------------

# the model each task runs on here: one with the head the task needs
TASK_MODEL = {"embed": CAUSAL, "classify": SEQ_CLS, "score": CAUSAL,
              "token_embed": CAUSAL, "token_classify": TOKEN_CLS}
SOURCES = {  # source -> (env value, model_runner)
    "policy": (None, "auto"), "env 0": ("0", "auto"), "env 1": ("1", "auto"),
    "argument v1": (None, "v1"), "argument v2": (None, "v2"),
}
WARNS = "warns"  # V1 with the policy's fallback warning
# (task, source) -> runner, (runner, WARNS) or the texts of the config-time error
EXPECTED = {
    ("embed", "policy"): "v2", ("embed", "env 0"): "v1", ("embed", "env 1"): "v2",
    ("embed", "argument v1"): "v1", ("embed", "argument v2"): "v2",
    ("classify", "policy"): "v2", ("classify", "env 0"): "v1", ("classify", "env 1"): "v2",
    ("classify", "argument v1"): "v1", ("classify", "argument v2"): "v2",
    ("score", "policy"): "v2", ("score", "env 0"): "v1", ("score", "env 1"): "v2",
    ("score", "argument v1"): "v1", ("score", "argument v2"): "v2",
    ("token_embed", "policy"): ("v1", WARNS), ("token_embed", "env 0"): "v1",
    ("token_embed", "env 1"): [
        "Model runner V2", "RUNNERLAB_USE_V2_MODEL_RUNNER=1", "pooling task token_embed",
        "RUNNERLAB_USE_V2_MODEL_RUNNER=0", "model_runner='v1'", "pooling_task=None"],
    ("token_embed", "argument v1"): "v1",
    # the argument beats the env var, so the way out named is the argument
    ("token_embed", "argument v2"): [
        "Model runner V2", "model_runner='v2'", "pooling task token_embed",
        "model_runner='v1'", "pooling_task=None"],
    ("token_classify", "policy"): ("v1", WARNS), ("token_classify", "env 0"): "v1",
    ("token_classify", "env 1"): [
        "Model runner V2", "RUNNERLAB_USE_V2_MODEL_RUNNER=1", "pooling task token_classify",
        "RUNNERLAB_USE_V2_MODEL_RUNNER=0", "model_runner='v1'", "pooling_task=None"],
    ("token_classify", "argument v1"): "v1",
    ("token_classify", "argument v2"): [
        "Model runner V2", "model_runner='v2'", "pooling task token_classify",
        "model_runner='v1'", "pooling_task=None"],
}


def _pooling_args(monkeypatch, task, source, **extra) -> EngineArgs:
    env, runner = SOURCES[source]
    if env is not None:
        monkeypatch.setenv(ENV, env)
    return EngineArgs(device="cpu", pooling_task=task, model_runner=runner,
                      **_model_args(TASK_MODEL[task]), **extra)


def test_expectations_cover_every_task_and_source():
    assert sorted(EXPECTED) == sorted((t, s) for t in TASK_MODEL for s in SOURCES)


@pytest.mark.parametrize("task, source", sorted(EXPECTED))
def test_runner_per_task_and_source(monkeypatch, task, source):
    expected = EXPECTED[(task, source)]
    args = _pooling_args(monkeypatch, task, source)
    if isinstance(expected, list):
        with pytest.raises(RunnerSelectionError) as err:
            args.create_engine_config()
        for text in expected:
            assert text in str(err.value), str(err.value)
        # explain reports the same decision instead of raising
        config, _ = args.create_explain_config()
        assert config.runner_decision.error == str(err.value)
        return
    runner, warns = (expected, False) if isinstance(expected, str) else (expected[0], True)
    config = args.create_engine_config()
    assert config.runner_decision.runner == runner
    assert config.pooling_task == task and config.pooler_config.task == task
    assert config.requested_features() == [f"pooling task {task}"]
    warnings = config.runner_decision.warnings
    if warns:
        assert warnings == [f"Model runner V2 does not yet support pooling task {task}; "
                            "using V1 (set pooling_task=None to use V2)"]
    else:
        assert warnings == []


def test_no_task_requests_no_pooling_feature():
    config = EngineArgs(model="tiny-llama", device="cpu").create_engine_config()
    assert config.pooling_task is None and config.pooler_config is None
    assert not any(f.startswith("pooling") for f in config.requested_features())


def test_task_names_are_the_contracts():
    from policy import pooling
    from shared.contract.pooling import POOLING_TASKS, TOKEN_TASKS

    assert pooling.POOLING_TASKS == POOLING_TASKS and pooling.TOKEN_TASKS == TOKEN_TASKS
    labels = [f.label for f in feature_table.FEATURES if f.label.startswith("pooling")]
    assert labels == [f"pooling task {t}" for t in POOLING_TASKS]


# ---- the pooler, per task x architecture ----------------------------------------------

# (task, architecture) -> (pooling_type, normalize, use_activation, head, num_labels,
# applies_head), or the texts of the ValueError
HIDDEN, SEQ, TOK = "hidden", "sequence_classifier", "token_classifier"
POOLERS = {
    ("embed", CAUSAL): ("LAST", True, None, HIDDEN, None, False),
    ("embed", SEQ_CLS): ("LAST", True, None, SEQ, 3, False),   # the base model's states
    ("embed", TOKEN_CLS): ("LAST", True, None, TOK, 5, False),
    ("token_embed", CAUSAL): ("ALL", True, None, HIDDEN, None, False),
    ("token_embed", SEQ_CLS): ("ALL", True, None, SEQ, 3, False),
    ("token_embed", TOKEN_CLS): ("ALL", True, None, TOK, 5, False),
    ("classify", CAUSAL): ["pooling_task='classify'", CAUSAL, "no classification head",
                           "needs a sequence-classification head",
                           "'embed', 'score', 'token_embed'", "*ForSequenceClassification"],
    ("classify", SEQ_CLS): ("LAST", None, True, SEQ, 3, True),
    ("classify", TOKEN_CLS): ["pooling_task='classify'", TOKEN_CLS,
                              "has a token-classification head",
                              "'embed', 'score', 'token_embed', 'token_classify'",
                              "*ForSequenceClassification"],
    ("token_classify", CAUSAL): ["pooling_task='token_classify'", CAUSAL,
                                 "needs a token-classification head",
                                 "'embed', 'score', 'token_embed'", "*ForTokenClassification"],
    ("token_classify", SEQ_CLS): ["pooling_task='token_classify'", SEQ_CLS,
                                  "has a sequence-classification head",
                                  "'embed', 'classify', 'score', 'token_embed'",
                                  "*ForTokenClassification"],
    ("token_classify", TOKEN_CLS): ("ALL", None, True, TOK, 5, True),
    # score: cosine similarity of embeddings, except on a sequence classifier (its class
    # probability: a cross-encoder)
    ("score", CAUSAL): ("LAST", True, None, HIDDEN, None, False),
    ("score", SEQ_CLS): ("LAST", None, True, SEQ, 3, True),
    ("score", TOKEN_CLS): ("LAST", True, None, TOK, 5, False),
}


def _stand_in(architecture: str) -> SimpleNamespace:
    """Only what resolve_pooler reads of a ModelConfig."""
    labels = NUM_LABELS.get(architecture)
    return SimpleNamespace(model="stand-in", architecture=architecture,
                           hf_config=SimpleNamespace(num_labels=labels) if labels else None)


def _check_pooler(settings: PoolerSettings, task: str, expected: tuple) -> None:
    assert settings.task == task
    got = (settings.pooling_type, settings.normalize, settings.use_activation, settings.head,
           settings.num_labels, settings.applies_head)
    assert got == expected


@pytest.mark.parametrize("task, architecture", sorted(POOLERS))
def test_pooler_defaults_and_refusals(task, architecture):
    expected = POOLERS[(task, architecture)]
    if isinstance(expected, list):
        with pytest.raises(ValueError) as err:
            resolve_pooler(task, None, _stand_in(architecture))
        for text in expected:
            assert text in str(err.value), str(err.value)
    else:
        _check_pooler(resolve_pooler(task, None, _stand_in(architecture)), task, expected)


@pytest.mark.parametrize("task, architecture", sorted(POOLERS))
def test_pooler_through_engine_args(task, architecture):
    """The same table through EngineArgs, with configs transformers wrote (the head's size
    read from the config's id2label)."""
    args = EngineArgs(device="cpu", pooling_task=task, **_model_args(architecture))
    expected = POOLERS[(task, architecture)]
    if isinstance(expected, list):
        with pytest.raises(ValueError, match=f"pooling_task='{task}'"):
            args.create_engine_config()
    else:
        _check_pooler(args.create_engine_config().pooler_config, task, expected)


@pytest.mark.parametrize("architecture, head", [
    (CAUSAL, HIDDEN), (SEQ_CLS, SEQ), (TOKEN_CLS, TOK), ("BertModel", HIDDEN),
    ("Qwen2ForSequenceClassification", SEQ), ("BertForTokenClassification", TOK),
])
def test_head_from_the_architecture_name(architecture, head):
    assert model_head(architecture) == head


# (task, architecture, PoolerConfig fields) -> expected tuple, or the error's texts
OVERRIDES = [
    ("embed", CAUSAL, {"pooling_type": "MEAN", "normalize": False},
     ("MEAN", False, None, HIDDEN, None, False)),
    ("embed", CAUSAL, {"pooling_type": "CLS"}, ("CLS", True, None, HIDDEN, None, False)),
    ("classify", SEQ_CLS, {"pooling_type": "MEAN", "use_activation": False},
     ("MEAN", None, False, SEQ, 3, True)),
    ("classify", SEQ_CLS, {"pooling_type": "CLS"}, ("CLS", None, True, SEQ, 3, True)),
    ("score", CAUSAL, {"pooling_type": "MEAN", "normalize": False},
     ("MEAN", False, None, HIDDEN, None, False)),
    ("score", SEQ_CLS, {"use_activation": False}, ("LAST", None, False, SEQ, 3, True)),
    ("token_embed", CAUSAL, {"normalize": False}, ("ALL", False, None, HIDDEN, None, False)),
    ("token_classify", TOKEN_CLS, {"use_activation": False},
     ("ALL", None, False, TOK, 5, True)),
    ("token_embed", CAUSAL, {"pooling_type": "LAST"},
     ["pooler_config.pooling_type='LAST'", "pooling_task='token_embed'", "every prompt token"]),
    ("token_classify", TOKEN_CLS, {"pooling_type": "MEAN"},
     ["pooler_config.pooling_type='MEAN'", "pooling_task='token_classify'"]),
    ("classify", SEQ_CLS, {"normalize": True},
     ["pooler_config.normalize=True", "pooling_task='classify'", "use_activation"]),
    ("embed", CAUSAL, {"use_activation": True},
     ["pooler_config.use_activation=True", "pooling_task='embed'", "normalize"]),
    ("score", CAUSAL, {"use_activation": False}, ["pooler_config.use_activation=False"]),
    ("score", SEQ_CLS, {"normalize": False}, ["pooler_config.normalize=False"]),
]


@pytest.mark.parametrize("task, architecture, fields, expected", OVERRIDES)
def test_pooler_overrides(task, architecture, fields, expected):
    config = PoolerConfig(**fields)
    if isinstance(expected, list):
        with pytest.raises(ValueError) as err:
            resolve_pooler(task, config, _stand_in(architecture))
        for text in expected:
            assert text in str(err.value), str(err.value)
    else:
        _check_pooler(resolve_pooler(task, config, _stand_in(architecture)), task, expected)


def test_no_task():
    assert resolve_pooler(None, None, _stand_in(CAUSAL)) is None
    with pytest.raises(ValueError) as err:
        EngineArgs(model="tiny-llama", device="cpu",
                   pooler_config={"normalize": False}).create_engine_config()
    assert "pooler_config={'normalize': False}" in str(err.value)
    assert "pooling_task=None" in str(err.value)


@pytest.mark.parametrize("fields, texts", [
    ({"pooling_type": "ALL"}, ["pooling_type", "'LAST'", "'MEAN'", "'CLS'"]),
    ({"pooling": "MEAN"}, ["pooling", "Extra inputs are not permitted"]),
    ({"normalize": "sometimes"}, ["normalize"]),
])
def test_pooler_config_fields_are_checked(fields, texts):
    with pytest.raises(ValidationError) as err:
        EngineArgs(model="tiny-llama", pooling_task="embed", pooler_config=fields)
    for text in texts:
        assert text in str(err.value)


def test_classifier_without_num_labels_is_refused():
    model = SimpleNamespace(model="m", architecture=SEQ_CLS, hf_config=None)
    with pytest.raises(ValueError, match="no num_labels"):
        resolve_pooler("classify", None, model)


# ---- settings that cannot go with pooling ---------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 2}
PROCESSOR = "runner_v1.example_logits_processors:NoRepeatNGram"
CLASHES = [
    ({"speculative_config": NGRAM}, ["speculative_config=None"]),
    ({"logits_processors": [PROCESSOR]}, ["logits_processors=[]"]),
    ({"async_scheduling": True}, ["async_scheduling=False"]),
    ({"speculative_config": NGRAM, "logits_processors": [PROCESSOR], "async_scheduling": True},
     ["speculative_config=None, logits_processors=[], async_scheduling=False"]),
]


@pytest.mark.parametrize("task", ["embed", "token_embed"])
@pytest.mark.parametrize("fields, texts", CLASHES)
def test_refused_with_pooling(task, fields, texts):
    args = EngineArgs(model="tiny-llama", device="cpu", pooling_task=task, **fields)
    for build in (args.create_engine_config, args.create_explain_config):
        with pytest.raises(ValueError) as err:
            build()
        assert not isinstance(err.value, RunnerSelectionError)  # whatever the runner
        for text in [f"pooling_task={task!r}", "prefill only", "pooling_task=None", *texts]:
            assert text in str(err.value), str(err.value)
    if len(fields) == 1:  # without the task, each alone is accepted
        args.pooling_task = None
        assert args.create_engine_config().pooler_config is None


# ---- CUDA graphs ----------------------------------------------------------------------

@pytest.mark.parametrize("task, mode, enforce_eager, resolved", [
    (None, "auto", False, "FULL_AND_PIECEWISE"),   # generation: FULL graphs for decode
    ("embed", "auto", False, "PIECEWISE"),         # pooling: never a uniform decode batch
    ("token_embed", "auto", False, "PIECEWISE"),
    ("embed", "auto", True, "NONE"),
    ("embed", "PIECEWISE", False, "PIECEWISE"),
    ("embed", "NONE", False, "NONE"),
])
def test_cudagraph_mode_with_pooling(fake_cuda, task, mode, enforce_eager, resolved):
    config = EngineArgs(model="tiny-llama", device="cuda", pooling_task=task,
                        cudagraph_mode=mode, enforce_eager=enforce_eager,
                        max_num_seqs=8).create_engine_config()
    compilation = config.compilation_config
    assert compilation.cudagraph_mode == resolved
    assert compilation.cudagraph_mode_requested == mode
    # every mode here captures piecewise graphs, which reach 2 x max_num_seqs tokens
    assert compilation.cudagraph_capture_sizes == ([] if resolved == "NONE" else [1, 2, 4, 8, 16])


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
def test_full_graphs_with_pooling_are_refused(fake_cuda, mode):
    args = EngineArgs(device="cuda", pooling_task="classify",
                      cudagraph_mode=mode, **_model_args(SEQ_CLS))
    with pytest.raises(ValueError) as err:
        args.create_engine_config()
    for text in [f"cudagraph_mode={mode!r}", "pooling_task='classify'", "'PIECEWISE'",
                 "prefill only"]:
        assert text in str(err.value), str(err.value)


def test_cpu_pooling_engine_has_no_graphs():
    scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                enable_chunked_prefill=True)
    compilation = resolve_compilation("cpu", "auto", False, None, scheduler,
                                      pooling_task="embed")
    assert (compilation.cudagraph_mode, compilation.cudagraph_capture_sizes) == ("NONE", [])


# ---- explain and the command line -----------------------------------------------------

def test_explain_shows_the_pooler(capsys):
    argv = ["--model", classifier_dir(SEQ_CLS), "--load-format", "dummy", "--device", "cpu",
            "--pooling-task", "classify", "--pooler-config", '{"pooling_type": "MEAN"}']
    assert explain_main(argv) == 0
    text = capsys.readouterr().out
    assert ("Pooling: task classify, pooling MEAN, softmax yes; model head "
            "sequence_classifier (3 labels); pools the head's output") in text
    assert explain_main(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pooler_config"] == {
        "task": "classify", "pooling_type": "MEAN", "normalize": None, "use_activation": True,
        "head": "sequence_classifier", "num_labels": 3, "applies_head": True}
    assert report["requested_features"] == ["pooling task classify"]


def test_explain_without_a_task(capsys):
    assert explain_main(["--model", "tiny-llama", "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pooler_config"] is None
    assert explain_main(["--model", "tiny-llama", "--device", "cpu"]) == 0
    assert "Pooling:" not in capsys.readouterr().out


def test_explain_token_task_forced_on_v2(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "1")
    assert explain_main(["--model", "tiny-llama", "--device", "cpu",
                         "--pooling-task", "token_embed"]) == 1
    out = capsys.readouterr().out
    assert "error: " in out and "pooling task token_embed" in out
    assert "RUNNERLAB_USE_V2_MODEL_RUNNER=0" in out
    assert "Pooling: task token_embed, pooling ALL, normalize yes" in out


def test_pooler_config_flag_is_json():
    from policy import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--model", "tiny-llama", "--pooling-task", "embed",
                            "--pooler-config", '{"pooling_type": "CLS", "normalize": false}'])
    args = engine_args_from_namespace(ns)
    assert args.pooler_config == PoolerConfig(pooling_type="CLS", normalize=False)


def test_engine_config_dump_carries_the_pooler():
    config = EngineArgs(model="tiny-llama", device="cpu",
                        pooling_task="token_embed").create_engine_config()
    dump = config.model_dump()
    assert dump["pooling_task"] == "token_embed"
    assert dump["pooler_config"]["pooling_type"] == "ALL"


def test_the_checkpoints_own_pooling_mode_is_the_default(tmp_path):
    """A sentence-transformers directory's 1_Pooling/config.json sets the default pooling
    type; pooler_config overrides it; an ambiguous file is refused."""
    import json
    import types

    from policy.pooling import PoolerConfig, resolve_pooler

    (tmp_path / "1_Pooling").mkdir()
    cfg = tmp_path / "1_Pooling" / "config.json"
    model = types.SimpleNamespace(architecture="LlamaForCausalLM", hf_config=None,
                                  model_dir=str(tmp_path))
    cfg.write_text(json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}))
    assert resolve_pooler("embed", None, model).pooling_type == "MEAN"
    assert resolve_pooler("embed", PoolerConfig(pooling_type="CLS"), model).pooling_type == "CLS"
    cfg.write_text(json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match="exactly one"):
        resolve_pooler("embed", None, model)
    model.model_dir = None
    assert resolve_pooler("embed", None, model).pooling_type == "LAST"
