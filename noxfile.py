"""Sessions: tests (the CI suite), lint, demo, bench.

Each session installs the package with its pinned MAX, Mojo and torch into
its own virtualenv (reused across runs).
"""

from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]

LINT_PATHS = [p for p in ("pymla", "tests", "scripts", "noxfile.py") if Path(p).exists()]


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (what CI runs)."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", *LINT_PATHS)
    session.run("ruff", "format", "--check", *LINT_PATHS)


@nox.session
def demo(session: nox.Session) -> None:
    """The op on DeepSeek-V3-like shapes against the torch reference."""
    session.install("-e", ".")
    session.run("python", "-m", "pymla", "demo", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark table (op vs reference vs plain torch), saved as JSON and PNG."""
    session.install("-e", ".[bench]")
    session.run("python", "-m", "pymla", "bench", *session.posargs)
