"""pymla as a drop-in for MAX's ``max.nn.kernels.mla_decode_graph``.

:func:`mla_decode_graph` takes the arguments of MAX 26.7's function, with
their names and meanings, and adds pymla's op to the graph being built.
MAX's own op (``mo.mla.graph.decode.paged.fp8``) is GPU-only; this one also
runs on the CPU. A MAX graph swaps it in by changing one import::

    from pymla.graph import kernels_path, mla_decode_graph   # was: from max.nn.kernels import ...

    with Graph(..., custom_extensions=[kernels_path()]) as g:   # the graph needs pymla's kernels
        out = mla_decode_graph(q, kv, input_row_offsets, freqs_cis, kv_norm_gamma,
                               w_uk, w_uv, kv_params, kv_collection, layer_idx,
                               MHAMaskVariant.CAUSAL_MASK, scale, 1e-6, 128,
                               scalar_args, num_partitions_scalar,
                               w_uk_scale=..., w_uv_scale=..., quant_config=...)

How MAX's arguments map to pymla's op (:func:`pymla.graph.mla_decode_branch_fp8_graph`):

* ``kv`` ``[T, kv_lora_rank + rope_dim]``, the new tokens' raw latent rows,
  is the op's ``new_rows``: the op normalizes and rotates them and stores them
  at positions ``cache_lengths[b] + i`` of layer ``layer_idx``.
* ``kv_collection`` (:class:`max.nn.kv_cache.PagedCacheValues`) gives
  ``kv_blocks`` ``[pages, 1, num_layers, page_size, 1, head_dim]`` (MAX's MLA
  layout, which is pymla's), ``cache_lengths`` and ``lookup_table``. The pages
  must be packed (``page_stride`` is the packed sentinel, as MAX's paged
  cache manager binds a contiguous pool); a quantized cache (``kv_scales``)
  and per-layer buffers raise ``NotImplementedError``. ``max_prompt_length``,
  ``max_cache_length``, ``scalar_args`` and ``num_partitions_scalar`` are
  GPU dispatch metadata of MAX's kernel: pymla reads sizes from the tensors
  and ignores them (both may be None).
* ``mask_variant`` maps by :data:`MASKS`; MAX's ``SLIDING_WINDOW_NONCAUSAL_MASK``
  has no pymla equivalent and raises ``NotImplementedError``. MAX's function
  has no window size: for the sliding-window and chunked masks the window is
  ``local_window_size`` (a pymla extension), else ``kv_params.window_size``.
  ``score_mod`` (pymla extension, ``"no_pos"`` or ``"alibi_pos"``) defaults
  to MAX's behaviour, no positional bias.
* ``quant_config`` with ``scale_granularity_override`` gives the scale
  granularity as MAX computes it: ``m`` = the input scale's
  ``block_size[0]``, ``n = k`` = the override or the weight scale's
  ``block_size[0]`` (DeepSeek-V3: ``(1, 128, 128)``). pymla also takes
  per-tensor and row-wise configs (:func:`scale_granularity`).
  ``quant_config=None`` (MAX's bf16-weight op) raises ``NotImplementedError``:
  pymla's op is fp8 only.
* ``w_uk`` ``[H, kv_lora_rank, nope]`` and ``w_uv`` ``[H, v_head_dim, kv_lora_rank]``
  and their scales have MAX's layouts. The weights cross as ``uint8`` bytes
  of the e4m3 values: MAX 26.7 has no bitcast op, and on the CPU it rejects
  ``float8_e4m3fn`` even as a graph input or weight (measured: "Failed to
  compile the model"), so a CPU graph cannot hold an fp8-typed value at all.
  Declare the weights ``uint8`` (graph inputs, or ``Weight(..., DType.uint8)``
  loaded from the checkpoint's e4m3 bytes; from torch ``w.view(torch.uint8)``).
  An fp8-typed value raises ``TypeError`` saying so.
* ``cache_format="fp8_ds_mla"`` (pymla extension; :mod:`pymla.cache_format`):
  the cache holds 656-byte fp8 rows, as FlashMLA's sparse kernel and vLLM's
  ``fp8_ds_mla`` cache. Declare ``kv_params`` with ``dtype=DType.uint8`` and
  ``head_dim`` the row's bytes (656 for DeepSeek-V3); ``q`` and ``kv`` are
  bfloat16 and the op quantizes the new rows itself, on the CPU and the GPU
  (there with the tensor-core attention kernels). MAX 26.7's own quantized cache
  (``kv_scales``, separate scales) is another layout and stays refused.
* ``freqs_cis`` and ``kv_norm_gamma`` of another float dtype than ``q`` are
  cast to ``q``'s dtype in the graph (pymla's op reads them in its dtype).
* Sparse attention arguments (``sparse_indices`` and the index/sink options)
  raise ``NotImplementedError`` naming the argument when given (a value other
  than MAX's default).

One difference of meaning with MAX's built-in: with several new tokens per
request (speculative decoding, MTP), token ``i`` of request ``b`` is a query
at position ``cache_lengths[b] + i`` under the mask (pymla's spec,
:mod:`pymla.reference`). MAX's built-in on H100/H200 computes one query per
request: its ``mla_decoding`` kernel (modular/modular
``max/kernels/src/nn/attention/gpu/mla.mojo`` at 0eeb9c14, which folds S > 1
tokens only on SM100 and AMD) reads request ``b``'s first row, lets it see all
``cache_length + new_tokens`` keys (masked as the last token) and writes
attention row ``b``; rows ``B..T-1`` are left unwritten. Measured on the H200
with 2 tokens: rows ``0..B-1`` match the reference's first tokens with every
new key visible; see ``examples/README.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferValue, DeviceRef, TensorValue, Value, ops

from .args import WINDOWED_MASKS, ScoreMod
from .cache_format import FP8_DS_MLA, parse_cache_format
from .graph import mla_decode_branch_fp8_graph
from .quant import PER_CHANNEL, PER_TENSOR, ScaleGranularity

if TYPE_CHECKING:  # max.nn costs ~0.5 s to import: only where a function needs it
    from max.nn.attention.mask_config import MHAMaskVariant
    from max.nn.kv_cache import KVCacheInputsPerDevice, KVCacheParams, PagedCacheValues
    from max.nn.quant_config import QuantConfig

MASK_VARIANTS: dict[str, str] = {
    "NULL_MASK": "null",
    "CAUSAL_MASK": "causal",
    "SLIDING_WINDOW_CAUSAL_MASK": "sliding_window_causal",
    "CHUNKED_CAUSAL_MASK": "chunked_causal",
}
"""MAX's ``MHAMaskVariant`` names and pymla's masks (:data:`pymla.args.MASKS`)."""

UNSUPPORTED_MASK_VARIANTS: dict[str, str] = {
    "SLIDING_WINDOW_NONCAUSAL_MASK": (
        "a query also attends to every later position; pymla's masks are "
        "null, causal, sliding_window_causal and chunked_causal"
    ),
}
"""MAX's mask variants without a pymla equivalent, and why."""

