"""MAX buffers of the op's arguments, named and ordered by :data:`pymla.args.ARGS`.

What a step's plan (:mod:`pymla.plan`) and a layer's weights
(:mod:`pymla.weights`) wrap once, and what each run wraps: its call tensors
(:func:`wrap_call_tensor`) and the layer index.
"""

from __future__ import annotations

import logging

import torch

from . import bridge, runtime
from .args import ARGS, BY_NAME, TORCH_SCALAR_DTYPES

ARG_INDEX = {a.name: i for i, a in enumerate(ARGS)}
"""Each argument's position in :data:`pymla.args.ARGS` (the kernel's argument order)."""


def max_buffers(values: dict[str, object]) -> dict[str, object]:
    """MAX buffers of tensors and scalars named by :data:`pymla.args.ARGS`."""
    out = {}
    for name, value in values.items():
        arg = BY_NAME[name]
        if arg.is_scalar:
            out[name] = runtime.scalar_buffer(value, TORCH_SCALAR_DTYPES[arg.dtype])
        else:
            out[name] = bridge.to_max(value)
    return out


_fast_dlpack = True  # until MAX refuses bridge.to_max_unordered once


def wrap_call_tensor(t: torch.Tensor, device: tuple[int, int]):
    """A MAX buffer of a tensor run() checked (contiguous, the plan's device and dtype).

    Without torch's DLPack stream handling: launches order MAX's queue with
    torch's stream themselves (:func:`pymla.runtime.launcher`).
    """
    global _fast_dlpack
    if _fast_dlpack:
        try:
            return bridge.to_max_unordered(t, device)
        except Exception as e:  # a MAX that consumes DLPack otherwise: the ordinary path now
            _fast_dlpack = False
            logging.getLogger("pymla").info(
                "pymla: run() wraps tensors through Buffer.from_dlpack from now on (%s: %s)",
                type(e).__name__,
                e,
            )
    return bridge.to_max(t)


def layer_buffer(layer: int):
    """The ``layer_idx`` scalar buffer of one run."""
    return runtime.scalar_buffer(layer, torch.uint32)


_first_steps: dict[int, object] = {}


def first_step_buffer(first_step: int):
    """The ``first_step`` scalar buffer (one per value, made once)."""
    found = _first_steps.get(first_step)
    if found is None:
        found = _first_steps[first_step] = runtime.scalar_buffer(first_step, torch.int32)
    return found
