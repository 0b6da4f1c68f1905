"""fp8 (e4m3) quantization with scales: weights offline, activations dynamically.

Scale granularity
-----------------
An fp8 batched matmul ``out[g] = a[g] @ w[g].T`` with ``a[g]: [M, K]`` and
``w[g]: [N, K]`` carries float32 scales for blocks of its operands. The block
shape is given by :class:`ScaleGranularity` ``(m, n, k)``: one activation
scale covers ``m`` rows by ``k`` columns of ``a[g]``; one weight scale covers
``n`` rows by ``k`` columns of ``w[g]``. A value of ``0`` means "the whole
axis", so one triple serves both projections of the op even though their N
and K differ. The presets:

* ``PER_TENSOR = (0, 0, 0)``: one scale per head matrix, activations and weights.
* ``PER_CHANNEL = (1, 1, 0)``: one scale per token (activations) and per
  output channel (weights).
* ``BLOCKWISE = (1, 128, 128)``: 1x128 activation groups, 128x128 weight
  blocks, the DeepSeek-V3 checkpoint format.

Weight scales are laid out ``[G, ceil(N / n), ceil(K / k)]`` (MAX's layout
for its fused op); activation scales ``[G, ceil(M / m), ceil(K / k)]``.

Scale rule
----------
For a block with largest magnitude ``amax``: ``s = amax / 448`` (448 is the
largest finite e4m3 value), or ``s = 1`` when ``amax == 0``. The stored value
is ``fp8(clamp(x / s, -448, 448))`` rounded to nearest-even, and it stands
for ``fp8_value * s``. The division is a correctly rounded float32 division;
the Mojo kernel uses the same rule, bit for bit.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT32_MAX = 2**31 - 1


class ScaleGranularity(NamedTuple):
    """Rows x columns covered by one scale; 0 means the whole axis.

    ``m``: activation rows (tokens), ``n``: weight rows (output channels),
    ``k``: the reduction axis, shared by both operands.
    """

    m: int
    n: int
    k: int

    @classmethod
    def parse(cls, value: ScaleGranularity | tuple[int, int, int] | str) -> ScaleGranularity:
        """Accepts a preset name, a triple or a ScaleGranularity; raises ValueError otherwise.

        The one parse of the option: ints (not bools) in ``[0, 2**31)``, the
        kernel's int32. Everything past the public entry points takes the
        parsed value.
        """
        if isinstance(value, str):
            try:
                return PRESETS[value]
            except KeyError:
                raise ValueError(
                    f"scale_granularity: expected a preset name, one of {sorted(PRESETS)}, "
                    f"or an (m, n, k) triple of ints, got {value!r}"
                ) from None
        try:
            m, n, k = (_as_index(v) for v in value)
        except (TypeError, ValueError):
            raise ValueError(
                f"scale_granularity: expected a preset name or an (m, n, k) triple of ints, got {value!r}"
            ) from None
        if min(m, n, k) < 0:
            raise ValueError(
                f"scale_granularity: expected values >= 0 (0 = whole axis), got {(m, n, k)}"
            )
        if max(m, n, k) > INT32_MAX:  # the kernel takes them as int32
            raise ValueError(
                f"scale_granularity: expected an (m, n, k) triple of ints in [0, 2**31), got {(m, n, k)}"
            )
        return cls(m, n, k)


def _as_index(value: object) -> int:
    """An int (or numpy int); bools and floats are refused."""
    if isinstance(value, bool):
        raise TypeError("bool")
    return operator.index(value)


PER_TENSOR = ScaleGranularity(0, 0, 0)
PER_CHANNEL = ScaleGranularity(1, 1, 0)
BLOCKWISE = ScaleGranularity(1, 128, 128)
PRESETS = {"per_tensor": PER_TENSOR, "per_channel": PER_CHANNEL, "blockwise": BLOCKWISE}


def block_extent(granularity: int, size: int) -> int:
    """Elements per scale block along an axis of ``size`` (0 = the whole axis)."""
    return max(size, 1) if granularity == 0 else granularity


def num_blocks(granularity: int, size: int) -> int:
    """Number of scale blocks along an axis of ``size``."""
    extent = block_extent(granularity, size)
    return max(1, -(-size // extent))


def scale_shape(g: int, rows: int, cols: int, row_gran: int, col_gran: int) -> tuple[int, int, int]:
    """Shape of the scales of a ``[g, rows, cols]`` operand."""
    return (g, num_blocks(row_gran, rows), num_blocks(col_gran, cols))


def _block_view(x: torch.Tensor, row_gran: int, col_gran: int) -> tuple[torch.Tensor, tuple]:
    """Pads ``x [G, R, C]`` to whole blocks and views it ``[G, RB, rb, CB, cb]``."""
    g, rows, cols = x.shape
    rb, cb = block_extent(row_gran, rows), block_extent(col_gran, cols)
    nr, nc = num_blocks(row_gran, rows), num_blocks(col_gran, cols)
    padded = torch.zeros(g, nr * rb, nc * cb, dtype=x.dtype, device=x.device)
    padded[:, :rows, :cols] = x
    return padded.view(g, nr, rb, nc, cb), (rows, cols, nr * rb, nc * cb)


def expand_scales(
    scales: torch.Tensor, rows: int, cols: int, row_gran: int, col_gran: int
) -> torch.Tensor:
    """Repeats ``[G, RB, CB]`` block scales to one per element of a ``[G, rows, cols]`` operand."""
    rb, cb = block_extent(row_gran, rows), block_extent(col_gran, cols)
    full = scales.repeat_interleave(rb, dim=1).repeat_interleave(cb, dim=2)
    return full[:, :rows, :cols]


def quantize_fp8(
    x: torch.Tensor, row_gran: int, col_gran: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x [G, R, C]`` to fp8 e4m3 with one float32 scale per block.

    Returns ``(x_fp8 [G, R, C] float8_e4m3fn, scales [G, RB, CB] float32)`` with
    the scale rule of this module: ``x ~= x_fp8 * scale``.
    """
    if x.dim() != 3:
        raise ValueError(f"quantize_fp8: expected a [G, R, C] tensor, got shape {tuple(x.shape)}")
    x32 = x.to(torch.float32)
    blocks, (rows, cols, _, _) = _block_view(x32, row_gran, col_gran)
    amax = blocks.abs().amax(dim=(2, 4))
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = expand_scales(scales, rows, cols, row_gran, col_gran)
    x_fp8 = (x32 / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8, scales.contiguous()


def dequantize_fp8(
    x_fp8: torch.Tensor, scales: torch.Tensor, row_gran: int, col_gran: int
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``x_fp8 * scale`` in float32."""
    _, rows, cols = x_fp8.shape
    return x_fp8.to(torch.float32) * expand_scales(scales, rows, cols, row_gran, col_gran)


def fp8_batched_matmul(
    a: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scales: torch.Tensor,
    granularity: ScaleGranularity,
) -> torch.Tensor:
    """``a [G, M, K] @ w [G, N, K].T`` with ``a`` quantized dynamically to fp8.

    Written blockwise, as the kernel computes it: for each K block ``kb``
    the exact fp8 products are summed, then scaled by the product of the
    activation and weight scales of that block::

        out[g, m, n] = sum_kb  sa[g, m/gm, kb] * sw[g, n/gn, kb]
                               * sum_{k in kb} aq[g, m, k] * wq[g, n, k]

    Returns float32 ``[G, M, N]``.
    """
    g, m_rows, k_cols = a.shape
    n_rows = w_fp8.shape[1]
    if m_rows == 0:
        return torch.zeros(g, 0, n_rows, dtype=torch.float32, device=a.device)
    gm, gn, gk = granularity
    a_fp8, a_scales = quantize_fp8(a, gm, gk)
    kb = block_extent(gk, k_cols)
    nkb = num_blocks(gk, k_cols)
    aq, _ = _block_view(a_fp8.to(torch.float32), 1, gk)  # [G, M, 1, KB, kb]
    wq, _ = _block_view(w_fp8.to(torch.float32), 1, gk)  # [G, N, 1, KB, kb]
    aq = aq.reshape(g, m_rows, nkb, kb)
    wq = wq.reshape(g, n_rows, nkb, kb)
    partial = torch.einsum("gmbk,gnbk->gbmn", aq, wq)  # [G, KB, M, N]
    sa = a_scales.repeat_interleave(block_extent(gm, m_rows), dim=1)[:, :m_rows, :]  # [G, M, KB]
    sw = w_scales.repeat_interleave(block_extent(gn, n_rows), dim=1)[:, :n_rows, :]  # [G, N, KB]
    block_scale = sa.permute(0, 2, 1)[:, :, :, None] * sw.permute(0, 2, 1)[:, :, None, :]
    return (partial * block_scale).sum(dim=1)


def make_mla_weights(
    num_heads: int,
    kv_lora_rank: int = 512,
    qk_nope_head_dim: int = 128,
    v_head_dim: int = 128,
    granularity: ScaleGranularity = BLOCKWISE,
    *,
    generator: torch.Generator | None = None,
    std: float | None = None,
) -> dict[str, torch.Tensor]:
    """Random MLA up-projection weights quantized like a DeepSeek fp8 checkpoint.

    DeepSeek stores ``kv_b_proj.weight [H * (nope + v), kv_lora_rank]`` in fp8
    with 128x128 block scales; the decode branch reads it as
    ``w_uk [H, kv_lora_rank, nope]`` (the nope rows, transposed) and
    ``w_uv [H, v, kv_lora_rank]``. Blocks of 128x128 map onto blocks of the
    transposed slices, so quantizing the slices directly gives the same fp8
    bytes and scales as slicing a blockwise checkpoint, and it works for every
    granularity. Returns float32 originals too, for error analysis.
    """
    std = std if std is not None else kv_lora_rank**-0.5
    w_uk = torch.randn(num_heads, kv_lora_rank, qk_nope_head_dim, generator=generator) * std
    w_uv = torch.randn(num_heads, v_head_dim, kv_lora_rank, generator=generator) * std
    w_uk_fp8, w_uk_scale = quantize_fp8(w_uk, granularity.n, granularity.k)
    w_uv_fp8, w_uv_scale = quantize_fp8(w_uv, granularity.n, granularity.k)
    return {
        "w_uk": w_uk_fp8,
        "w_uk_scale": w_uk_scale,
        "w_uv": w_uv_fp8,
        "w_uv_scale": w_uv_scale,
        "w_uk_float": w_uk,
        "w_uv_float": w_uv,
    }
