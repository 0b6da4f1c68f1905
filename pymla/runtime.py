"""The compiled op and its launch: one MAX model per (device, dtype), ordered with torch's stream.

On the CPU a launch is ``model.execute``. On a GPU, MAX enqueues the op on
its own queue (its device's default queue); this module orders that queue
with torch's current stream through events, without a host synchronization:
MAX's queue waits for torch's stream before the op, torch's stream waits for
MAX's queue after it (both ``cudaStreamWaitEvent``). Under
``torch.cuda.graph`` capture the same two waits fork MAX's queue into the
capture and join it back.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import threading
import time

import torch
from max import driver, engine
from max.graph import DeviceRef

from . import bridge, max_threads
from .cpu_paths import check_cpu_path
from .graph import OpConfig, build_graph

log = logging.getLogger("pymla")

_models: dict[OpConfig, engine.Model] = {}
_sessions: dict[str, tuple[engine.InferenceSession, driver.Device]] = {}
# Reentrant: _queues_for holds it while _Queues() calls session(), which takes it too.
_lock = threading.RLock()


def device_ref(device: torch.device) -> DeviceRef:
    return DeviceRef.CPU() if device.type == "cpu" else DeviceRef.GPU(device.index or 0)


def session(device: torch.device) -> tuple[engine.InferenceSession, driver.Device]:
    """The MAX session and MAX device for a torch device, made once per process."""
    key = str(device)
    with _lock:
        if key not in _sessions:
            max_device = bridge.max_device(device)
            _sessions[key] = (engine.InferenceSession(devices=[max_device]), max_device)
        return _sessions[key]


def _max_cache_entries() -> int:
    """Files in MAX's compile caches (``MODULAR_CACHE_DIR``, default ``~/.cache/modular``)."""
    root = pathlib.Path(os.environ.get("MODULAR_CACHE_DIR") or "~/.cache/modular").expanduser()
    return sum(1 for d in (".max_cache", ".mogg_cache") for _ in (root / d).rglob("*"))


def compiled_model(config: OpConfig, device: torch.device) -> engine.Model:
    """The compiled model of ``config``, made on first use.

    Logs "compiled" when MAX really compiled it (new entries in its disk
    cache), "loaded" when it came from MAX's disk cache.
    """
    model = _models.get(config)
    if model is not None:
        return model
    sess, _ = session(device)
    with _lock:
        model = _models.get(config)
        if model is not None:
            return model
        what = config.dtype.name + ("" if config.cache_dtype is None else ", fp8_ds_mla cache")
        log.info(
            "pymla: compiling mla_decode_branch_fp8 for %s, %s (first call in this process: "
            "about 20 s, a few seconds from MAX's disk cache)",
            device,
            what,
        )
        entries = _max_cache_entries()
        start = time.perf_counter()
        model = sess.load(build_graph(config))
        seconds = time.perf_counter() - start
        how = "compiled" if _max_cache_entries() != entries else "loaded from MAX's cache"
        log.info("pymla: mla_decode_branch_fp8 for %s, %s %s in %.1f s", device, what, how, seconds)
        _models[config] = model
        return model


_configs: dict[tuple, OpConfig] = {}


def model_for(
    dtype: torch.dtype, device: torch.device, cache_dtype: torch.dtype | None = None
) -> engine.Model:
    """The compiled op for ``dtype`` on ``device``; ``cache_dtype`` uint8: ``fp8_ds_mla`` cache rows."""
    key = (dtype, device, cache_dtype)
    config = _configs.get(key)
    if config is None:  # made once: a plan made per call looks its model up each time
        cache = None if cache_dtype in (None, dtype) else bridge.max_dtype(cache_dtype)
        config = _configs[key] = OpConfig(bridge.max_dtype(dtype), device_ref(device), cache)
    # Looked up through the module so a test can replace compiled_model.
    return compiled_model(config, device)


@functools.lru_cache(maxsize=1024)
def scalar_buffer(value: int | float, dtype: torch.dtype) -> driver.Buffer:
    """A rank-0 host buffer holding ``value`` (the op only reads scalars: one per value)."""
    return bridge.to_max(torch.tensor(value, dtype=dtype))


_empties: dict[tuple, tuple[torch.Tensor, driver.Buffer]] = {}


def empty_buffer(rank: int, dtype: torch.dtype, device: torch.device) -> driver.Buffer:
    """A buffer with no elements: an optional tensor that was not given."""
    key = (rank, dtype, str(device))
    found = _empties.get(key)
    if found is None:
        t = torch.empty((0,) * rank, dtype=dtype, device=device)
        found = _empties[key] = (t, bridge.to_max(t))
    return found[1]


