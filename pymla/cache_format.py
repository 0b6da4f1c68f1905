"""Cache formats: how a latent row is stored in the paged cache's blocks.

Two formats (``cache_format``):

* ``"dtype"`` (the default): a row is ``kv_lora_rank + qk_rope_head_dim``
  values of the op's dtype (bfloat16, float16 or float32), as MAX's MLA cache.
* ``"fp8_ds_mla"``: the row layout of FlashMLA's sparse kernel and vLLM's
  ``fp8_ds_mla`` cache, for op dtype bfloat16 only. A row is
  ``R + 4 R / 128 + 2 Dr`` bytes (656 for ``R = kv_lora_rank = 512``,
  ``Dr = qk_rope_head_dim = 64``), the blocks ``uint8``:

  - bytes ``[0, R)``: the latent part, ``R`` e4m3 (float8_e4m3fn) values;
  - bytes ``[R, R + 4 R / 128)``: ``R / 128`` float32 scales (little
    endian), one per 128 latent values;
  - the last ``2 Dr`` bytes: the rope part, ``Dr`` bfloat16 values.

  ``R`` must be a multiple of 128.

Quantization rule (``fp8_ds_mla``), deterministic so that the reference and
the kernel store the same bytes. The latent part ``x`` of a row is first
rounded to bfloat16, exactly as the ``"dtype"`` format stores it (step 2's
``rnd``). Per block of 128 values with ``amax = max |x|``:

* ``scale = 2^e`` with ``e`` the smallest integer such that
  ``amax <= 448 * 2^e`` (``e = ceil(log2(amax / 448))``; 448 is the largest
  finite e4m3 value); ``scale = 1`` when ``amax = 0``. A power of two,
  stored as float32.
* ``q = e4m3_rne(x / scale)``: the division by a power of two is exact, and
  ``|x / scale| <= 448``, so rounding to the nearest e4m3 value (ties to
  even) never saturates.

For a bfloat16 ``amax`` with ``amax / 448`` a normal float32 this is the ``ue8m0`` scale of
DeepSeek's reference, ``fast_pow2(fast_log2_ceil(amax / 448))`` on the
rounded float32 quotient: that quotient lands on a power of two only when
``amax / 448`` is one exactly, which 8 significant bits allow only there.
Rows written by a producer with other float32 scales (``amax / 448``) are
read the same way (the stored scale multiplies), but their values are then
not always bfloat16 values: every reader (the kernels and
:func:`dequantize_rows`) rounds ``q * scale`` to bfloat16.

The rope part is stored as bfloat16 (after step 1's rotation, as the
``"dtype"`` format stores it). The row's values are read back as
``q * scale`` (latent) and the bfloat16 rope values.

Why the dequantized key is exactly a bfloat16 value: an e4m3 value has at
most 4 significant bits (1 implicit + 3 stored) and bfloat16 has 8, with
float32's exponent range; multiplying by a power of two only moves the
exponent. So ``q * scale`` is a bfloat16 value whenever it stays in
bfloat16's range: for every block with ``2^-116 <= amax <= 2^127``
(then ``2^-124 <= scale <= 2^119``: the smallest nonzero value, ``2^-9 scale``, is
at least bfloat16's smallest subnormal ``2^-133``, and the largest,
``448 scale <= 1.75 * 2^127``, is finite), which holds for any RMSNormed
row. Step 5 therefore multiplies the same bfloat16 values as with a
bfloat16 cache holding the dequantized rows: its products, rounding points
and parity tolerances (:mod:`pymla.parity`) are unchanged against a
reference that reads the dequantized keys (:func:`read_rows`).
"""

from __future__ import annotations

import torch

DTYPE_FORMAT = "dtype"
FP8_DS_MLA = "fp8_ds_mla"
CACHE_FORMATS: tuple[str, ...] = (DTYPE_FORMAT, FP8_DS_MLA)
"""The cache formats: rows in the op's dtype, or the 656-byte fp8 rows."""

SCALE_BLOCK = 128
"""Latent values per float32 scale in an ``fp8_ds_mla`` row."""
E4M3_MAX = 448.0
FP8_STORAGE = torch.uint8
"""The blocks' dtype of an ``fp8_ds_mla`` cache (MAX takes no float8 on the CPU: bytes)."""
FP8_VALUE_DTYPE = torch.bfloat16
"""The op dtype an ``fp8_ds_mla`` cache serves (its rows read back as bfloat16 values)."""


def parse_cache_format(value: object, name: str = "cache_format") -> str:
    """One of :data:`CACHE_FORMATS`; TypeError for a non-str, ValueError for another name."""
    if not isinstance(value, str):
        raise TypeError(
            f"{name}: expected a str, one of {CACHE_FORMATS}, got {type(value).__name__}"
        )
    if value not in CACHE_FORMATS:
        raise ValueError(f"{name}: expected one of {CACHE_FORMATS}, got {value!r}")
    return value


def fp8_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of an ``fp8_ds_mla`` row: ``R`` e4m3, ``R / 128`` float32 scales, ``Dr`` bfloat16."""
    return kv_lora_rank + 4 * (kv_lora_rank // SCALE_BLOCK) + 2 * rope_dim


def row_width(cache_format: str, kv_lora_rank: int, rope_dim: int) -> int:
    """The blocks' last dim: values (``"dtype"``) or bytes (``"fp8_ds_mla"``) per row."""
    if cache_format == FP8_DS_MLA:
        return fp8_row_bytes(kv_lora_rank, rope_dim)
    return kv_lora_rank + rope_dim


