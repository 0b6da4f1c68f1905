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

from . import bridge
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
        entries = _max_cache_entries()
        start = time.perf_counter()
        model = sess.load(build_graph(config))
        seconds = time.perf_counter() - start
        what = "compiled" if _max_cache_entries() != entries else "loaded from MAX's cache"
        log.info(
            "pymla: mla_decode_branch_fp8 for %s, %s %s in %.1f s",
            device,
            config.dtype.name,
            what,
            seconds,
        )
        _models[config] = model
        return model


def model_for(dtype: torch.dtype, device: torch.device) -> engine.Model:
    # Looked up through the module so a test can replace compiled_model.
    return compiled_model(OpConfig(bridge.max_dtype(dtype), device_ref(device)), device)


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
        self.stream = torch.cuda.ExternalStream(self.queue.native_stream_handle, device=device)


_queues: dict[str, _Queues] = {}


def _queues_for(device: torch.device) -> _Queues:
    found = _queues.get(str(device))
    if found is None:
        with _lock:
            found = _queues.setdefault(str(device), _Queues(device))
    return found


def launch(model: engine.Model, device: torch.device, buffers: list) -> None:
    """Runs the op: on the CPU now; on a GPU ordered after torch's current stream, before its next work."""
    execute = _executor(model)
    if device.type == "cpu":
        execute(buffers)
        return
    queues = _queues_for(device)
    current = torch.cuda.current_stream(device)
    queues.stream.wait_stream(current)  # MAX's queue waits for the inputs
    execute(buffers)
    current.wait_stream(queues.stream)  # torch's next work waits for the outputs


def _executor(model: engine.Model):
    """``model.execute`` without its per-argument Python checks, where this MAX allows.

    ``Model.execute(*args)`` checks each argument's type and contiguity in
    Python, then calls ``_execute_device_tensors``; pymla passes only MAX
    buffers of tensors it checked contiguous, so it calls the native method
    directly when it exists (about 30 us less per call on the CPU here).
    """
    native = getattr(model, "_execute_device_tensors", None)
    return native if native is not None else lambda buffers: model.execute(*buffers)
