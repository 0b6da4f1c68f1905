"""The torch custom op ``pymla::mla_decode_branch_fp8`` (``torch.ops.pymla.mla_decode_branch_fp8``).

Its schema derives from :data:`pymla.args.ARGS` (:func:`pymla.args.torch_schema`:
the kernel's arguments, the tensors the kernel writes declared mutated, then
``bool check_values``); its fake implementation checks the metadata for
tracing; its body checks every argument, then launches through a
:class:`~pymla.DecodePlan`, as the one-shot call does. This is what
``torch.compile(fullgraph=True)`` traces: traced, the plan's launch calls the
op through :func:`pymla.args.call_torch_op`, which lives in :mod:`pymla.args`
so that the plan, which this body uses, does not import this module.

Importing this module registers the op; ``import pymla`` does.
"""

from __future__ import annotations

import torch

from .args import (
    INPUT_NAMES,
    STEP_6_ONLY,
    KVCacheTensors,
    Mask,
    ScoreMod,
    mutated_names,
    torch_schema,
)
from .options import DecodeOptions
from .plan import DecodePlan, LayerWeights
from .quant import ScaleGranularity
from .shard import CacheShard
from .validate import Dims, check_inputs


def _named(values: tuple) -> dict:
    """The op's positional arguments by name (:data:`pymla.args.INPUT_NAMES`, then check_values)."""
    return dict(zip((*INPUT_NAMES, "check_values"), values, strict=True))


def _parsed_options(a: dict) -> tuple[ScaleGranularity, DecodeOptions]:
    """The options the schema carries as ints, parsed once: the granularity, and the mask and
    score-mod codes, the scalars and the cache's shard as :class:`pymla.DecodeOptions` (checked
    when made)."""
    granularity = ScaleGranularity.parse(
        (a["m_scale_granularity"], a["n_scale_granularity"], a["k_scale_granularity"])
    )
    options = DecodeOptions(
        scale=a["scale"],
        epsilon=a["epsilon"],
        mask=Mask.parse(a["mask"], codes=True),
        score_mod=ScoreMod.parse(a["score_mod"], codes=True),
        local_window_size=a["local_window_size"],
        shard=CacheShard(a["shard_rank"], a["num_shards"], a["shard_interleave"]),
    )
    return granularity, options


def _check_op_args(
    a: dict,
    granularity: ScaleGranularity,
    options: DecodeOptions,
    *,
    metadata_only: bool = False,
) -> Dims:
    """``check_inputs`` on the torch op's arguments (named as in :data:`pymla.args.ARGS`)."""
    return check_inputs(
        a["output"],
        a["q"],
        a["input_row_offsets"],
        a["freqs_cis"],
        a["kv_norm_gamma"],
        a["kv_blocks"],
        a["cache_lengths"],
        a["lookup_table"],
        a["layer_idx"],
        a["w_uk"],
        a["w_uk_scale"],
        a["w_uv"],
        a["w_uv_scale"],
        options=options,
        scale_granularity=granularity,
        check_values=a["check_values"] and not metadata_only,
        attention_out=a["attention_output"],
        new_rows=a["new_rows"],
        lse=a["lse"],
        first_step=a["first_step"],
    )


def _torch_op_impl(*values) -> None:
    """The torch op's body: checks, then the plan/run launch on its arguments."""
    a = _named(values)
    granularity, options = _parsed_options(a)
    dims = _check_op_args(a, granularity, options)
    if dims.num_tokens == 0:
        return
    out = a["output"] if a["output"].numel() else None
    attention_out = a["attention_output"] if a["attention_output"].numel() else None
    new_rows = a["new_rows"] if a["new_rows"].numel() else None
    lse = a["lse"] if a["lse"].numel() else None
    weights = LayerWeights(
        a["w_uk"],  # the fp8 weights arrive as their uint8 bytes, as MAX takes them
        a["w_uk_scale"],
        a["w_uv"],
        a["w_uv_scale"],
        a["kv_norm_gamma"],
        granularity,
        _checked=True,
        _launch_now=True,
    )
    step = DecodePlan(
        KVCacheTensors(a["kv_blocks"], a["cache_lengths"], a["lookup_table"]),
        a["input_row_offsets"],
        a["freqs_cis"],
        options,
        num_tokens=dims.num_tokens,
        new_rows=new_rows is not None,
        _launch_now=True,
    )
    if a["first_step"] == STEP_6_ONLY:
        step.project(attention_out, a["q"], a["layer_idx"], weights, out)
        return
    step._launch(a["q"], a["layer_idx"], weights, out, attention_out, new_rows, lse)


_torch_op = torch.library.custom_op(
    "pymla::mla_decode_branch_fp8",
    _torch_op_impl,
    mutates_args=mutated_names(),
    schema=torch_schema(),
)


@_torch_op.register_fake
def _(*values):
    a = _named(values)
    _check_op_args(a, *_parsed_options(a), metadata_only=True)
