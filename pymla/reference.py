"""Torch reference of ``mla_decode_branch_fp8``: float32 math with the op's rounding points.

This docstring is the specification of the op; the Mojo kernel and the
public function :func:`pymla.mla_decode_branch_fp8` implement exactly this.

Notation: ``T`` query tokens in all, ``B`` requests, ``H`` heads,
``Dn = qk_nope_head_dim`` (128), ``Dr = qk_rope_head_dim`` (64),
``R = kv_lora_rank`` (512), ``Dv = v_head_dim`` (128). Request ``b`` owns
query rows ``t`` in ``[o[b], o[b+1])`` of ``q`` (``o = input_row_offsets``);
its ``i``-th query token sits at position ``p = c[b] + i`` of the sequence
(``c = cache_lengths``). Its latent row for layer ``l`` is either already in
the cache at that position or given as ``new_rows[t]``; the op normalizes,
rotates and stores it there. ``L[b] = c[b] + o[b+1] - o[b]`` keys are visible in all.

Rounding points. Arithmetic is float32. ``D = dtype`` (of q, the cache and
the output). ``rnd(x)`` rounds to ``D`` (nearest even); for float32 it is the
identity, so float32 is float32 throughout. For bfloat16 and float16 the op
follows the original kernel (and FlashMLA, FlashInfer): ``q_full`` and the
attention output are materialized in ``D``; scores and ``P V`` are products
of ``D`` values summed in float32; softmax is float32; the probabilities are
rounded to ``D`` for ``P V`` while their sum stays float32.

1. RoPE, interleaved pairs. With ``f = freqs_cis[p]`` read as pairs
   ``(cos_j, sin_j) = (f[2j], f[2j+1])``, a vector ``x`` of width ``Dr``
   becomes ``y[2j] = x[2j] cos_j - x[2j+1] sin_j`` and
   ``y[2j+1] = x[2j] sin_j + x[2j+1] cos_j``. Applied to ``q[t, h, Dn:]``
   and to the rope part ``row[R:]`` of each new token's cache row, stored as ``rnd(y)``.
2. RMSNorm of the latent part of each new token's cache row, stored as
   ``rnd(row[:R] / sqrt(mean(row[:R]^2) + epsilon) * gamma)``.
   A cache in the ``fp8_ds_mla`` format (op dtype bfloat16) then stores the
   row quantized: per 128 latent values a power-of-two float32 scale
   ``2^ceil(log2(amax / 448))`` (1 for ``amax = 0``) and the e4m3 values
   ``e4m3_rne(x / scale)``; the rope part stays bfloat16. Reading a row
   (as a new row's input in step 1 and 2, and as ``K[j]``, ``V[j]`` in
   step 5) gives ``e4m3 * scale``, exactly a bfloat16 value: step 5 is the
   bfloat16 computation on these values (:mod:`pymla.cache_format`
   has the layout, the rule and why the values are exact; rows another
   writer left with other scales read as ``rnd(e4m3 * scale)``).
3. q_nope projection, an fp8 batched matmul over heads:
   ``qn[t, h, :] = rnd(fp8mm(q[t, h, :Dn], w_uk[h]))`` with
   ``fp8mm(a, w)[n] = sum_k dq(a)[k] * dq(w)[n, k]``, where ``a`` is quantized
   dynamically and ``dq`` dequantizes (see :mod:`pymla.quant` for the scale
   granularity and the scale rule; per head, the M axis is the tokens).
4. Concatenation: ``qf[t, h] = concat(qn[t, h], rnd(rope(q[t, h, Dn:])))``, width ``R + Dr``.
5. MLA decode attention per request and head, with ``K[j] = row_j`` (width
   ``R + Dr``) and ``V[j] = row_j[:R]`` for the visible positions ``j``:
   ``s[j] = scale * <qf[t, h], K[j]> + bias(h, p, j)`` for ``j`` in the mask's
   key range ``[lo(p), hi(p))``; ``e[j] = exp(s[j] - max(s))``;
   ``raw[t, h] = rnd(sum_j rnd(e[j]) V[j] / sum_j e[j])``; its log-sum-exp
   ``lse[t, h] = log(sum_j exp(s[j]))`` (natural log, float32, the op's
   optional ``lse``: ``max(s) + log(sum_j e[j])``).
   Key ranges: ``null`` ``[0, L)``; ``causal`` ``[0, p + 1)``;
   ``sliding_window_causal`` ``[max(0, p - W + 1), p + 1)``;
   ``chunked_causal`` ``[floor(p / W) * W, p + 1)``, with
   ``W = local_window_size``. Biases: ``no_pos`` 0;
   ``alibi_pos`` ``-slope(h) * (p - j)`` with the ALiBi slopes of
   :func:`alibi_slopes`.
6. Output projection: ``out[t, h, :] = rnd(fp8mm(raw[t, h, :], w_uv[h]))``.

A shard of the cache (:class:`pymla.CacheShard`, context-parallel decode)
holds the positions ``j`` with ``shard.owns(j)``, position ``j`` at local
slot ``shard.local_count(j)``. The op on a shard runs steps 1 and 2 on the
new rows it holds (at their slots) and step 5 over its keys only: ``j`` in
the mask's range and held by the shard; positions, masks and biases stay
global. A row none of whose keys the shard holds gets ``raw = 0`` and
``lse = -inf``. The ranks' results merge exactly
(:func:`pymla.merge_attention_states`): with ``M = max_r lse_r``,
``raw = sum_r exp(lse_r - M) raw_r / sum_r exp(lse_r - M)`` and
``lse = M + log(sum_r exp(lse_r - M))``.

A kernel with an online softmax rounds ``exp(s[j] - m)`` for a running max
``m`` rather than the final one: the same value up to one rounding of ``D``
per probability. :mod:`pymla.parity` derives the tolerances from this.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .args import MASKS, SCORE_MODS, KVCacheTensors
from .cache_format import read_rows, value_dtype, write_rows
from .quant import ScaleGranularity, fp8_batched_matmul
from .shard import CacheShard

# MASKS, SCORE_MODS and KVCacheTensors are the op's vocabulary (pymla.args), used here and
# importable from here as before.


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes (Press et al.): ``2^(-8 (h+1) / n)`` for a power of two ``n = H``.

    Otherwise, with ``n`` the largest power of two below ``H``: heads
    ``h < n`` take ``2^(-8 (h+1) / n)`` and the rest take
    ``2^(-8 (2 (h - n) + 1) / (2 n))`` (the odd slopes of ``2n`` heads).
    """
    n = 1 << (num_heads.bit_length() - 1)
    h = torch.arange(num_heads, dtype=torch.float32)
    first = torch.exp2(-8.0 * (h + 1) / n)
    rest = torch.exp2(-8.0 * (2 * (h - n) + 1) / (2 * n))
    return torch.where(h < n, first, rest)


