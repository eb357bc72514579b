"""The package's public surface and its place at the bottom of the import graph."""

import ast
from pathlib import Path

import policy

POLICY_DIR = Path(policy.__file__).resolve().parent
FORBIDDEN = ("shared", "runner_v1", "runner_v2")


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_policy_imports_nothing_else_of_the_project():
    files = sorted(POLICY_DIR.rglob("*.py"))
    assert len(files) >= 10
    for path in files:
        for name in _imported_modules(path):
            assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_public_names():
    for name in ("EngineArgs", "EngineConfig", "RunnerDecision",
                 "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES", "RUNNERLAB_ARCHITECTURES",
                 "add_engine_args", "engine_args_from_namespace"):
        assert hasattr(policy, name), name
    from policy.explain import explain_main

    assert callable(explain_main)


def test_decision_fields():
    cfg = policy.EngineArgs(model="tiny-llama", dtype="float32", device="cpu").create_engine_config()
    d = cfg.runner_decision
    assert isinstance(d, policy.RunnerDecision)
    assert (d.runner, d.source, d.unsupported_v2) == ("v2", "policy", [])
    assert d.runner_class == "runner_v2.model_runner:GPUModelRunner" and d.reasons
    assert cfg.use_v2_model_runner is True and cfg.v2_unsupported_features() == []
    assert cfg.model_config.architecture == "LlamaForCausalLM"  # vLLM's attribute name
