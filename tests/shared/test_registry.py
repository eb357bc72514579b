"""The model registry agrees with the policy's copy of it, and the import direction of
DESIGN.md §1 holds: policy <- shared <- runner_v1, runner_v2.

- policy imports nothing else of the project;
- a runner never imports the other runner;
- shared reaches a runner only through the qualified class name in the policy's decision
  (importlib with a computed name), never a static import nor a literal module name.

Checked twice: statically over every module's syntax tree (imports inside functions
included), and at run time in fresh interpreters (which modules actually get loaded).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import policy
from shared.engine import resolve_runner_class
from shared.model.registry import SUPPORTED_ARCHITECTURES, get_model_class

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("policy", "shared", "runner_v1", "runner_v2")


def test_policy_architectures_equal_the_model_registry():
    assert set(policy.RUNNERLAB_ARCHITECTURES) == set(SUPPORTED_ARCHITECTURES)
    for arch in SUPPORTED_ARCHITECTURES:
        assert get_model_class(arch).__name__ == arch


def test_runner_classes_resolve_to_their_runner():
    for runner, path in policy.RUNNER_CLASSES.items():
        assert path.split(".")[0] == f"runner_{runner}"
        cls = resolve_runner_class(path)
        assert cls.runner_name == runner and cls.__module__ == path.partition(":")[0]


# ---- static check ---------------------------------------------------------------------
def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """Every module `source` imports: import / from-import statements (relative ones
    resolved against `package`, the package the file belongs to), and
    importlib.import_module / __import__ calls with a literal name. -> [(line, name)]."""
    package_parts = package.split(".")
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(
                node.args[0].value, str
            ):
                found.append((node.lineno, node.args[0].value))
    return found


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def project_modules(package: str) -> list[tuple[Path, str]]:
    """(file, the dotted package it belongs to) for every module under `package`."""
    return [
        (path, ".".join(path.parent.relative_to(ROOT).parts))
        for path in sorted((ROOT / package).rglob("*.py"))
    ]


FORBIDDEN = {
    "policy": {"shared", "runner_v1", "runner_v2", "tests", "scripts"},
    "shared": {"runner_v1", "runner_v2", "tests", "scripts"},
    "runner_v1": {"runner_v2", "tests", "scripts"},
    "runner_v2": {"runner_v1", "tests", "scripts"},
}


def violations_in(source: str, package: str) -> list[str]:
    top = package.split(".")[0]
    return [name for _, name in imported_modules(source, package)
            if name.split(".")[0] in FORBIDDEN[top]]


def violations(package: str) -> list[str]:
    bad = []
    for path, containing_package in project_modules(package):
        for line, name in imported_modules(path.read_text(), containing_package):
            if name.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("package", PACKAGES)
def test_import_direction(package):
    assert project_modules(package), f"no modules found under {package}/"
    assert violations(package) == []


def test_the_checker_sees_every_form_of_import():
    source = textwrap.dedent("""
        import shared.engine
        from runner_v2 import model_runner
        from . import sibling
        from ..other import thing
        def later():
            import runner_v1.sampler as s
            importlib.import_module("runner_v2.model_runner")
            __import__("tests.conftest")
            importlib.import_module(computed_name)   # not a literal: allowed
    """)
    names = [name for _, name in imported_modules(source, "shared.bench")]
    assert sorted(names) == sorted([
        "shared.engine", "runner_v2", "shared.bench", "shared.other",
        "runner_v1.sampler", "runner_v2.model_runner", "tests.conftest",
    ])
    assert violations_in(source, "shared") == [
        "runner_v2", "runner_v1.sampler", "runner_v2.model_runner", "tests.conftest"]


def test_the_engine_reaches_runners_through_the_decision():
    # The one dynamic import in shared/ that may name a runner takes the decision's path.
    source = (ROOT / "shared" / "engine.py").read_text()
    assert "resolve_runner_class(self.decision.runner_class)" in source


# ---- run-time check -------------------------------------------------------------------
_PROBE = textwrap.dedent("""
    import json, sys

    def loaded():
        return sorted({m.split(".")[0] for m in sys.modules} & {
            "policy", "shared", "runner_v1", "runner_v2"})

    stages = {}
    import policy
    cfg = policy.EngineArgs(model="tiny-llama", device="cpu", model_runner="v1").create_engine_config()
    stages["policy"] = loaded()
    import shared, shared.engine, shared.llm, shared.cli, shared.scheduler  # noqa: E401
    stages["shared"] = loaded()
    from shared import LLM
    LLM(model="tiny-llama", device="cpu", model_runner="v1", max_model_len=32)
    stages["llm_v1"] = sorted(m for m in sys.modules if m.startswith("runner_v"))
    print(json.dumps(stages))
""")


@pytest.mark.slow
def test_loaded_modules_follow_the_import_direction():
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stages["policy"] == ["policy"]
    assert stages["shared"] == ["policy", "shared"]
    assert stages["llm_v1"] and all(m.startswith("runner_v1") for m in stages["llm_v1"])


@pytest.mark.slow
@pytest.mark.parametrize("runner, other", [("v1", "v2"), ("v2", "v1")])
def test_a_runner_loads_without_the_other(runner, other):
    code = (f"import sys, runner_{runner}.model_runner; "
            f"print(sorted(m for m in sys.modules if m.startswith('runner_{other}')))")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