SPARSE_DEFAULTS: dict[str, Any] = {
    "sparse_indices": None,
    "sparse_topk_lengths": None,
    "sparse_attn_sink": None,
    "sparse_indices_stride": None,
    "sparse_attn_sink_inert": False,
    "index_share": False,
    "physical_indices": None,
    "index_kpool": 1,
    "index_pool_topk": 0,
    "index_kpool_select_tail": True,
    "selection_lag": 0,
}
"""MAX's sparse-MLA keyword arguments and their defaults (= not given)."""

FP8_TYPES = (DType.float8_e4m3fn, DType.float8_e4m3fnuz)


def mask_name(mask_variant: MHAMaskVariant) -> str:
    """pymla's mask name for a MAX ``MHAMaskVariant``; raises for a variant pymla lacks."""
    name = getattr(mask_variant, "name", None)
    if name in UNSUPPORTED_MASK_VARIANTS:
        raise NotImplementedError(
            f"mask_variant {name}: no pymla equivalent ({UNSUPPORTED_MASK_VARIANTS[name]})"
        )
    if name not in MASK_VARIANTS:
        raise ValueError(f"mask_variant: expected an MHAMaskVariant, got {mask_variant!r}")
    return MASK_VARIANTS[name]


def scale_granularity(
    quant_config: QuantConfig, scale_granularity_override: int | None = None
) -> ScaleGranularity:
    """pymla's ``(m, n, k)`` for MAX's ``quant_config`` and override.

    Block scales follow MAX's ``_fp8_mla_scale_params``: ``m`` is the input
    scale's ``block_size[0]``, ``n`` and ``k`` the override or the weight
    scale's ``block_size[0]``. Beyond MAX's fused op, which takes block
    scales only, per-tensor scales on both sides give ``(0, 0, 0)``, and
    row-wise weights with MAX's per-token ("colwise") inputs ``(1, 1, 0)``.
    """
    from max.nn.quant_config import ScaleGranularity as MaxScaleGranularity

    if quant_config is None:
        raise NotImplementedError(
            "quant_config=None selects MAX's bf16-weight op; pymla's op takes fp8 weights only"
        )
    inputs, weights = quant_config.input_scale, quant_config.weight_scale
    if weights.granularity == MaxScaleGranularity.BLOCK:
        assert weights.block_size is not None  # WeightScaleSpec checks it
        gran = (
            scale_granularity_override
            if scale_granularity_override is not None
            else weights.block_size[0]
        )
        if inputs.block_size is None:
            raise NotImplementedError(
                f"quant_config: block weight scales with {inputs.granularity} input scales"
            )
        return ScaleGranularity(inputs.block_size[0], gran, gran)
    if scale_granularity_override is not None:
        raise ValueError("scale_granularity_override: only for block weight scales")
    pair = (inputs.granularity, weights.granularity)
    if pair == (MaxScaleGranularity.TENSOR, MaxScaleGranularity.TENSOR):
        return PER_TENSOR
    if pair == (MaxScaleGranularity.COLWISE, MaxScaleGranularity.ROWWISE):
        return PER_CHANNEL  # MAX's per-token inputs (colwise) and per-channel weights
    raise NotImplementedError(f"quant_config: input {pair[0]} with weight {pair[1]} scales")


