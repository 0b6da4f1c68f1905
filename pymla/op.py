"""The public op: ``pymla.mla_decode_branch_fp8`` on torch tensors.

The call is registered as the torch custom op ``pymla::mla_decode_branch_fp8``
(the cache blocks declared as mutated, with a fake implementation for
tracing), so ``torch.compile(fullgraph=True)`` can trace through it. Its
real implementation validates the inputs, then runs a MAX model compiled
once per (device, dtype) and kept in this process: sizes are symbolic and
the options (granularity, mask, score_mod, scalars) are runtime inputs, so
nothing else recompiles.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time

import torch
from max import engine
from max.graph import DeviceRef

from . import bridge
from .cache import PagedLatentCache
from .graph import INPUT_NAMES, OpConfig, build_graph, mask_code, score_mod_code
from .quant import ScaleGranularity
from .reference import MASKS, SCORE_MODS, KVCacheTensors
from .validate import as_float, as_int, as_str, as_tensor, check_inputs

log = logging.getLogger("pymla")

_models: dict[OpConfig, engine.Model] = {}
_sessions: dict[str, tuple[engine.InferenceSession, object]] = {}
_lock = threading.Lock()


def _device_ref(device: torch.device) -> DeviceRef:
    return DeviceRef.CPU() if device.type == "cpu" else DeviceRef.GPU(device.index or 0)


def _session(device: torch.device) -> tuple[engine.InferenceSession, object]:
    """The MAX session and MAX device for a torch device, made once per process."""
    key = str(device)
    if key not in _sessions:
        max_device = bridge.max_device(device)
        _sessions[key] = (engine.InferenceSession(devices=[max_device]), max_device)
    return _sessions[key]


def compiled_model(config: OpConfig, device: torch.device) -> engine.Model:
    """The compiled model of ``config``, compiling it on first use (logged with its time)."""
    with _lock:
        model = _models.get(config)
        if model is not None:
            return model
        session, _ = _session(device)
        log.info("pymla: compiling mla_decode_branch_fp8 for %s, %s ...", device, config.dtype)
        start = time.perf_counter()
        model = session.load(build_graph(config))
        log.info("pymla: compiled in %.1f s", time.perf_counter() - start)
        _models[config] = model
        return model


def _check_op_args(*args, metadata_only: bool = False):
    """``check_inputs`` on the torch op's positional arguments (granularity as three ints)."""
    (*tensors, scale, epsilon, gm, gn, gk, mask, score_mod, local_window_size, check_values) = args[
        :-2
    ]
    attention_out, new_rows = args[-2:]
    return check_inputs(
        *tensors,
        scale=scale,
        epsilon=epsilon,
        scale_granularity=ScaleGranularity(gm, gn, gk),
        mask=mask,
        score_mod=score_mod,
        local_window_size=local_window_size,
        check_values=check_values and not metadata_only,
        attention_out=attention_out,
        new_rows=new_rows,
    )


@functools.lru_cache(maxsize=256)
def _scalar_buffer(value: int | float, dtype: torch.dtype):
    """A rank-0 MAX buffer holding ``value`` (the op only reads scalars, so one per value)."""
    return bridge.to_max(torch.tensor(value, dtype=dtype))