def key_range(mask: str, position: int, visible: int, window: int) -> tuple[int, int]:
    """The half-open range of key positions a query at ``position`` attends to."""
    if mask == "null":
        return 0, visible
    if mask == "causal":
        return 0, position + 1
    if mask == "sliding_window_causal":
        return max(0, position - window + 1), position + 1
    if mask == "chunked_causal":
        return (position // window) * window, position + 1
    raise ValueError(f"mask: expected one of {MASKS}, got {mask!r}")


def rope_freqs_cis(max_seq_len: int, rope_dim: int = 64, theta: float = 10000.0) -> torch.Tensor:
    """The standard RoPE table for ``freqs_cis``: float32 ``[max_seq_len, rope_dim]``.

    Row ``p`` is ``[cos(p w_0), sin(p w_0), cos(p w_1), sin(p w_1), ...]`` with
    ``w_j = theta ** (-2j / rope_dim)``; cast it to the op's dtype.
    """
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.stack([angles.cos(), angles.sin()], dim=-1).reshape(max_seq_len, rope_dim).float()


def rope_interleaved(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Step 1 on ``x [..., Dr]`` with ``freqs [..., Dr]`` rows ``[cos0, sin0, cos1, sin1, ...]``."""
    x = x.to(torch.float32)
    f = freqs.to(torch.float32)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    cos, sin = f[..., 0::2], f[..., 1::2]
    y = torch.empty_like(x)
    y[..., 0::2] = x0 * cos - x1 * sin
    y[..., 1::2] = x0 * sin + x1 * cos
    return y


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Step 2 on ``x [..., R]``."""
    x = x.to(torch.float32)
    inv = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + epsilon)
    return x * inv * gamma.to(torch.float32)


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rnd``: ``x`` rounded to ``dtype`` (nearest even), returned as float32."""
    return x.to(dtype).to(torch.float32)


def _row_index(cache: KVCacheTensors, b: int, positions: torch.Tensor, layer: int) -> tuple:
    page_size = cache.blocks.shape[3]
    pages = cache.lookup_table[b].to(torch.int64)[positions // page_size]
    return pages, 0, layer, positions % page_size, 0


class Batch(NamedTuple):
    """Where each request's query tokens are: ``offsets`` and ``lengths`` as Python ints."""

    offsets: list[int]
    lengths: list[int]

    @classmethod
    def of(cls, input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor) -> Batch:
        return cls(
            [int(v) for v in input_row_offsets.to(torch.int64).tolist()],
            [int(v) for v in cache_lengths.to(torch.int64).tolist()],
        )

    def new_positions(self, b: int) -> torch.Tensor:
        """Sequence positions of request ``b``'s new tokens."""
        start = self.lengths[b]
        return torch.arange(start, start + self.offsets[b + 1] - self.offsets[b])

    def positions(self) -> torch.Tensor:
        """The position of every query row ``t``."""
        return torch.cat(
            [self.new_positions(b) for b in range(len(self.offsets) - 1)]
            + [torch.zeros(0, dtype=torch.int64)]
        )


class Stages(NamedTuple):
    """The reference's intermediate results (float32 tensors holding values of ``dtype``)."""

    q_full: torch.Tensor  # [T, H, R + Dr], step 4
    attention: torch.Tensor  # [T, H, R], step 5 (``raw``)
    attention_magnitude: torch.Tensor  # [T, H, R]: sum_j e[j] |V[j]| / sum_j e[j]
    out: torch.Tensor  # [T, H, Dv] in dtype, step 6
    lse: torch.Tensor  # [T, H] float32: log sum_j exp(s[j]), step 5
    score_magnitude: torch.Tensor  # [T, H]: max_j scale sum_i |qf[i] K[j, i]| + |bias(j)|
    product_magnitude: torch.Tensor  # [T, H]: scale max_i |qf[i]| max_{j, i} |K[j, i]|


def store_new_rows(
    cache: KVCacheTensors,
    batch: Batch,
    layer_idx: int,
    freqs_cis: torch.Tensor,
    kv_norm_gamma: torch.Tensor,
    epsilon: float,
    new_rows: torch.Tensor | None = None,
    shard: CacheShard | None = None,
) -> None:
    """Steps 1 and 2 on the new tokens' cache rows, in place (read from ``new_rows`` when given).

    On a shard's cache, the rows of the positions it holds, at their local slots.
    """
    rank = kv_norm_gamma.shape[0]
    shard = CacheShard() if shard is None else shard
    for b in range(len(batch.offsets) - 1):
        all_pos = batch.new_positions(b)
        owned = shard.owns(all_pos)
        pos = all_pos[owned]
        idx = _row_index(cache, b, shard.local_count(pos), layer_idx)
        if new_rows is None:
            rows = read_rows(cache.blocks, idx, rank)
        else:
            given = new_rows[batch.offsets[b] : batch.offsets[b + 1]]
            rows = given[owned.to(given.device)].to(torch.float32, copy=True)
        rows[:, rank:] = rope_interleaved(rows[:, rank:], freqs_cis[pos])
        rows[:, :rank] = rms_norm(rows[:, :rank], kv_norm_gamma, epsilon)
        write_rows(cache.blocks, idx, rows, rank)


def build_q_full(
    q: torch.Tensor,
    positions: torch.Tensor,
    freqs_cis: torch.Tensor,
    w_uk: torch.Tensor,
    w_uk_scale: torch.Tensor,
    granularity: ScaleGranularity,
) -> torch.Tensor:
    """Steps 1, 3 and 4 on q: ``qf = concat(rnd(fp8mm(q_nope, w_uk)), rnd(rope(q_rope)))``."""
    nope = w_uk.shape[2]
    q32 = q.to(torch.float32)
    q_rope = rope_interleaved(q32[:, :, nope:], freqs_cis[positions][:, None, :])
    q_nope_proj = fp8_batched_matmul(
        q32[:, :, :nope].transpose(0, 1), w_uk, w_uk_scale, granularity
    ).transpose(0, 1)
    return rounded(torch.cat([q_nope_proj, q_rope], dim=2), q.dtype)


def attend(
    q_full: torch.Tensor,
    cache: KVCacheTensors,
    batch: Batch,
    layer_idx: int,
    rank: int,
    *,
    scale: float,
    mask: str,
    score_mod: str,
    local_window_size: int,
    key_range: Callable[[str, int, int, int], tuple[int, int]] = key_range,
    shard: CacheShard | None = None,
) -> tuple[torch.Tensor, ...]:
    """Step 5: ``raw``, ``sum_j e[j] |V[j]| / sum_j e[j]`` (tolerances), ``lse``, magnitudes.

    For the tolerances of the LSE, per row (0 for a row without keys): the
    score magnitude ``max_j scale sum_i |qf[i] K[j, i]| + |bias(j)|`` bounds
    what float32 summation order can move its scores; the product magnitude
    ``scale max_i |qf[i]| max_{j, i} |K[j, i]|`` what one element of q_full
    or of a key rounded to the other neighbour can.

    ``key_range``: the mask's rule (:func:`key_range`); tests pass a wrong
    one. ``shard``: the positions ``cache`` holds (module docstring).
    """
    dtype = value_dtype(cache.blocks)
    shard = CacheShard() if shard is None else shard
    num_tokens, num_heads, _ = q_full.shape
    slopes = (alibi_slopes(num_heads) if score_mod == "alibi_pos" else torch.zeros(num_heads)).to(
        q_full.device
    )
    raw = torch.empty(num_tokens, num_heads, rank, dtype=torch.float32, device=q_full.device)
    magnitude = torch.empty_like(raw)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q_full.device)
    score_magnitude = torch.zeros_like(lse)
    product_magnitude = torch.zeros_like(lse)
    for b in range(len(batch.offsets) - 1):
        start, stop = batch.offsets[b], batch.offsets[b + 1]
        visible = batch.lengths[b] + stop - start
        slots = torch.arange(shard.local_count(visible))
        keys = read_rows(cache.blocks, _row_index(cache, b, slots, layer_idx), rank)
        key_pos = shard.position(slots).to(torch.float32).to(q_full.device)
        for t in range(start, stop):
            p = batch.lengths[b] + t - start
            lo, hi = key_range(mask, p, visible, local_window_size)
            lo, hi = shard.local_count(lo), shard.local_count(hi)  # the shard's slots
            if lo >= hi:  # the shard holds none of the row's keys
                raw[t], magnitude[t], lse[t] = 0.0, 0.0, -math.inf
                continue
            k = keys[lo:hi]
            scores = scale * (q_full[t] @ k.T)  # [H, hi - lo]
            dist = (p - key_pos[lo:hi])[None, :]
            scores = scores - slopes[:, None] * dist
            top = scores.amax(dim=-1, keepdim=True)
            e = torch.exp(scores - top)
            total = e.sum(dim=-1, keepdim=True)
            raw[t] = rounded((rounded(e, dtype) @ k[:, :rank]) / total, dtype)
            magnitude[t] = (e @ k[:, :rank].abs()) / total
            lse[t] = (top + total.log())[:, 0]
            bias = (slopes[:, None] * dist).abs()
            score_magnitude[t] = (scale * (q_full[t].abs() @ k.abs().T) + bias).amax(dim=-1)
            product_magnitude[t] = scale * q_full[t].abs().amax(dim=-1) * k.abs().max()
    return raw, magnitude, lse, score_magnitude, product_magnitude