def _check_sparse(arguments: dict[str, Any]) -> None:
    for name, default in SPARSE_DEFAULTS.items():
        value = arguments[name]
        given = value is not None if default is None else value != default
        if given:
            raise NotImplementedError(
                f"{name}: pymla's op has no sparse attention (MAX's sparse MLA decode)"
            )


def _tensor(value: Value | TensorValue) -> TensorValue:
    return value if isinstance(value, TensorValue) else value.tensor


def _buffer(value: Value | BufferValue) -> BufferValue:
    return value if isinstance(value, BufferValue) else value.buffer


def _weight(name: str, value: TensorValue) -> TensorValue:
    if value.dtype in FP8_TYPES:
        raise TypeError(
            f"{name}: pass the fp8 weights as uint8 bytes of the e4m3 values "
            f"(a uint8 graph input or Weight; from torch w.view(torch.uint8)): "
            f"MAX 26.7 has no bitcast op and rejects {value.dtype} on the CPU"
        )
    if value.dtype != DType.uint8:
        raise TypeError(f"{name}: expected uint8 (fp8 e4m3 bytes), got {value.dtype}")
    return value


def mla_decode_graph(
    q: TensorValue,
    kv: TensorValue,
    input_row_offsets: TensorValue,
    freqs_cis: TensorValue,
    kv_norm_gamma: TensorValue,
    w_uk: TensorValue,
    w_uv: TensorValue,
    kv_params: KVCacheParams,
    kv_collection: PagedCacheValues,
    layer_idx: TensorValue,
    mask_variant: MHAMaskVariant,
    scale: float,
    epsilon: float,
    v_head_dim: int,
    scalar_args: TensorValue | None = None,
    num_partitions_scalar: TensorValue | None = None,
    *,
    w_uk_scale: TensorValue | None = None,
    w_uv_scale: TensorValue | None = None,
    quant_config: QuantConfig | None = None,
    scale_granularity_override: int | None = None,
    sparse_indices: TensorValue | None = None,
    sparse_topk_lengths: TensorValue | None = None,
    sparse_attn_sink: TensorValue | None = None,
    sparse_indices_stride: int | None = None,
    sparse_attn_sink_inert: bool = False,
    index_share: bool = False,
    physical_indices: bool | None = None,
    index_kpool: int = 1,
    index_pool_topk: int = 0,
    index_kpool_select_tail: bool = True,
    selection_lag: int = 0,
    score_mod: str = "no_pos",
    local_window_size: int | None = None,
    cache_format: str = "dtype",
) -> TensorValue:
    """MAX's ``mla_decode_graph`` on pymla's op: returns ``[T, H, v_head_dim]`` in q's dtype.

    Arguments as in ``max.nn.kernels.mla_decode_graph`` (module docstring for
    the mapping); ``score_mod``, ``local_window_size`` and ``cache_format``
    are pymla's extensions.
    """
    cache_format = parse_cache_format(cache_format)
    _check_sparse(
        {
            "sparse_indices": sparse_indices,
            "sparse_topk_lengths": sparse_topk_lengths,
            "sparse_attn_sink": sparse_attn_sink,
            "sparse_indices_stride": sparse_indices_stride,
            "sparse_attn_sink_inert": sparse_attn_sink_inert,
            "index_share": index_share,
            "physical_indices": physical_indices,
            "index_kpool": index_kpool,
            "index_pool_topk": index_pool_topk,
            "index_kpool_select_tail": index_kpool_select_tail,
            "selection_lag": selection_lag,
        }
    )
    mask = mask_name(mask_variant)
    score_mod = ScoreMod.parse(score_mod)
    window = local_window_size if local_window_size is not None else kv_params.window_size or 0
    if mask in WINDOWED_MASKS and window < 1:
        raise ValueError(
            f"{mask_variant.name} needs a window: pass local_window_size or set kv_params.window_size"
        )
    granularity = scale_granularity(quant_config, scale_granularity_override)
    if w_uk_scale is None or w_uv_scale is None:
        raise ValueError("w_uk_scale and w_uv_scale are required with quant_config")

    q, kv = _tensor(q), _tensor(kv)
    if q.rank != 3 or kv.rank != 2:
        raise ValueError(f"expected q of rank 3 and kv of rank 2, got {q.rank} and {kv.rank}")
    if cache_format == FP8_DS_MLA:
        if q.dtype != DType.bfloat16 or kv.dtype != q.dtype or kv_params.dtype != DType.uint8:
            raise ValueError(
                "cache_format: 'fp8_ds_mla' expects a bfloat16 q and kv and kv_params of dtype "
                f"uint8 (656-byte rows), got q {q.dtype}, kv {kv.dtype}, kv_params {kv_params.dtype}"
            )
    elif kv_params.dtype != q.dtype or kv.dtype != q.dtype:
        raise NotImplementedError(
            f"the cache ({kv_params.dtype}) and kv ({kv.dtype}) must have q's dtype ({q.dtype}): "
            "pymla's op has no quantized (fp8) KV cache"
        )
    if kv_collection.kv_scales is not None:
        raise NotImplementedError("kv_collection.kv_scales: pymla's op has no quantized KV cache")
    if kv_collection.kv_blocks_per_layer is not None:
        raise NotImplementedError("kv_collection: per-layer cache buffers (per_layer_buffers)")
    w_uk, w_uv = _weight("w_uk", _tensor(w_uk)), _weight("w_uv", _tensor(w_uv))
    if int(w_uv.shape[1]) != v_head_dim:
        raise ValueError(f"v_head_dim: {v_head_dim}, but w_uv is {w_uv.shape}")
    layer_idx = _tensor(layer_idx)
    if layer_idx.dtype != DType.uint32:
        raise ValueError(f"expected uint32 layer_idx but got {layer_idx.dtype}")
    if layer_idx.rank != 0:
        layer_idx = ops.reshape(layer_idx, [])
    if layer_idx.device != DeviceRef.CPU():
        layer_idx = layer_idx.to(DeviceRef.CPU())

    def in_q_dtype(value: TensorValue) -> TensorValue:
        value = _tensor(value)
        return value if value.dtype == q.dtype else ops.cast(value, q.dtype)

    return mla_decode_branch_fp8_graph(
        q,
        _tensor(input_row_offsets),
        in_q_dtype(freqs_cis),
        in_q_dtype(kv_norm_gamma),
        _buffer(kv_collection.kv_blocks),
        _tensor(kv_collection.cache_lengths),
        _tensor(kv_collection.lookup_table),
        layer_idx,
        w_uk,
        _tensor(w_uk_scale),
        w_uv,
        _tensor(w_uv_scale),
        scale=float(scale),
        epsilon=float(epsilon),
        scale_granularity=granularity,
        mask=mask,
        score_mod=score_mod,
        local_window_size=window,
        new_rows=kv,
    )


