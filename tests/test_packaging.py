"""The version, and a regular (non-editable) wheel: it carries the Mojo kernels, py.typed and
pymla.tools, and runs the op from anywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pymla

ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_version_is_the_installed_distributions():
    assert pymla.__version__ == metadata.version("pymla") == VERSION


def test_version_of_a_source_checkout_is_pyprojects(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert pymla._version() == VERSION


CALL = """
import pathlib, sys, torch, pymla
from pymla.tools.scenario import make_case, run_reference
from pymla.parity import compare_output
assert pathlib.Path(pymla.__file__).is_relative_to(pathlib.Path(sys.argv[1])), pymla.__file__
case = make_case(1, dtype=torch.float32, num_heads=2, cache_lengths=(3,), new_tokens=(1,))
ref, _ = run_reference(case)
out = pymla.mla_decode_branch_fp8(*case.args(), **case.options)
report = compare_output(out, ref)
assert report.passed, report.describe()
assert pymla.__version__ == sys.argv[2], pymla.__version__
print("wheel OK", pymla.__file__)
"""


def test_wheel_ships_the_kernels_and_runs_from_another_directory(tmp_path):
    # Built from a copy without build outputs: setuptools keeps files of an earlier in-tree build
    # in build/lib and would ship a module moved or deleted since.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "benchmarks", "__pycache__"),
    )
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(source),
        ],
        check=True,
        env=dict(os.environ),  # not the C environment: max.nn putenv()s PYTHONEXECUTABLE
    )
    (wheel,) = wheels.glob("pymla-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = sorted(p.name for p in (ROOT / "mojo_kernels").rglob("*.mojo"))
    shipped = sorted(Path(n).name for n in names if n.startswith("pymla/mojo_kernels/"))
    assert shipped == sources
    assert "pymla/py.typed" in names
    tools = sorted(p.name for p in (ROOT / "pymla" / "tools").glob("*.py"))
    assert sorted(Path(n).name for n in names if n.startswith("pymla/tools/")) == tools
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        env=dict(os.environ),  # not the C environment: max.nn putenv()s PYTHONEXECUTABLE
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "PYMLA_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-c", CALL, str(site), VERSION],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wheel OK" in result.stdout
