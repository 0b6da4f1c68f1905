"""MAX buffers of the op's arguments, named and ordered by :data:`pymla.args.ARGS`.

What a step's plan (:mod:`pymla.plan`) and a layer's weights
(:mod:`pymla.weights`) wrap once, and what each run wraps: its call tensors
(:func:`wrap_call_tensor`) and the layer index. A plan's argument list is
:func:`step_template` (the step's buffers in place, made once);
:func:`run_buffers` fills a copy of it for one launch.
"""

from __future__ import annotations

import logging

import torch

from . import bridge, runtime
from .args import ALL_STEPS, ARGS, TORCH_SCALAR_DTYPES, Source

ARG_INDEX = {a.name: i for i, a in enumerate(ARGS)}
"""Each argument's position in :data:`pymla.args.ARGS` (the kernel's argument order)."""

# Positions in ARGS of what a run supplies.
_RUN_NAMES = ("output", "attention_output", "lse", "q", "new_rows", "layer_idx", "first_step")
assert {a.name for a in ARGS if a.source in (Source.CALL, Source.LAYER)} == set(_RUN_NAMES)
_I_OUT, _I_ATTENTION, _I_LSE, _I_Q, _I_ROWS, _I_LAYER, _I_FIRST = (ARG_INDEX[n] for n in _RUN_NAMES)
_STEP_NAMES = tuple(a.name for a in ARGS if a.source is Source.STEP)
_SCALAR_DTYPES = {a.name: TORCH_SCALAR_DTYPES[a.dtype] for a in ARGS if a.is_scalar}
"""The torch dtype of each scalar argument's buffer."""


def max_buffers(
    values: dict[str, object], unordered: tuple[int, int] | None = None
) -> dict[str, object]:
    """MAX buffers of tensors and scalars named by :data:`pymla.args.ARGS`.

    With ``unordered`` (the tensors' DLPack device), contiguous tensors are
    wrapped as :func:`wrap_call_tensor` wraps a run's (no DLPack stream
    ordering): for buffers made for one launch right away, whose own ordering
    after torch's current stream covers them (the one-shot call, the torch
    op's body). A plan or weights kept for later launches, perhaps on another
    stream, keep DLPack's ordering at the time they are made.
    """
    out = {}
    for name, value in values.items():
        scalar_dtype = _SCALAR_DTYPES.get(name)
        if scalar_dtype is not None:
            out[name] = runtime.scalar_buffer(value, scalar_dtype)
        elif unordered is not None and value.is_contiguous():
            out[name] = wrap_call_tensor(value, unordered)
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


def step_template(
    input_row_offsets,
    freqs_cis,
    kv,
    options,
    dtype,
    device,
    unordered: tuple[int, int] | None = None,
) -> list:
    """The kernel's argument list, in ARGS order: the step's tensors (``kv``: the cache's
    three) and ``options``' scalars as buffers in place, empty buffers of ``dtype`` on
    ``device`` where a run's tensors go; ``unordered`` as :func:`max_buffers`'."""
    buffers = max_buffers(
        {
            "input_row_offsets": input_row_offsets,
            "freqs_cis": freqs_cis,
            "kv_blocks": kv.blocks,
            "cache_lengths": kv.cache_lengths,
            "lookup_table": kv.lookup_table,
            **options.scalars(),
        },
        unordered,
    )
    assert buffers.keys() == _STEP_NAME_SET
    template = _blank_template(dtype, device).copy()
    for name, buffer in buffers.items():
        template[ARG_INDEX[name]] = buffer
    return template


_STEP_NAME_SET = frozenset(_STEP_NAMES)
_blank_templates: dict[tuple[torch.dtype, torch.device], list] = {}


def _blank_template(dtype: torch.dtype, device: torch.device) -> list:
    """The argument list without a step or a run: empty buffers of ``dtype`` on ``device`` where
    the optional tensors go, ``first_step`` 1, None elsewhere (made once per dtype and device)."""
    key = (dtype, device)
    found = _blank_templates.get(key)
    if found is None:
        found = [None] * len(ARGS)
        found[_I_OUT] = runtime.empty_buffer(3, dtype, device)
        found[_I_ATTENTION] = runtime.empty_buffer(3, dtype, device)
        found[_I_LSE] = runtime.empty_buffer(2, torch.float32, device)
        found[_I_FIRST] = first_step_buffer(ALL_STEPS)
        found[_I_ROWS] = runtime.empty_buffer(2, dtype, device)
        _blank_templates[key] = found
    return found


def run_buffers(
    template: list,
    device: tuple[int, int],
    indexed: list,
    q,
    layer: int,
    out,
    attention_out,
    new_rows,
    lse,
    first_step: int,
) -> list:
    """One launch's arguments: a copy of ``template`` with the call's tensors wrapped
    (``device``: their DLPack device), the layer's weight buffers (``indexed``: position,
    buffer pairs) and the layer index; no checks."""
    args = template.copy()
    wrap = wrap_call_tensor
    if out is not None:
        args[_I_OUT] = wrap(out, device)
    args[_I_Q] = wrap(q, device)
    if attention_out is not None:
        args[_I_ATTENTION] = wrap(attention_out, device)
    if lse is not None:
        args[_I_LSE] = wrap(lse, device)
    if new_rows is not None:
        args[_I_ROWS] = wrap(new_rows, device)
    for i, buffer in indexed:
        args[i] = buffer
    args[_I_LAYER] = layer_buffer(layer)
    if first_step != ALL_STEPS:
        args[_I_FIRST] = first_step_buffer(first_step)
    return args