def _run_op(**inputs) -> None:
    """Checks and runs the op; ``inputs`` are the custom op's arguments, in its signature order."""
    dims = _check_op_args(*inputs.values())
    if dims.num_tokens == 0:
        return
    q = inputs["q"]
    model = compiled_model(OpConfig(bridge.max_dtype(q.dtype), _device_ref(q.device)), q.device)
    scalars = {
        "layer_idx": (inputs["layer_idx"], torch.uint32),
        "scale": (inputs["scale"], torch.float32),
        "epsilon": (inputs["epsilon"], torch.float32),
        "mask": (mask_code(inputs["mask"]), torch.int32),
        "score_mod": (score_mod_code(inputs["score_mod"]), torch.int32),
        "local_window_size": (inputs["local_window_size"], torch.int32),
        "m_scale_granularity": (inputs["m_scale_granularity"], torch.int32),
        "n_scale_granularity": (inputs["n_scale_granularity"], torch.int32),
        "k_scale_granularity": (inputs["k_scale_granularity"], torch.int32),
    }
    inputs["output"] = inputs["out"]
    # Optional tensors that were not given cross as empty tensors of the graph's rank.
    for name, rank in (("attention_out", 3), ("new_rows", 2)):
        if inputs[name].numel() == 0:
            inputs[name] = q.new_empty((0,) * rank)
    inputs["attention_output"] = inputs["attention_out"]
    buffers = [
        _scalar_buffer(*scalars[name]) if name in scalars else bridge.to_max(inputs[name])
        for name in INPUT_NAMES
    ]
    on_gpu = q.device.type != "cpu"
    if on_gpu:
        # MAX runs on its own stream: torch's writes of the inputs must be done first,
        # and the op's writes must be done before torch reads them.
        torch.cuda.current_stream(q.device).synchronize()
    model.execute(*buffers)
    if on_gpu:
        _session(q.device)[1].synchronize()


@torch.library.custom_op(
    "pymla::mla_decode_branch_fp8", mutates_args=("out", "kv_blocks", "attention_out")
)
def _mla_decode_branch_fp8_op(
    out: torch.Tensor,
    q: torch.Tensor,
    input_row_offsets: torch.Tensor,
    freqs_cis: torch.Tensor,
    kv_norm_gamma: torch.Tensor,
    kv_blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    layer_idx: int,
    w_uk: torch.Tensor,
    w_uk_scale: torch.Tensor,
    w_uv: torch.Tensor,
    w_uv_scale: torch.Tensor,
    scale: float,
    epsilon: float,
    m_scale_granularity: int,
    n_scale_granularity: int,
    k_scale_granularity: int,
    mask: str,
    score_mod: str,
    local_window_size: int,
    check_values: bool,
    attention_out: torch.Tensor,
    new_rows: torch.Tensor,
) -> None:
    _run_op(**locals())  # the parameters above, in signature order


@_mla_decode_branch_fp8_op.register_fake
def _(*args):
    _check_op_args(*args, metadata_only=True)


def cache_tensors(cache: PagedLatentCache | KVCacheTensors | tuple) -> KVCacheTensors:
    """The (blocks, cache_lengths, lookup_table) of a cache object or triple."""
    if isinstance(cache, PagedLatentCache):
        return KVCacheTensors(cache.blocks, cache.cache_lengths, cache.lookup_table)
    if isinstance(cache, tuple) and len(cache) == 3:
        if not all(isinstance(t, torch.Tensor) for t in cache):
            types = ", ".join(type(t).__name__ for t in cache)
            raise TypeError(
                f"cache: expected a (blocks, cache_lengths, lookup_table) tuple of tensors, got ({types})"
            )
        return KVCacheTensors(*cache)
    raise TypeError(
        f"cache: expected a PagedLatentCache or a (blocks, cache_lengths, lookup_table) tuple, got {type(cache).__name__}"
    )


def _check_pending(
    cache: PagedLatentCache, input_row_offsets: torch.Tensor, num_tokens: int
) -> None:
    """The new tokens of each request are the rows appended to the cache since the last advance."""
    if (
        input_row_offsets.dtype != torch.uint32
        or input_row_offsets.dim() != 1
        or input_row_offsets.shape[0] != cache.num_requests + 1
        or input_row_offsets.device != cache.blocks.device
    ):
        return  # the op's checks name the problem
    offsets = input_row_offsets.to(torch.int64).cpu().tolist()
    if (
        offsets[0] != 0
        or offsets[-1] != num_tokens
        or any(a > b for a, b in itertools.pairwise(offsets))
    ):
        return
    for b in range(cache.num_requests):
        new, pending = offsets[b + 1] - offsets[b], cache.pending(b)
        if pending and new != pending:
            raise ValueError(
                f"input_row_offsets: expected {pending} new tokens for request {b} (the rows "
                f"appended to the cache since its last advance()), got {new}"
            )


