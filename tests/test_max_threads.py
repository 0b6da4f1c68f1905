"""MAX's log-polling thread under SCHED_IDLE once pymla has launched (pymla/max_threads.py)."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import pytest

import pymla
from pymla import max_threads

from helpers import make_case

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "SCHED_IDLE"),
    reason="Linux scheduling policies",
)


def _launch_once() -> None:
    case = make_case(91, num_heads=2, cache_lengths=(3, 0), new_tokens=(1, 1))
    pymla.mla_decode_branch_fp8(*case.args(), **case.options)


def _wakeups(tids: list[int], seconds: float) -> dict[int, int]:
    def switches() -> dict[int, int]:
        counts = {}
        for tid in tids:
            with open(f"/proc/self/task/{tid}/status") as f:
                line = next(x for x in f if x.startswith("voluntary_ctxt_switches"))
            counts[tid] = int(line.split()[1])
        return counts

    before = switches()
    time.sleep(seconds)
    after = switches()
    return {tid: after[tid] - before[tid] for tid in tids}


def test_after_a_launch_only_the_log_thread_runs_idle():
    _launch_once()
    found = max_threads.log_threads(seconds=10)
    assert found, "no thread in a timed futex wait on libmax.so's data"
    # It is the 100 us poller: idle as the process is, it wakes thousands of times a second. Under
    # SCHED_IDLE it runs only on a free core, so the best of five samples (another process may hold
    # both cores of a small machine for a while).
    samples = [_wakeups(found, 0.2) for _ in range(5)]
    best = {t: max(s[t] for s in samples) for t in found}
    assert all(n >= 200 for n in best.values()), samples
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    policies = {}
    for tid in tids:
        with contextlib.suppress(OSError):  # ended meanwhile
            policies[tid] = os.sched_getscheduler(tid)
    assert all(policies[t] == os.SCHED_IDLE for t in found)
    others = {t: p for t, p in policies.items() if t not in found}
    assert others and all(p != os.SCHED_IDLE for p in others.values()), others


def test_normal_leaves_the_thread_as_max_made_it(monkeypatch):
    _launch_once()
    found = max_threads.log_threads(seconds=10)
    assert found
    try:
        for tid in found:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        monkeypatch.setenv(max_threads.ENV, "normal")
        assert max_threads.idle_log_threads() == []
        assert all(os.sched_getscheduler(t) == os.SCHED_OTHER for t in found)
        monkeypatch.setenv(max_threads.ENV, "idle")
        # idle_log_threads looks for 0.1 s (log_threads' default): on a loaded machine (the whole suite on
        # two cores) the thread can be seen running that long, so a few tries.
        changed = []
        for _ in range(20):
            changed = max_threads.idle_log_threads()
            if changed:
                break
        assert sorted(changed) == sorted(found)
    finally:
        for tid in found:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    assert all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in found)
