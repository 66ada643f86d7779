"""Which package may import which, checked on the source (README, "Layout").

The rule: `engine` imports nothing from `pipeline`, `steps` or `demo`; the runner's parts
(`pipeline.errors`, `pipeline.storage`, `pipeline.pod`, `pipeline.run`) never import `steps`,
`pipeline.cli` or `pipeline.ops`; `steps` never imports `pipeline.cli` or `pipeline.ops`.
Every import counts, at the top of a module or inside a function, absolute or relative, and
`importlib.import_module("...")` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

RULES: dict[str, tuple[str, ...]] = {
    "engine": ("pipeline", "steps", "demo"),
    "pipeline.errors": ("steps", "pipeline.cli", "pipeline.ops"),
    "pipeline.storage": ("steps", "pipeline.cli", "pipeline.ops"),
    "pipeline.pod": ("steps", "pipeline.cli", "pipeline.ops"),
    "pipeline.run": ("steps", "pipeline.cli", "pipeline.ops"),
    "steps": ("pipeline.cli", "pipeline.ops"),
}
"""Package (or module) -> what no module inside it may import."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every module `source` imports; `from a import b` counts as both `a` and `a.b`."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            names.add(stem)
            names.update(f"{stem}.{alias.name}" if stem else alias.name for alias in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return names


def crossings(module: str, names: set[str]) -> list[str]:
    """'module imports name (scope may not import banned)' for every import that crosses the rule
    (once per import: `from pipeline.errors import X` is reported as pipeline.errors, not also X)."""
    found, seen = [], []
    for scope, forbidden in RULES.items():
        if module != scope and not module.startswith(scope + "."):
            continue
        for name in sorted(names):
            banned = next((b for b in forbidden if name == b or name.startswith(b + ".")), None)
            if banned and not any(name.startswith(s + ".") for s in seen):
                seen.append(name)
                found.append(f"{module} imports {name} ({scope} may not import {banned})")
    return found


SOURCES = sorted(p for package in ("engine", "pipeline", "steps") for p in (REPO / package).rglob("*.py"))


def test_no_module_imports_across_the_package_rule():
    problems = []
    for path in SOURCES:
        module = module_name(path)
        problems += crossings(module, imported_names(path.read_text(), module, path.name == "__init__.py"))
    assert problems == []


def test_every_package_of_the_rule_exists():
    modules = {module_name(p) for p in SOURCES}
    assert all(scope in modules for scope in RULES), sorted(set(RULES) - modules)


@pytest.mark.parametrize("module, source, expected", [
    ("pipeline.run.runner", "def load():\n    from steps import generate\n", "steps"),
    ("pipeline.run.runner", "def load():\n    import steps.generate\n", "steps.generate"),
    ("pipeline.run.runner", "import importlib\nimportlib.import_module('steps.merge')\n", "steps.merge"),
    ("pipeline.run.runner", "from ..cli import app\n", "pipeline.cli"),
    ("pipeline.storage", "from ..ops import tpu\n", "pipeline.ops"),
    ("engine.checkpoint", "from pipeline.errors import StepFailed\n", "pipeline.errors"),
    ("engine.checkpoint", "import demo.checkpoint\n", "demo.checkpoint"),
    ("steps.upload", "from pipeline import cli\n", "pipeline.cli"),
])
def test_the_check_sees_imports_inside_functions_relative_and_by_name(module, source, expected):
    is_package = module == "pipeline.storage"
    found = crossings(module, imported_names(source, module, is_package))
    assert any(line.startswith(f"{module} imports {expected} ") for line in found), found


def test_allowed_imports_pass():
    source = "from pipeline import storage\nfrom engine.checkpoint import load_tokenizer\nimport steps.merge\n"
    assert crossings("steps.generate", imported_names(source, "steps.generate", False)) == []
    assert crossings("pipeline.cli", imported_names("from pipeline.ops import tpu\n", "pipeline.cli", False)) == []
