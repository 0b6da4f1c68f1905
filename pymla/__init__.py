"""pymla: the fused MLA decode branch with fp8 weights, a Mojo kernel run as a MAX custom op.

    out = pymla.mla_decode_branch_fp8(q, input_row_offsets, freqs_cis, kv_norm_gamma,
                                      cache, layer_idx, w_uk, w_uk_scale, w_uv, w_uv_scale,
                                      scale=scale)

A serving loop plans each decode step once and runs it per layer, passing each
layer's new latent rows as it computes them:

    weights = pymla.LayerWeights(w_uk, w_uk_scale, w_uv, w_uv_scale, kv_norm_gamma)
    cache.reserve(b, n)  # for every request b with n new tokens
    step = pymla.plan(cache, input_row_offsets, freqs_cis, pymla.DecodeOptions(scale=scale),
                      new_rows=True)
    out = step.run(q, layer_idx, weights, new_rows=rows)  # per layer
    cache.advance()  # after the last layer

On a GPU, ``run()`` orders itself after torch's current stream with events; torch
work issued on :func:`op_stream` (``with torch.cuda.stream(pymla.op_stream(dev))``)
shares the op's stream and needs none.

The math is specified in :mod:`pymla.reference`.
"""

import logging as _logging
from importlib import metadata as _metadata

from . import torch_op  # noqa: F401 (registers torch.ops.pymla.mla_decode_branch_fp8)
from .args import KVCacheTensors, Mask, ScoreMod
from .cache import PagedLatentCache
from .distributed import (
    ContextParallel,
    ContextParallelPlan,
    TensorParallelHeads,
    merge_attention_states,
)
from .op import mla_decode_branch_fp8
from .options import DecodeOptions
from .plan import DecodePlan, LayerWeights, plan
from .quant import (
    BLOCKWISE,
    PER_CHANNEL,
    PER_TENSOR,
    ScaleGranularity,
    make_mla_weights,
    quantize_fp8,
)
from .reference import mla_decode_branch_fp8_reference, rope_freqs_cis
from .runtime import op_stream
from .shard import CacheShard
from .value_checks import StaleCacheRowsError

__all__ = [
    "BLOCKWISE",
    "CacheShard",
    "ContextParallel",
    "ContextParallelPlan",
    "TensorParallelHeads",
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
    "merge_attention_states",
    "mla_decode_branch_fp8",
    "mla_decode_branch_fp8_reference",
    "op_stream",
    "quantize_fp8",
    "rope_freqs_cis",
]


def _version() -> str:
    """The installed distribution's version; in a source checkout not installed, pyproject's."""
    try:
        return _metadata.version("pymla")
    except _metadata.PackageNotFoundError:
        import pathlib
        import tomllib

        pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


__version__ = _version()

# The library convention: pymla's records (compile progress at INFO) go wherever the
# application's logging sends them; the command line shows them on stderr itself.
_logging.getLogger("pymla").addHandler(_logging.NullHandler())
