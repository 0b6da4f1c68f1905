"""Wall-clock timing of a call: warm-up, then the median of repeats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


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