def runtime_kv_inputs(cache: Any, params: KVCacheParams) -> KVCacheInputsPerDevice[Buffer, Buffer]:
    """Binds a torch-owned :class:`pymla.PagedLatentCache` as MAX's runtime KV cache inputs.

    The result has the fields of ``params.get_symbolic_inputs()`` (an
    ``MLAKVCacheParams``; flatten both with ``max.tree.flatten``, in the same
    order): a graph built from MAX's KV cache types runs on pymla's cache
    without a copy (DLPack), with pymla's op or with MAX's. The pages must
    have been reserved for the new tokens (:meth:`pymla.PagedLatentCache.append`).
    ``max_prompt_length`` (the most pending tokens of a request, at least 1),
    ``max_cache_length`` and the dispatch metadata (``params.resolve_attn_key``)
    are for MAX's GPU kernel: pymla's op reads none of them.
    """
    import numpy as np
    import torch
    from max.nn.kv_cache import KVCacheInputsPerDevice

    from . import bridge

    def host(values: Iterable[int], dtype: type) -> Buffer:
        return Buffer.from_numpy(np.array(list(values), dtype=dtype))

    lengths = cache.cache_lengths.to(torch.int64).tolist()
    pending = [cache.pending(b) for b in range(cache.num_requests)]
    prompt = max(pending, default=0) or 1
    longest = max((n + p for n, p in zip(lengths, pending, strict=True)), default=0)
    key = params.resolve_attn_key(cache.num_requests, prompt, longest)
    spec = params.dispatch_metadata_spec()
    metadata = np.zeros(spec.shape, dtype=np.int64)
    key.pack_into(metadata, longest)
    dispatch = Buffer.from_numpy(metadata)
    if spec.on_device:
        dispatch = dispatch.to(bridge.max_device(cache.blocks.device))
    return KVCacheInputsPerDevice(
        kv_blocks=bridge.to_max(cache.blocks),
        cache_lengths=bridge.to_max(cache.cache_lengths),
        lookup_table=bridge.to_max(cache.lookup_table),
        max_prompt_length=host([prompt], np.uint32),
        max_cache_length=host([longest], np.uint32),
        page_stride=host([-1], np.int64),  # packed pages (PACKED_PAGE_STRIDE)
        attention_dispatch_metadata=dispatch,
        mla_num_partitions=host([key.num_partitions], np.int64),
    )
