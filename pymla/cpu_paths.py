"""The CPU code paths of the op's attention (step 5): which ones the compiled kernel has.

The kernel picks a path per call from the environment variable
``PYMLA_CPU_PATH``:

- ``auto`` (the default, also when unset or empty): the last path of
  :data:`PATHS` the compiled kernel has for the cache's dtype;
- ``f32``: keys widened to float32, float32 FMAs (every CPU, every dtype);
- ``avx512bf16``: bf16 dot products summed in float32 with ``vdpbf16ps``
  (bfloat16 caches; other dtypes still take ``f32``);
- ``amx``: bf16 tile products summed in float32 with ``tdpbf16ps`` on Intel
  AMX (bfloat16 caches; other dtypes still take ``f32``). Step 5 alone on
  the H200's 16-core Xeon host (batch 8, 16k context, page 64), one run of
  ``tests/cpu/amx_check.mojo``: 16 heads 3.20 ms (avx512bf16 9.15, f32
  8.73), 128 heads 15.9 ms (avx512bf16 64.5, f32 43.3). Where Linux refuses
  the process the tile registers, ``auto`` runs ``avx512bf16`` instead and a
  forced ``amx`` fails.

The paths follow the same rounding points (``pymla/reference.py``); they
differ only in the order of the float32 sums. :func:`check_cpu_path` refuses
an unknown value, or a path the compiled kernel lacks, before any kernel runs.

Which paths exist is decided when MAX compiles the op, for a target CPU:
the host as LLVM names it, unless ``max.driver.set_virtual_cpu_target`` set
another. On some virtual machines LLVM's name for the host lacks features the
CPU has: an Intel Xeon guest (Sapphire Rapids, ``amx_bf16 amx_tile
avx512_bf16`` in ``/proc/cpuinfo``) whose CPUID model 167 LLVM takes for
``rocketlake``, without AVX512-BF16 or AMX. :func:`configure_cpu_target`
(called before pymla compiles anything) then picks an LLVM CPU whose
vector features the CPU has, so the compiled kernel has them too;
``PYMLA_CPU_TARGET`` overrides it (an LLVM CPU name, or ``host`` to keep
LLVM's host detection). The truth about the paths is read from a kernel
compiled the same way (:func:`kernel_cpu_paths`), never from
``/proc/cpuinfo`` alone.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import threading
from pathlib import Path

import torch

log = logging.getLogger("pymla")

PATHS = ("f32", "avx512bf16", "amx")
"""Every path the kernel has, in order of preference (last = ``auto``'s choice where the kernel has it)."""

PATH_ENV = "PYMLA_CPU_PATH"
TARGET_ENV = "PYMLA_CPU_TARGET"
REQUESTS = ("auto", *PATHS)
"""The values of ``PYMLA_CPU_PATH`` (unset and empty mean ``auto``)."""

FEATURES = ("avx512bf16", "amx-tile", "amx-bf16")
"""The LLVM features ``pymla.compiled_cpu_features`` reports, in its output's order."""

PATH_FEATURES = {"f32": (), "avx512bf16": ("avx512bf16",), "amx": ("amx-tile", "amx-bf16")}
"""The LLVM features each path needs compiled in."""

PATH_DTYPES = {"f32": None, "avx512bf16": torch.bfloat16, "amx": torch.bfloat16}
"""The cache dtype a path serves (None: every dtype); other dtypes take ``f32``."""

CANDIDATE_TARGETS = ("sapphirerapids", "cooperlake")
"""LLVM CPUs :func:`configure_cpu_target` may pick, most capable first."""

_CODEGEN_PREFIXES = (
    "sse", "ssse3", "avx", "amx", "fma", "f16c", "bmi", "lzcnt", "popcnt",
    "movbe", "adx", "sha", "aes", "vaes", "pclmul", "vpclmulqdq", "gfni", "crc32",
)  # fmt: skip
"""LLVM features the compiler may emit without being asked (vector and bit-manipulation ISA).

Others (``waitpkg``, ``uintr``, ``serialize``, ...) appear only through
intrinsics the op does not use, and a virtual machine often hides them."""

_LLVM_TO_CPUINFO = {
    "sse3": "pni",
    "crc32": "sse42",
    "lzcnt": "abm",
    "pclmul": "pclmulqdq",
    "bmi": "bmi1",
    "sha": "shani",
}
"""LLVM feature names whose ``/proc/cpuinfo`` flag is spelled otherwise (after :func:`_norm`)."""


def _norm(name: str) -> str:
    return name.replace("_", "").replace("-", "").replace(".", "").lower()


# ---------------------------------------------------------------- the machine


def _read_cpuinfo(cpuinfo: str | None) -> str:
    """``cpuinfo``, or the text of /proc/cpuinfo when it is None (empty where there is none)."""
    if cpuinfo is not None:
        return cpuinfo
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpuinfo_field(cpuinfo: str, *names: str) -> str | None:
    """The value of the first CPU's first field named one of ``names`` in ``cpuinfo`` (None: no such field)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value.strip()
    return None


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of the first CPU in ``cpuinfo`` (default: read /proc/cpuinfo; empty if absent)."""
    flags = _cpuinfo_field(_read_cpuinfo(cpuinfo), "flags", "Features")
    return set() if flags is None else set(flags.split())


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo (``unknown`` if not found)."""
    model = _cpuinfo_field(_read_cpuinfo(cpuinfo), "model name")
    return "unknown" if model is None else " ".join(model.split())


BF16_UNIT_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")
"""The ``/proc/cpuinfo`` flags of the bf16 units the CPU paths use (:func:`cpu_signature` lists them)."""


def cpu_signature(cpuinfo: str | None = None) -> str:
    """What tells apart CPUs of one model name: ``family F model M stepping S`` from /proc/cpuinfo
    and its bf16 units (:data:`BF16_UNIT_FLAGS`), e.g. ``family 25 model 17 stepping 1, avx512_bf16``.

    Guests often report a bare model name ("AMD EPYC" for Zen 3 and Zen 4 alike; "Intel(R) Xeon(R)
    Processor" with CPUID model 143, 167 or 207): benchmarks print and record this beside it.
    Without /proc/cpuinfo: ``unknown, no bf16 unit``.
    """
    text = _read_cpuinfo(cpuinfo)
    fields = [
        f"{label} {value}"
        for label, name in (("family", "cpu family"), ("model", "model"), ("stepping", "stepping"))
        if (value := _cpuinfo_field(text, name)) is not None
    ]
    flags = cpu_flags(text)
    units = [f for f in BF16_UNIT_FLAGS if f in flags] or ["no bf16 unit"]
    return ", ".join([" ".join(fields) or "unknown", *units])


# ---------------------------------------------------------------- the compile target


def _mojo() -> str:
    from .graph import mojo_binary

    return mojo_binary()


@functools.cache
def llvm_target(cpu: str = "") -> tuple[str, frozenset[str]]:
    """``(cpu name, enabled LLVM features)`` of an LLVM target CPU (``""``: the host as LLVM sees it).

    Asks the Mojo compiler MAX compiles with (``mojo build --print-effective-target``, ~0.1 s).
    """
    cmd = [_mojo(), "build", "--print-effective-target"]
    if cpu:
        cmd += ["--target-cpu", cpu]
    result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    name, features = "", frozenset()
    for line in result.stdout.splitlines():
        option, _, value = line.strip().partition(" ")
        if option == "--target-cpu":
            name = value.strip()
        elif option == "--target-features":
            features = frozenset(f[1:] for f in value.strip().split(",") if f.startswith("+"))
    if not name:
        raise ValueError(
            f"{TARGET_ENV}: expected an LLVM target CPU name, got {cpu!r} "
            f"({(result.stderr or result.stdout).strip().splitlines()[-1:]})"
        )
    return name, features


def missing_codegen_features(llvm_features: frozenset[str], flags: set[str]) -> set[str]:
    """The features a target would let the compiler emit that ``/proc/cpuinfo`` ``flags`` lack."""
    have = {_norm(f) for f in flags}
    wanted = {f for f in llvm_features if f.startswith(_CODEGEN_PREFIXES)}
    return {f for f in wanted if _LLVM_TO_CPUINFO.get(_norm(f), _norm(f)) not in have}


def choose_cpu_target(
    host_features: frozenset[str],
    flags: set[str],
    candidates: dict[str, frozenset[str]],
) -> str:
    """The LLVM CPU to compile for: ``""`` (the host's) unless it lacks a path's feature the CPU has.

    Then the first candidate whose codegen features the CPU all has and that
    has every path feature the CPU has; ``""`` when none fits.
    """
    have = {_norm(f) for f in flags}
    wanted = {f for f in FEATURES if _norm(f) in have}
    if wanted <= host_features:
        return ""
    for name, features in candidates.items():
        if wanted <= features and not missing_codegen_features(features, flags):
            return name
    return ""


_target_lock = threading.Lock()
_configured: str | None = None


def configure_cpu_target() -> str:
    """Sets MAX's CPU target for the op's compiles (once per process); returns it (``""``: the host).

    ``PYMLA_CPU_TARGET`` wins (an LLVM CPU name, or ``host``); a target already
    set through ``max.driver.set_virtual_cpu_target`` is kept. Otherwise,
    where LLVM's host CPU lacks a feature of :data:`FEATURES` that
    ``/proc/cpuinfo`` lists, the first of :data:`CANDIDATE_TARGETS` that fits
    (:func:`choose_cpu_target`). MAX's setting is process-wide: CPU models
    compiled later in the process target that CPU too.
    """
    global _configured
    with _target_lock:
        if _configured is not None:
            return _configured
        from max import driver

        requested = os.environ.get(TARGET_ENV, "").strip()
        current = driver.get_virtual_cpu_target()
        if requested == "host":
            target = current
        elif requested:
            target = llvm_target(requested)[0]
        elif current:
            target = current
        else:
            target = _corrected_host_target(cpu_flags())
            if target:
                log.info(
                    "pymla: compiling CPU kernels for %s (LLVM takes this host for %s, "
                    "without %s, which /proc/cpuinfo lists)",
                    target,
                    llvm_target()[0],
                    ", ".join(sorted(f for f in FEATURES if f not in llvm_target()[1])),
                )
        if target != current:
            driver.set_virtual_cpu_target(target)
        _configured = target
        return target


def _corrected_host_target(flags: set[str]) -> str:
    """:func:`choose_cpu_target` for this host; ``""`` without a feature of :data:`FEATURES`
    in ``flags`` (no compiler call then) or when the compiler cannot be asked."""
    have = {_norm(f) for f in flags}
    if not any(_norm(f) in have for f in FEATURES):
        return ""
    try:
        host = llvm_target()[1]
        candidates = {c: llvm_target(c)[1] for c in CANDIDATE_TARGETS}
    except (OSError, ValueError) as e:  # no mojo binary, or one that cannot say
        log.warning("pymla: CPU kernels compile for the host target (%s)", e)
        return ""
    return choose_cpu_target(host, flags, candidates)


def compile_target_name() -> str:
    """The LLVM CPU the op's CPU kernels are compiled for (after :func:`configure_cpu_target`)."""
    return configure_cpu_target() or llvm_target()[0]


# ---------------------------------------------------------------- the compiled kernel


@functools.cache
def compiled_features() -> frozenset[str]:
    """The features of :data:`FEATURES` the op's CPU kernels are compiled with.

    Runs ``pymla.compiled_cpu_features`` once per process (a small model; its
    first compile takes as long as the op's, later loads come from MAX's cache).
    """
    from max.dtype import DType
    from max.graph import BufferType, DeviceRef, Graph, ops

    from . import bridge, runtime
    from .graph import kernels_path

    with Graph(
        "pymla_compiled_cpu_features",
        input_types=[BufferType(DType.uint8, [len(FEATURES)], DeviceRef.CPU())],
        custom_extensions=[kernels_path()],
    ) as graph:
        ops.inplace_custom(
            "pymla.compiled_cpu_features", device=DeviceRef.CPU(), values=[graph.inputs[0].buffer]
        )
        graph.output()
    sess, _ = runtime.session(torch.device("cpu"))
    flags = torch.zeros(len(FEATURES), dtype=torch.uint8)
    sess.load(graph).execute(bridge.to_max(flags))
    return frozenset(f for f, on in zip(FEATURES, flags.tolist(), strict=True) if on)


def kernel_cpu_paths() -> tuple[str, ...]:
    """The paths the compiled kernel has, ``f32`` first: the values ``PYMLA_CPU_PATH`` may force."""
    features = compiled_features()
    return tuple(p for p in PATHS if set(PATH_FEATURES[p]) <= features)


def _parse(requested: str | None) -> str:
    value = "auto" if requested in (None, "") else requested
    if value not in REQUESTS:
        raise ValueError(f"{PATH_ENV}: expected one of {', '.join(REQUESTS)}, got {requested!r}")
    return value


def _require(path: str) -> None:
    paths = kernel_cpu_paths()
    if path not in paths:
        raise ValueError(
            f"{PATH_ENV}: expected a path the compiled kernel has ({', '.join(paths)}; "
            f"compiled for {compile_target_name()}), got {path!r}"
        )


def resolve_cpu_path(requested: str | None, dtype: torch.dtype) -> str:
    """The path a call with ``PYMLA_CPU_PATH=requested`` runs for a cache of ``dtype``.

    Raises:
        ValueError: an unknown value, or a path the compiled kernel lacks.
    """
    value = _parse(requested)
    if value == "f32":
        return value
    if value != "auto":
        _require(value)
    serves = [p for p in kernel_cpu_paths() if PATH_DTYPES[p] in (None, dtype)]
    return value if value in serves else serves[-1]


_checked_request: str | None = None


def check_cpu_path() -> None:
    """Refuses ``PYMLA_CPU_PATH`` when the compiled kernel cannot honour it (before a CPU launch).

    Cheap on every call: a forced path is checked once, then remembered.
    """
    global _checked_request
    requested = os.environ.get(PATH_ENV)
    if requested == _checked_request or requested in (None, "", "auto", "f32"):
        return
    _require(_parse(requested))
    _checked_request = requested
