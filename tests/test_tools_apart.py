"""The tooling (:mod:`pymla.tools`) stays out of the op's import path."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pymla"
# The op's import path: every module of pymla/ but the command line, which imports the tools.
OP_MODULES = sorted(p for p in PACKAGE.glob("*.py") if p.name != "__main__.py")

NO_TOOLS = """
import sys
import pymla
tools = sorted(m for m in sys.modules if m.startswith("pymla.tools"))
assert not tools, tools
"""


def test_import_pymla_imports_no_tools():
    result = subprocess.run(
        [sys.executable, "-c", NO_TOOLS],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),  # not the C environment: max.nn putenv()s PYTHONEXECUTABLE
    )
    assert result.returncode == 0, result.stderr[-3000:]


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code, as an absolute name."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            # Relative imports in pymla/*.py are relative to the package pymla.
            module = ".".join(filter(None, ["pymla" if node.level else "", node.module]))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", OP_MODULES, ids=lambda p: p.name)
def test_no_op_module_imports_the_tools(path):
    assert OP_MODULES
    tools = {
        m for m in imported_modules(path) if m == "pymla.tools" or m.startswith("pymla.tools.")
    }
    assert not tools, f"{path.name} imports {sorted(tools)}"
