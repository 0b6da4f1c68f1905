"""The public op: ``pymla.mla_decode_branch_fp8`` on torch tensors.

The one-shot call checks every input, then makes a :class:`~pymla.DecodePlan`
and :class:`~pymla.LayerWeights` of them and launches through the plan, the
path :meth:`~pymla.DecodePlan.run` takes (a serving loop calls :func:`pymla.plan`
and ``run`` itself: plan once per step, run per layer). Traced by
``torch.compile``, the plan's launch calls the torch custom op
``pymla::mla_decode_branch_fp8`` (:mod:`pymla.torch_op`: its schema, fake
implementation and body). A compiled MAX model per (device, dtype) serves
every call (:mod:`pymla.runtime`): sizes are symbolic and the options runtime
inputs.
"""

from __future__ import annotations

import torch

from . import validate as v
from . import value_checks
from .args import KVCacheTensors, Mask, ScoreMod
from .cache import PagedLatentCache
from .options import as_bool, as_int
from .plan import DecodeOptions, DecodePlan, LayerWeights, cache_tensors
from .quant import ScaleGranularity
from .shard import CacheShard


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
    mask: str | Mask = "causal",
    score_mod: str | ScoreMod = "no_pos",
    local_window_size: int = 0,
    out: torch.Tensor | None = None,
    check_values: bool = True,
    attention_out: torch.Tensor | None = None,
    new_rows: torch.Tensor | None = None,
    rerun_layers: bool = False,
    lse: torch.Tensor | None = None,
    shard: CacheShard | None = None,
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
            appended; rotated and normalized in place. With a
            ``PagedLatentCache`` and ``check_values`` the call is refused
            (:class:`pymla.StaleCacheRowsError`) when a request's new rows of
            ``layer_idx`` were not appended, or were rotated already by an
            earlier call of this layer in this step; see
            :meth:`pymla.DecodePlan.run` for what is not tracked (the three
            tensors, ``check_values=False``, ``torch.compile``).
        layer_idx: the cache layer to use.
        w_uk: ``[H, kv_lora_rank, qk_nope_head_dim]`` float8_e4m3fn.
        w_uk_scale: float32 ``[H, ceil(kv_lora_rank / n), ceil(qk_nope_head_dim / k)]``.
        w_uv: ``[H, v_head_dim, kv_lora_rank]`` float8_e4m3fn.
        w_uv_scale: float32 ``[H, ceil(v_head_dim / n), ceil(kv_lora_rank / k)]``.
        scale: softmax scale.
        epsilon: RMSNorm epsilon.
        scale_granularity: ``(m, n, k)`` or a preset name (``"blockwise"``,
            ``"per_channel"``, ``"per_tensor"``); see :mod:`pymla.quant`.
        mask: ``"null"``, ``"causal"``, ``"sliding_window_causal"`` or
            ``"chunked_causal"`` (any case), or a :class:`pymla.Mask`.
        score_mod: ``"no_pos"`` or ``"alibi_pos"`` (any case), or a :class:`pymla.ScoreMod`.
        local_window_size: window (sliding) or chunk (chunked) size in tokens;
            0 (the default) for the other masks.
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
        rerun_layers: for benchmarks and tests that call one layer again and
            again in a step, as :func:`pymla.plan`'s: skips the "already
            rotated" check; each call rotates the layer's new rows once more.
        lse: optional float32 ``[T, H]`` tensor that receives the natural
            log-sum-exp of each row's scaled scores in step 5 (mask and score
            mod applied; see :mod:`pymla.reference`). A row that sees no key
            (only possible on a shard of the cache) gets ``-inf`` and a zero
            attention output.
        shard: the positions the cache holds (:class:`pymla.CacheShard`;
            default the whole cache): context-parallel decode
            (:mod:`pymla.distributed`). Positions and ``cache_lengths`` stay
            global; the cache holds the shard's rows at local slots.

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
        v.as_tensor(name, value)
    for name, weight in (("w_uk", w_uk), ("w_uv", w_uv)):
        if weight.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name}: expected dtype {torch.float8_e4m3fn}, got {weight.dtype}")
    for name, value in (
        ("out", out),
        ("attention_out", attention_out),
        ("new_rows", new_rows),
        ("lse", lse),
    ):
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(value).__name__}")
    layer_idx = as_int("layer_idx", layer_idx)
    as_bool("rerun_layers", rerun_layers)
    tracking = {}  # the stale-row tracking of a PagedLatentCache, with the value checks
    options = DecodeOptions(
        scale=scale,
        epsilon=epsilon,
        mask=mask,
        score_mod=score_mod,
        local_window_size=local_window_size,
        shard=shard,
    )
    if isinstance(cache, PagedLatentCache) and cache.shard != options.shard:
        raise ValueError(
            f"shard: expected the cache's shard {cache.shard} (a PagedLatentCache holds the "
            f"positions of one shard), got {options.shard}"
        )
    if out is None:
        # A malformed q or w_uv gets a placeholder: the checks then name the problem.
        shaped = q.dim() == 3 and w_uv.dim() == 3
        out = q.new_empty(q.shape[0], q.shape[1], w_uv.shape[1]) if shaped else q.new_empty(0)
    if torch.compiler.is_compiling():
        # Traced: the plan's launch is the torch op, whose fake implementation checks the
        # metadata and whose body checks the values when the compiled graph runs.
        num_tokens = q.shape[0] if q.dim() else 0
    else:
        dims = v.check_inputs(
            out,
            q,
            input_row_offsets,
            freqs_cis,
            kv_norm_gamma,
            *kv,
            layer_idx,
            w_uk,
            w_uk_scale,
            w_uv,
            w_uv_scale,
            options=options,
            scale_granularity=g,
            check_values=bool(check_values),
            attention_out=attention_out,
            new_rows=new_rows,
            lse=lse,
        )
        num_tokens = dims.num_tokens
        if check_values and isinstance(cache, PagedLatentCache):
            tracking = dict(
                _cache=cache,
                _new_requests=value_checks.check_pending_rows(
                    cache, dims.offsets, new_rows_given=new_rows is not None
                ),
                _rerun_layers=rerun_layers,
            )
    # Plan then run, through the one launch path of DecodePlan.run (the checks above
    # cover everything run() and plan() check; the launch checks the cache's rows).
    weights = LayerWeights(
        w_uk, w_uk_scale, w_uv, w_uv_scale, kv_norm_gamma, scale_granularity=g, _checked=True,
        _launch_now=True,
    )  # fmt: skip
    step = DecodePlan(
        kv,
        input_row_offsets,
        freqs_cis,
        options,
        num_tokens=num_tokens,
        new_rows=new_rows is not None,
        _op_check_values=bool(check_values),
        _launch_now=True,
        **tracking,
    )
    step._launch(q, layer_idx, weights, out, attention_out, new_rows, lse)
    return out