def format_of(blocks: torch.Tensor) -> str:
    """The format of a cache's blocks: ``uint8`` blocks hold ``fp8_ds_mla`` rows."""
    return FP8_DS_MLA if blocks.dtype == FP8_STORAGE else DTYPE_FORMAT


def value_dtype(blocks: torch.Tensor) -> torch.dtype:
    """The dtype of the values a cache's rows hold: the op's dtype (bfloat16 for fp8 rows)."""
    return FP8_VALUE_DTYPE if blocks.dtype == FP8_STORAGE else blocks.dtype


def fp8_kv_lora_rank(row_bytes: int, rope_dim: int) -> int | None:
    """The ``R`` of ``fp8_ds_mla`` rows of ``row_bytes`` bytes, None when no multiple of 128 fits."""
    latent = row_bytes - 2 * rope_dim  # R + R / 32
    if latent <= 0 or latent % 33:
        return None
    rank = latent // 33 * 32
    return rank if rank % SCALE_BLOCK == 0 else None


def kv_lora_rank_of(blocks: torch.Tensor, rope_dim: int) -> int | None:
    """``kv_lora_rank`` of a cache's blocks given the rope width (None: no fp8 layout fits)."""
    width = blocks.shape[-1] if blocks.dim() else 0
    if format_of(blocks) == FP8_DS_MLA:
        return fp8_kv_lora_rank(width, rope_dim)
    return width - rope_dim


def block_scales(latent: torch.Tensor) -> torch.Tensor:
    """The power-of-two scales ``[..., R / 128]`` of latent values ``[..., R]`` (module docstring)."""
    amax = latent.float().unflatten(-1, (-1, SCALE_BLOCK)).abs().amax(dim=-1)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    # amax <= 448 * 2^e  <=>  mantissa * 2^exponent <= 0.875 * 2^(9 + e)
    e = torch.where(mantissa <= E4M3_MAX / 512, exponent - 9, exponent - 8)
    scale = torch.ldexp(torch.ones_like(amax), e)
    return torch.where(amax > 0, scale, torch.ones_like(amax))


def quantize_rows(rows: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """``fp8_ds_mla`` bytes ``[..., row bytes]`` of rows ``[..., R + Dr]`` (the module's rule).

    Both parts are first rounded to bfloat16 (the values the ``"dtype"``
    format would store); the latent part is then quantized per 128 values.
    """
    if kv_lora_rank % SCALE_BLOCK:
        raise ValueError(
            f"kv_lora_rank: expected a multiple of {SCALE_BLOCK} for fp8_ds_mla rows, "
            f"got {kv_lora_rank}"
        )
    rows = rows.to(FP8_VALUE_DTYPE).float()
    latent, rope = rows[..., :kv_lora_rank], rows[..., kv_lora_rank:]
    scales = block_scales(latent)
    q = (latent / scales.repeat_interleave(SCALE_BLOCK, dim=-1)).to(torch.float8_e4m3fn)
    return torch.cat(
        [
            q.view(torch.uint8),
            scales.contiguous().view(torch.uint8),
            rope.to(FP8_VALUE_DTYPE).contiguous().view(torch.uint8),
        ],
        dim=-1,
    )


def split_rows(raw: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, ...]:
    """The three parts of ``fp8_ds_mla`` rows: e4m3 latent, float32 scales, bfloat16 rope."""
    n_scales = kv_lora_rank // SCALE_BLOCK
    latent = raw[..., :kv_lora_rank].contiguous().view(torch.float8_e4m3fn)
    scales = raw[..., kv_lora_rank : kv_lora_rank + 4 * n_scales].contiguous().view(torch.float32)
    rope = raw[..., kv_lora_rank + 4 * n_scales :].contiguous().view(FP8_VALUE_DTYPE)
    return latent, scales, rope


def dequantize_rows(raw: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """The values ``[..., R + Dr]`` (float32 holding bfloat16 values) of ``fp8_ds_mla`` rows:
    ``e4m3 * scale`` rounded to bfloat16, as every kernel reads them (exact, no rounding, for the
    power-of-two scales this package writes; a writer of other scales gets them rounded)."""
    latent, scales, rope = split_rows(raw, kv_lora_rank)
    values = latent.float() * scales.repeat_interleave(SCALE_BLOCK, dim=-1)
    return torch.cat([values.to(torch.bfloat16).float(), rope.float()], dim=-1)


def read_rows(blocks: torch.Tensor, index: tuple, kv_lora_rank: int) -> torch.Tensor:
    """The values of the rows ``blocks[index]`` as float32, in either format."""
    rows = blocks[index]
    if format_of(blocks) == FP8_DS_MLA:
        return dequantize_rows(rows, kv_lora_rank)
    return rows.to(torch.float32)


def stored(rows: torch.Tensor, blocks: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """Rows ``[..., R + Dr]`` as ``blocks`` stores them: rounded to its dtype, or quantized."""
    if format_of(blocks) == FP8_DS_MLA:
        return quantize_rows(rows, kv_lora_rank)
    return rows.to(blocks.dtype)


def write_rows(blocks: torch.Tensor, index: tuple, rows: torch.Tensor, kv_lora_rank: int) -> None:
    """Stores rows ``[..., R + Dr]`` at ``blocks[index]`` in the blocks' format."""
    blocks[index] = stored(rows, blocks, kv_lora_rank).to(blocks.device)
