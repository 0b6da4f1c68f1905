"""pymla: the fused MLA decode branch with fp8 weights, a Mojo kernel run as a MAX custom op.

    out = pymla.mla_decode_branch_fp8(q, input_row_offsets, freqs_cis, kv_norm_gamma,
                                      cache, layer_idx, w_uk, w_uk_scale, w_uv, w_uv_scale,
                                      scale=scale)

A serving loop plans each decode step once and runs it per layer:

    weights = pymla.LayerWeights(w_uk, w_uk_scale, w_uv, w_uv_scale, kv_norm_gamma)
    step = pymla.plan(cache, input_row_offsets, freqs_cis, pymla.DecodeOptions(scale=scale))
    out = step.run(q, layer_idx, weights)

On a GPU, ``run()`` orders itself after torch's current stream with events; torch
work issued on :func:`op_stream` (``with torch.cuda.stream(pymla.op_stream(dev))``)
shares the op's stream and needs none.

The math is specified in :mod:`pymla.reference`.
"""

import logging as _logging
import os as _os

from .args import Mask, ScoreMod
from .cache import PagedLatentCache
from .op import mla_decode_branch_fp8
from .plan import DecodeOptions, DecodePlan, LayerWeights, plan
from .quant import (
    BLOCKWISE,
    PER_CHANNEL,
    PER_TENSOR,
    ScaleGranularity,
    make_mla_weights,
    quantize_fp8,
)
from .reference import KVCacheTensors, mla_decode_branch_fp8_reference
from .runtime import op_stream
from .validate import StaleCacheRowsError

__all__ = [
    "BLOCKWISE",
    "DecodeOptions",
    "DecodePlan",
    "LayerWeights",
    "Mask",
    "ScoreMod",
    "StaleCacheRowsError",
    "plan",
    "PER_CHANNEL",
    "PER_TENSOR",
    "KVCacheTensors",
    "PagedLatentCache",
    "ScaleGranularity",
    "make_mla_weights",
    "mla_decode_branch_fp8",
    "mla_decode_branch_fp8_reference",
    "op_stream",
    "quantize_fp8",
]

_log = _logging.getLogger("pymla")
if not _log.handlers and not _os.environ.get("PYMLA_QUIET"):
    # Compile progress goes to stderr unless the application configures logging
    # (pytest captures it, so test runs stay quiet).
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("%(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(_logging.INFO)
    _log.propagate = False