def mla_decode_branch_fp8(
    q: torch.Tensor,
    input_row_offsets: torch.Tensor,
    freqs_cis: torch.Tensor,
    kv_norm_gamma: torch.Tensor,
    cache: PagedLatentCache | KVCacheTensors,
    layer_idx: int,
    w_uk: torch.Tensor,
    w_uk_scale: torch.Tensor,
    w_uv: torch.Tensor,
    w_uv_scale: torch.Tensor,
    *,
    scale: float,
    epsilon: float = 1e-6,
    scale_granularity: ScaleGranularity | tuple[int, int, int] | str = "blockwise",
    mask: str = "causal",
    score_mod: str = "no_pos",
    local_window_size: int = 0,
    out: torch.Tensor | None = None,
    check_values: bool = True,
    attention_out: torch.Tensor | None = None,
    new_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused MLA decode branch with fp8 weights; the math is in :mod:`pymla.reference`.

    Args:
        q: ``[T, H, qk_nope_head_dim + qk_rope_head_dim]``, bfloat16, float16 or float32.
        input_row_offsets: uint32 ``[B + 1]``: request ``b`` owns rows
            ``input_row_offsets[b] .. input_row_offsets[b + 1] - 1`` of ``q``.
        freqs_cis: ``[max_seq_len, qk_rope_head_dim]`` rows ``[cos0, sin0, cos1, sin1, ...]``, q's dtype.
        kv_norm_gamma: ``[kv_lora_rank]`` RMSNorm weights, q's dtype.
        cache: a :class:`pymla.PagedLatentCache` (or its three tensors) whose
            new rows (positions ``cache_lengths[b] ..``) were already
            appended; rotated and normalized in place.
        layer_idx: the cache layer to use.
        w_uk: ``[H, kv_lora_rank, qk_nope_head_dim]`` float8_e4m3fn.
        w_uk_scale: float32 ``[H, ceil(kv_lora_rank / n), ceil(qk_nope_head_dim / k)]``.
        w_uv: ``[H, v_head_dim, kv_lora_rank]`` float8_e4m3fn.
        w_uv_scale: float32 ``[H, ceil(v_head_dim / n), ceil(kv_lora_rank / k)]``.
        scale: softmax scale.
        epsilon: RMSNorm epsilon.
        scale_granularity: ``(m, n, k)`` or a preset name (``"blockwise"``,
            ``"per_channel"``, ``"per_tensor"``); see :mod:`pymla.quant`.
        mask: ``"null"``, ``"causal"``, ``"sliding_window_causal"`` or ``"chunked_causal"``.
        score_mod: ``"no_pos"`` or ``"alibi_pos"``.
        local_window_size: window (sliding) or chunk (chunked) size in tokens.
        out: optional ``[T, H, v_head_dim]`` tensor of q's dtype to write into.
        check_values: also check the values the kernel indexes with (offsets,
            cache lengths, lookup table, finite scales). On a GPU these checks
            copy those tensors to the host each call; a trusted serving loop
            may turn them off. Types, shapes, dtypes and devices are always checked.
        attention_out: optional ``[T, H, kv_lora_rank]`` tensor of q's dtype that
            receives the attention output before step 6 (``raw`` of the reference).
        new_rows: optional ``[T, kv_lora_rank + qk_rope_head_dim]`` raw latent rows
            of the new tokens, q's dtype: the op normalizes and rotates them and
            writes them into the cache at their positions. Without it the rows
            must have been appended to the cache already.

    Returns:
        ``[T, H, v_head_dim]`` in q's dtype, on q's device (``out`` when given).
        A request without new tokens is skipped (its cache rows untouched);
        with no new tokens at all (zero requests included) the output is
        empty, ``[0, H, v_head_dim]``, and no kernel runs.

    Raises:
        TypeError, ValueError: on bad input, before any kernel runs and
            without touching the cache or ``out``: ``"<arg>: expected <what>,
            got <actual>"`` (the cache's tensors are named ``kv_blocks``,
            ``cache_lengths`` and ``lookup_table``). TypeError for a wrong
            type or dtype, ValueError for a wrong shape, layout, device or value.
    """
    kv = cache_tensors(cache)
    g = ScaleGranularity.parse(scale_granularity)
    for name, value in (
        ("q", q),
        ("input_row_offsets", input_row_offsets),
        ("freqs_cis", freqs_cis),
        ("kv_norm_gamma", kv_norm_gamma),
        ("w_uk", w_uk),
        ("w_uk_scale", w_uk_scale),
        ("w_uv", w_uv),
        ("w_uv_scale", w_uv_scale),
    ):
        as_tensor(name, value)
    for name, weight in (("w_uk", w_uk), ("w_uv", w_uv)):
        if weight.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name}: expected dtype {torch.float8_e4m3fn}, got {weight.dtype}")
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
    layer_idx = as_int("layer_idx", layer_idx)
    scale = as_float("scale", scale)
    epsilon = as_float("epsilon", epsilon)
    local_window_size = as_int("local_window_size", local_window_size)
    mask = as_str("mask", mask, MASKS)
    score_mod = as_str("score_mod", score_mod, SCORE_MODS)
    for name, value in (("attention_out", attention_out), ("new_rows", new_rows)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(value).__name__}")
    if (
        check_values
        and new_rows is None
        and isinstance(cache, PagedLatentCache)
        and not torch.compiler.is_compiling()
    ):
        _check_pending(cache, input_row_offsets, q.shape[0] if q.dim() else -1)
    if out is None:
        # A malformed q or w_uv gets a placeholder: the op's checks then name the problem.
        shaped = q.dim() == 3 and w_uv.dim() == 3
        out = q.new_empty(q.shape[0], q.shape[1], w_uv.shape[1]) if shaped else q.new_empty(0)
    op_args = dict(  # the custom op's arguments, in its signature order
        out=out,
        q=q,
        input_row_offsets=input_row_offsets,
        freqs_cis=freqs_cis,
        kv_norm_gamma=kv_norm_gamma,
        kv_blocks=kv.blocks,
        cache_lengths=kv.cache_lengths,
        lookup_table=kv.lookup_table,
        layer_idx=layer_idx,
        w_uk=w_uk.view(torch.uint8),
        w_uk_scale=w_uk_scale,
        w_uv=w_uv.view(torch.uint8),
        w_uv_scale=w_uv_scale,
        scale=scale,
        epsilon=epsilon,
        m_scale_granularity=g.m,
        n_scale_granularity=g.n,
        k_scale_granularity=g.k,
        mask=mask,
        score_mod=score_mod,
        local_window_size=local_window_size,
        check_values=bool(check_values),
        attention_out=_absent(q) if attention_out is None else attention_out,
        new_rows=_absent(q) if new_rows is None else new_rows,
    )
    if torch.compiler.is_compiling():
        torch.ops.pymla.mla_decode_branch_fp8(**op_args)
    else:
        # Eager: the same work without the custom op's Python dispatch (about 0.3 ms a
        # call); the version counters of the two mutated tensors move as the op's would.
        _run_op(**op_args)
        torch.autograd.graph.increment_version(out)
        torch.autograd.graph.increment_version(kv.blocks)
        if attention_out is not None:
            torch.autograd.graph.increment_version(attention_out)
    return out


def _absent(q: torch.Tensor) -> torch.Tensor:
    """The placeholder of an optional tensor argument that was not given (no elements)."""
    return q.new_empty(0) if isinstance(q, torch.Tensor) else torch.empty(0)
