"""MAX's log-polling thread, kept off the cores the op's workers run on.

max 26.7 starts a thread in ``libmax.so`` at a process's first model execute
(a logger's back end: it drains a ring buffer into its sinks). It never
sleeps longer than 100 us (a condition-variable wait with a 100 us timeout):
about 5,800 wake-ups a second, idle or not, 10% of a core. While the op runs
on the CPU every core runs one of MAX's workers, and each wake-up preempts
one of them. Measured on a 2-core AMD EPYC, batch 8, 16k context, page 64,
bf16, the same process alternating (``scripts/max_log_thread_ab.py``): the
whole op at 16 heads 17.1 -> 14.5 ms, at 128 heads 124 -> 107 ms with that
thread under ``SCHED_IDLE`` (``nice 19`` changed nothing: Linux still lets
it preempt).

:func:`idle_log_threads` finds the thread by what it waits on (a timed
``futex`` wait on a word in ``libmax.so``'s own data, where MAX's workers
wait without a timeout on words on the heap) and gives it Linux's
``SCHED_IDLE`` policy: it runs when a core is free, and under full load
still gets a small share, so it keeps draining its buffer. The launcher
calls it once per process, after the first execute (``pymla.runtime``).
``PYMLA_MAX_LOG_THREAD=normal`` leaves the thread as MAX made it. A MAX
graph that runs the op without pymla's launcher can call it after its first
execute.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import time

ENV = "PYMLA_MAX_LOG_THREAD"
"""``idle`` (the default) or ``normal``: whether :func:`idle_log_threads` changes anything."""

_FUTEX = {"x86_64": 202, "aarch64": 98}
"""The ``futex`` system call's number per machine (``/proc/.../syscall`` gives numbers)."""


def _libmax_data() -> list[tuple[int, int]]:
    """Address ranges of ``libmax.so``'s writable data: its writable mappings and the anonymous
    mapping right after the last one (its zero-initialized data)."""
    ranges: list[tuple[int, int]] = []
    last_end = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            path = fields[5] if len(fields) > 5 else ""
            if path.endswith("/libmax.so"):
                if "w" in fields[1]:
                    ranges.append((start, end))
                    last_end = end
            elif last_end is not None:
                if not path and start == last_end and "w" in fields[1]:
                    ranges.append((start, end))
                last_end = None
    return ranges


def log_threads(seconds: float = 0.1) -> list[int]:
    """The threads of this process in a timed ``futex`` wait on a word in ``libmax.so``'s data.

    A thread's ``/proc/self/task/<tid>/syscall`` names the call it is blocked
    in and its arguments (``futex(uaddr, op, val, timeout, ...)``), or says
    ``running`` (also while it waits for a core): until one is found,
    threads seen running are read again, 1 ms apart, for up to ``seconds`` (the log thread can be busy
    for milliseconds draining what a compile logged, and under ``SCHED_IDLE``
    waits for a free core). Empty where Linux, the machine or the mapping is
    not known.
    """
    futex = _FUTEX.get(platform.machine())
    if not sys.platform.startswith("linux") or futex is None:
        return []
    data = _libmax_data()
    if not data:
        return []
    found = []
    me = threading.get_native_id()  # always running while it reads
    pending = sorted(int(t) for t in os.listdir("/proc/self/task") if int(t) != me)
    deadline = time.monotonic() + seconds
    while True:
        running = []
        for tid in pending:
            try:
                with open(f"/proc/self/task/{tid}/syscall") as f:
                    fields = f.read().split()
            except OSError:  # the thread ended, or Linux hides it
                continue
            if not fields or fields[0] == "running":
                running.append(tid)
            elif int(fields[0]) == futex and len(fields) > 4:
                word, timeout = int(fields[1], 16), int(fields[4], 16)
                if timeout and any(lo <= word < hi for lo, hi in data):
                    found.append(tid)
        pending = running
        if found or not pending or time.monotonic() > deadline:
            return sorted(found)
        time.sleep(0.001)


def idle_log_threads() -> list[int]:
    """Gives :func:`log_threads` Linux's ``SCHED_IDLE`` policy (unless ``PYMLA_MAX_LOG_THREAD=normal``);
    the threads changed."""
    if os.environ.get(ENV, "idle") == "normal" or not hasattr(os, "SCHED_IDLE"):
        return []
    changed = []
    for tid in log_threads():
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            continue
        changed.append(tid)
    return changed
