"""Wall-clock timing of a call (warm-up, then the median of repeats) and the CPU ceilings benchmarks
quote ratios against: torch's copy bandwidth and matmul rate, measured in the same run; and the
size of the CPU's last-level cache, which a case's rows must exceed to be timed from memory.

Needs torch only (no MAX): `scripts/cpu_roofline.py` loads this file alone."""

from __future__ import annotations

import glob
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch


def time_call(
    fn: Callable[[], object], *, warmup: int = 2, repeat: int = 10, min_seconds: float = 0.0
) -> float:
    """Median seconds per call of ``fn`` over at least ``repeat`` calls (and ``min_seconds``)."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < repeat or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def last_level_cache_bytes() -> int:
    """The largest CPU cache the system lists: every cache level of every CPU in sysfs, and glibc's
    LEVEL3/LEVEL4_CACHE_SIZE (from CPUID). A VM guest's sysfs may list less than the socket's
    cache its CPUs share (an AMD EPYC guest here: 32 MiB in sysfs, 320 MiB by CPUID): the larger
    is taken, so that rows exceeding it exceed the real one."""
    sizes = [0]
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    for path in glob.glob("/sys/devices/system/cpu/cpu*/cache/index*/size"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text[-1:] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    for name in ("LEVEL3_CACHE_SIZE", "LEVEL4_CACHE_SIZE"):
        try:
            out = subprocess.run(["getconf", name], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0 and out.stdout.strip().isdigit():
            sizes.append(int(out.stdout.strip()))
    return max(sizes)


def measure_copy_bandwidth(nbytes: int = 512 * 2**20) -> float:
    """Bytes per second of a large torch copy_ (counting the read and the write)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), warmup=2, repeat=7)
    return 2 * nbytes / seconds


def measure_matmul_rate(dtype: torch.dtype = torch.bfloat16, n: int = 2048) -> float:
    """Flops per second of a torch ``n``^3 matmul in ``dtype``."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    seconds = time_call(lambda: a @ b, warmup=2, repeat=5)
    return 2 * n**3 / seconds


# A bf16 probe this size first: without bf16 units (AVX2) torch's bf16 mm runs at about 1 GFLOP/s.
PROBE_N = 512


def matmul_ceiling() -> tuple[float, str]:
    """The machine's practical matmul peak and its dtype: the faster of torch's bf16 and float32
    2048^3 matmul. bf16 where the CPU has bf16 units (AVX512-BF16, AMX); float32 where it has none
    (e.g. AVX2 only: torch's bf16 mm there is a scalar fallback at about 1 GFLOP/s, and the op's f32
    path computes the bf16 values' products in float32, exactly). A bf16 probe of ``PROBE_N``^3 under
    a quarter of the float32 rate skips the full bf16 product (it would take minutes)."""
    f32 = measure_matmul_rate(torch.float32)
    if measure_matmul_rate(torch.bfloat16, PROBE_N) < f32 / 4:
        return f32, "float32"
    bf16 = measure_matmul_rate(torch.bfloat16)
    return (bf16, "bfloat16") if bf16 >= f32 else (f32, "float32")
