"""The CPU code paths of the op's attention (step 5) and which ones this machine has.

The kernel picks a path per call from the environment variable
``PYMLA_CPU_PATH``:

- ``auto`` (the default): the fastest path the CPU has for the cache's dtype;
- ``f32``: keys widened to float32, float32 FMAs (every CPU, every dtype);
- ``avx512bf16``: bf16 dot products summed in float32 with ``vdpbf16ps``
  (bfloat16 caches; other dtypes still take ``f32``). Forcing it on a CPU
  without AVX512-BF16 makes the op raise.

Both paths follow the same rounding points (``pymla/reference.py``); they
differ only in the order of the float32 sums.
"""

from __future__ import annotations

from pathlib import Path

PATHS = ("f32", "avx512bf16")
"""Every path the kernel has, in order of preference (last = fastest)."""

REQUIRED_FLAGS = {"f32": (), "avx512bf16": ("avx512_bf16",)}
"""The /proc/cpuinfo flags each path needs."""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of the first CPU in ``cpuinfo`` (default: read /proc/cpuinfo; empty if absent)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def available_cpu_paths(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The paths this machine can run, ``f32`` first: values for ``PYMLA_CPU_PATH``."""
    flags = cpu_flags(cpuinfo)
    return tuple(p for p in PATHS if all(f in flags for f in REQUIRED_FLAGS[p]))


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo (``unknown`` if not found)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "unknown"
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return " ".join(value.split())
    return "unknown"
