"""The house rules of docs/architecture.md, checked on the source: layers, no import circles,
imports at module top, sizes, no formatter escapes.

The layer contract itself is import-linter's (``lint-imports``, configured in pyproject.toml and
run by ``make test``); here it is also shown to fail on a deliberate back-import.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "srl", "producers", "consumers", "ranker", "app")
# Command modules import their role inside each command, so `--help` answers at once
# (docs/architecture.md, "Imports").
LAZY_OK = ("app/cli/", "app/bench/cli.py")
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def test_no_import_circles() -> None:
    """No module reaches itself through imports (type-checking imports count too)."""
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            path = graph.find_shortest_chain(importer=imported, imported=module)
            if path is not None:
                cycles.append(" -> ".join((module, *path)))
    assert not cycles, "import circles:\n" + "\n".join(sorted(set(cycles))[:20])


def test_project_imports_are_at_module_top() -> None:
    """Function-level imports are for heavy or optional third-party modules (torch, vllm …)
    and for the command modules; a project module is imported at the top."""
    found = []
    for path in sources():
        if rel(path).startswith(LAZY_OK):
            continue
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                if any(n.split(".")[0] in PACKAGES for n in names):
                    found.append(f"{rel(path)}:{node.lineno} {', '.join(names)}")
    assert not found, "imports of project modules inside functions:\n" + "\n".join(found)


def oversize() -> set[str]:
    out = set()
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if lines > MAX_FUNCTION_LINES:
                    out.add(f"{rel(path)}:{node.name}")
            elif isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                out.add(f"{rel(path)}:{node.name}")
    return out


def test_functions_and_classes_fit_on_a_screen() -> None:
    big = sorted(oversize())
    assert not big, f"over {MAX_FUNCTION_LINES} (function) / {MAX_CLASS_LINES} (class) lines: {big}"


def test_no_formatter_escapes() -> None:
    marks = ("fmt: " + "skip", "fmt: " + "off")
    files = [*sources(), *sorted((ROOT / "tests").rglob("*.py"))]
    found = [rel(p) for p in files if any(m in p.read_text() for m in marks)]
    assert not found


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "lint-imports"
    return subprocess.run(
        [str(exe), "--no-cache", "--config", str(cwd / "pyproject.toml")],
        cwd=cwd,
        env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("module", "back_import"),
    [
        ("srl/config.py", "import app.demo"),  # the core reaching up to the app layer
        ("producers/chunker.py", "import consumers.assembler"),  # one role into another
        ("schemas/records.py", "import srl.kafka"),  # schemas import nothing of the project
    ],
)
def test_the_layer_contract_fails_on_a_back_import(
    tmp_path: Path, module: str, back_import: str
) -> None:
    """The contract holds on the tree, and breaks when a deliberate back-import is added."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    kept = lint_imports(tmp_path)
    assert kept.returncode == 0, kept.stdout[-2000:]
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{back_import}  # deliberate back-import\n")
    broken = lint_imports(tmp_path)
    assert broken.returncode == 1, broken.stdout[-2000:]
    assert "BROKEN" in broken.stdout
    assert module.replace("/", ".").removesuffix(".py") in broken.stdout