def project_output(
    raw: torch.Tensor,
    w_uv: torch.Tensor,
    w_uv_scale: torch.Tensor,
    granularity: ScaleGranularity,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Step 6: ``out = rnd(fp8mm(raw, w_uv))``, ``[T, H, Dv]`` in ``dtype``."""
    out = fp8_batched_matmul(raw.to(torch.float32).transpose(0, 1), w_uv, w_uv_scale, granularity)
    return out.transpose(0, 1).to(dtype).contiguous()


def mla_decode_branch_fp8_stages(
    q: torch.Tensor,
    input_row_offsets: torch.Tensor,
    freqs_cis: torch.Tensor,
    kv_norm_gamma: torch.Tensor,
    cache: KVCacheTensors,
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
    new_rows: torch.Tensor | None = None,
    key_range: Callable[[str, int, int, int], tuple[int, int]] = key_range,
    shard: CacheShard | None = None,
) -> Stages:
    """The six steps of the module docstring with their intermediate results.

    Updates ``cache.blocks`` in place; arguments are those of
    :func:`pymla.mla_decode_branch_fp8` (no input checks here). ``key_range``
    is step 5's rule (:func:`key_range`), a hook for tests that check that a
    wrong key range is caught. ``shard``: the positions ``cache`` holds
    (module docstring); its ``out`` projects the shard's partial ``raw``.
    """
    shard = CacheShard() if shard is None else shard
    if score_mod not in SCORE_MODS:
        raise ValueError(f"score_mod: expected one of {SCORE_MODS}, got {score_mod!r}")
    granularity = ScaleGranularity.parse(scale_granularity)
    batch = Batch.of(input_row_offsets, cache.cache_lengths)
    store_new_rows(cache, batch, layer_idx, freqs_cis, kv_norm_gamma, epsilon, new_rows, shard)
    q_full = build_q_full(q, batch.positions(), freqs_cis, w_uk, w_uk_scale, granularity)
    raw, magnitude, lse, score_magnitude, product_magnitude = attend(
        q_full,
        cache,
        batch,
        layer_idx,
        w_uk.shape[1],
        scale=scale,
        mask=mask,
        score_mod=score_mod,
        local_window_size=local_window_size,
        key_range=key_range,
        shard=shard,
    )
    out = project_output(raw, w_uv, w_uv_scale, granularity, q.dtype)
    return Stages(q_full, raw, magnitude, out, lse, score_magnitude, product_magnitude)


def mla_decode_branch_fp8_reference(*args, **kwargs) -> torch.Tensor:
    """Runs the six steps of the module docstring; updates ``cache.blocks`` in place.

    Arguments are those of :func:`pymla.mla_decode_branch_fp8` (no input
    checks here), as in :func:`mla_decode_branch_fp8_stages`. Returns
    ``[T, H, Dv]`` in ``q.dtype``.
    """
    return mla_decode_branch_fp8_stages(*args, **kwargs).out


def default_scale(qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64) -> float:
    """DeepSeek's softmax scale ``1 / sqrt(Dn + Dr)`` (without YaRN's mscale)."""
    return 1.0 / math.sqrt(qk_nope_head_dim + qk_rope_head_dim)