class _Queues:
    """MAX's queue on one GPU and torch's handle on it."""

    def __init__(self, device: torch.device) -> None:
        _, max_device = session(device)
        self.queue = max_device.default_queue
        self.handle = self.queue.native_stream_handle
        self.stream = torch.cuda.ExternalStream(self.handle, device=device)


_queues: dict[str, _Queues] = {}


def _queues_for(device: torch.device) -> _Queues:
    found = _queues.get(str(device))
    if found is None:
        with _lock:
            found = _queues.setdefault(str(device), _Queues(device))
    return found


# Per thread: the two events of a launch on each GPU, made once and re-recorded by every
# launch (a wait uses the event's latest record at the time of the wait call, so re-recording
# never changes a wait already enqueued). Per thread, because two threads launching at once
# must not record over each other's event between its record and its wait.
_thread_events = threading.local()


def _events(index: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    per_thread = _thread_events.__dict__
    found = per_thread.get(index)
    if found is None:
        found = per_thread[index] = (torch.cuda.Event(), torch.cuda.Event())
    return found


def op_stream(device: torch.device | str) -> torch.cuda.ExternalStream:
    """The CUDA stream the op runs on (MAX's queue on ``device``), as a torch stream.

    Torch work issued under ``with torch.cuda.stream(pymla.op_stream(dev)):``
    shares the op's stream, so a launch needs no events to order the two
    (a serving loop's whole step can run there).
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"pymla.op_stream: device must be a CUDA device, got {device}")
    return _queues_for(device).stream


_log_threads_idled = False


def _idle_log_threads() -> None:
    """Once per process, after the first launch (when MAX has started it): MAX's log-polling
    thread under ``SCHED_IDLE`` (:mod:`pymla.max_threads`)."""
    global _log_threads_idled
    _log_threads_idled = True
    changed = max_threads.idle_log_threads()
    log.debug("pymla: MAX's log-polling threads %s under SCHED_IDLE", changed)


def launcher(model: engine.Model, device: torch.device):
    """``launch(model, device, ·)`` with the per-device lookups done once: a function of the buffers.

    On the CPU: ``model``'s execute, after :func:`pymla.cpu_paths.check_cpu_path`. On a GPU: when torch's current stream is
    MAX's queue (:func:`op_stream`), the execute alone; otherwise MAX's queue
    waits for torch's current stream (an event recorded there), the op is
    enqueued, torch's current stream waits for MAX's queue (an event recorded
    there); both waits are ``cudaStreamWaitEvent``, so the host never waits,
    and under ``torch.cuda.graph`` capture they fork MAX's queue into the
    capture and join it back. After the process's first launch MAX's
    log-polling thread goes under ``SCHED_IDLE`` (:mod:`pymla.max_threads`).
    """
    execute = executor(model)
    if device.type == "cpu":

        def launch_on_cpu(buffers: list) -> None:
            check_cpu_path()  # PYMLA_CPU_PATH refused here, before the kernel touches anything
            execute(buffers)
            if not _log_threads_idled:
                _idle_log_threads()

        return launch_on_cpu
    queues = _queues_for(device)
    max_stream, max_handle = queues.stream, queues.handle
    index = device.index if device.index is not None else torch.cuda.current_device()
    current_stream = torch.cuda.current_stream

    def launch_on_gpu(buffers: list) -> None:
        current = current_stream(index)
        if current.cuda_stream == max_handle:  # one stream: already in order
            execute(buffers)
        else:
            inputs_ready, outputs_ready = _events(index)
            inputs_ready.record(current)
            inputs_ready.wait(max_stream)  # MAX's queue waits for the inputs
            execute(buffers)
            outputs_ready.record(max_stream)
            outputs_ready.wait(current)  # torch's next work waits for the outputs
        if not _log_threads_idled:
            _idle_log_threads()

    return launch_on_gpu


def launch(model: engine.Model, device: torch.device, buffers: list) -> None:
    """Runs the op: on the CPU now; on a GPU ordered after torch's current stream, before its next work.

    A caller that launches the same model often keeps :func:`launcher`'s function instead.
    """
    launcher(model, device)(buffers)


def executor(model: engine.Model):
    """``model.execute`` without its per-argument Python checks, where this MAX allows.

    ``Model.execute(*args)`` checks each argument's type and contiguity in
    Python, then calls ``_execute_device_tensors``; pymla passes only MAX
    buffers of tensors it checked contiguous, so it calls the native method
    directly when it exists (about 30 us less per call on the CPU here).
    """
    native = getattr(model, "_execute_device_tensors", None)
    return native if native is not None else lambda buffers: model.execute(*buffers)
