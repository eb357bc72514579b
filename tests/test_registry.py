"""The model registry agrees with the policy's copy of it, and the import direction of
DESIGN.md §1 holds: policy <- shared <- runner_v1, runner_v2, with shared's layers in
the order docs/ARCHITECTURE.md gives:

    policy <- shared.contract <- shared.runtime, .model, .attention, .sampling, .distributed
           <- runner_v1, runner_v2 <- shared.serving <- shared.harness (and `shared` itself)

- a module imports only from its own layer or the layers below it;
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
from shared.model.registry import SUPPORTED_ARCHITECTURES, get_model_class
from shared.serving.engine import resolve_runner_class

ROOT = Path(__file__).resolve().parents[1]
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


# Layer of a module: the longest matching prefix. Same-numbered layers may import each
# other (runtime and model, say); a lower number never imports a higher one.
LAYERS = {
    "policy": 0,
    "shared.contract": 1,
    "shared.runtime": 2, "shared.model": 2, "shared.attention": 2, "shared.sampling": 2,
    "shared.distributed": 2,
    "runner_v1": 3, "runner_v2": 3,
    "shared.serving": 4,
    "shared.harness": 5, "shared": 5,  # `shared` itself: the public facade (LLM, ...)
}


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        layer = LAYERS.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return None


def layer_violations_in(source: str, package: str) -> list[str]:
    mine = layer_of(package)
    return [f"{line}: {package} (layer {mine}) imports {name} (layer {layer_of(name)})"
            for line, name in imported_modules(source, package)
            if (layer_of(name) or 0) > mine]


def test_every_module_has_a_layer():
    # shared/ holds only its facade and the layer sub-packages
    assert sorted(p.name for p in (ROOT / "shared").glob("*.py")) == ["__init__.py"]
    for package in PACKAGES:
        for path, containing in project_modules(package):
            module = containing if path.name == "__init__.py" else f"{containing}.{path.stem}"
            assert layer_of(module) is not None, module
            assert module == "shared" or layer_of(module) != LAYERS["shared"] or \
                module.startswith("shared.harness"), f"{module}: in no layer of its own"


@pytest.mark.parametrize("package", PACKAGES)
def test_layers_import_only_downwards(package):
    bad = []
    for path, containing in project_modules(package):
        module = containing if path.name == "__init__.py" else f"{containing}.{path.stem}"
        bad += [f"{path.relative_to(ROOT)}:{v}"
                for v in layer_violations_in(path.read_text(), module)]
    assert bad == []


def test_the_layer_checker_fails_an_upward_import():
    source = "from shared.serving.engine import LLMEngine\nfrom shared.contract.step import X\n"
    assert layer_violations_in(source, "shared.runtime.model_executor") == [
        "1: shared.runtime.model_executor (layer 2) imports shared.serving.engine (layer 4)"]
    assert layer_violations_in("import shared.harness.ab\n", "runner_v1.sampler")
    assert layer_violations_in("from shared import LLM\n", "shared.serving.llm")
    assert not layer_violations_in("from shared.serving import engine\n", "shared.harness.ab")


@pytest.mark.parametrize("package", PACKAGES)
def test_import_direction(package):
    assert project_modules(package), f"no modules found under {package}/"
    assert violations(package) == []


def test_the_checker_sees_every_form_of_import():
    source = textwrap.dedent("""
        import shared.serving.engine
        from runner_v2 import model_runner
        from . import sibling
        from ..other import thing
        def later():
            import runner_v1.sampler as s
            importlib.import_module("runner_v2.model_runner")
            __import__("tests.conftest")
            importlib.import_module(computed_name)   # not a literal: allowed
    """)
    names = [name for _, name in imported_modules(source, "shared.harness")]
    assert sorted(names) == sorted([
        "shared.serving.engine", "runner_v2", "shared.harness", "shared.other",
        "runner_v1.sampler", "runner_v2.model_runner", "tests.conftest",
    ])
    assert violations_in(source, "shared") == [
        "runner_v2", "runner_v1.sampler", "runner_v2.model_runner", "tests.conftest"]


def test_the_engine_reaches_runners_through_the_decision():
    # The one dynamic import in shared/ that may name a runner takes the decision's path.
    source = (ROOT / "shared" / "serving" / "engine.py").read_text()
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
    import shared, shared.serving.engine, shared.serving.llm, shared.harness.cli, shared.serving.scheduler  # noqa: E401
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
