"""Input checks of the op: every problem is a clear error before any kernel runs.

Errors name the argument, what was expected and what was given, in the form
``"<arg>: expected <what>, got <actual>"``. ``TypeError`` means a wrong type
or dtype; ``ValueError`` a wrong shape, layout, device or value. Nothing here
writes to any tensor, so a refused call leaves the cache as it was. This
module checks types, shapes, dtypes and devices (the options come checked, as a
:class:`pymla.DecodeOptions`); the checks that read tensor values
(``check_values``) are in :mod:`pymla.value_checks`.

Sizes that several arguments share (heads, kv_lora_rank, qk_rope_head_dim,
the number of requests, dtype, device) are read off all of them; when they
disagree, the error names the argument that disagrees with the others (with
two, the first one listed wins).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from . import value_checks  # called through the module, where a test patches the checks
from .args import ARGS, ScoreMod
from .cache_format import FP8_STORAGE, FP8_VALUE_DTYPE, SCALE_BLOCK, fp8_row_bytes
from .options import DecodeOptions, _join, as_int
from .quant import PRESETS, ScaleGranularity, scale_shape

FP8_DTYPE = torch.float8_e4m3fn
INDEX_DTYPE = torch.uint32


@dataclass(frozen=True)
class Dims:
    """Sizes of one call, read off validated inputs."""

    num_tokens: int
    num_requests: int
    num_heads: int
    nope_dim: int
    rope_dim: int
    kv_lora_rank: int
    v_head_dim: int
    offsets: np.ndarray | None = field(default=None, compare=False)
    """``input_row_offsets`` as read by the value checks (int64 on the host); None without them."""


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def as_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------- one tensor


def check_tensor(
    name: str,
    t: object,
    *,
    rank: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
    dtype_note: str = "",
) -> torch.Tensor:
    """Type, dtype, rank, contiguity and device of one tensor argument."""
    if not isinstance(t, torch.Tensor):
        as_tensor(name, t)  # raises
    if t.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {expected}{dtype_note}, got {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected a rank-{rank} tensor, got shape {_shape(t)}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor (call .contiguous()), got strides {t.stride()} "
            f"for shape {_shape(t)}"
        )
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where q is), got {t.device}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: tuple, what: str) -> None:
    """``expected`` holds ints or None (any size); ``what`` names the dims."""
    got = _shape(t)
    if got != expected and (
        len(got) != len(expected)
        or any(e is not None and e != g for e, g in zip(expected, got, strict=True))
    ):
        shown = ", ".join("*" if e is None else str(e) for e in expected)
        shown = f"({shown},)" if len(expected) == 1 else f"({shown})"
        raise ValueError(f"{name}: expected shape {shown} ({what}), got {got}")


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of a contiguous tensor; empty for one without elements."""
    start = t.data_ptr()
    return (start, start + t.nbytes)


def spans_overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether two byte ranges (:func:`byte_span`) share a byte."""
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


# ---------------------------------------------------------------- agreement


class _Size(NamedTuple):
    """One argument's say on a shared size: ``t.shape[dim] - offset``.

    ``how`` formats the expected ``t.shape[dim]`` from the quantity's
    description, e.g. ``"{} + 1"`` or ``"kv_lora_rank 512 + {}"``. A named
    tuple: a call makes a dozen (a frozen dataclass costs three times as much).
    """

    name: str
    t: torch.Tensor
    dim: int
    offset: int = 0
    how: str = "{}"

    @property
    def value(self):
        return self.t.shape[self.dim] - self.offset


def _majority(values: list) -> tuple[object, int | None]:
    """The most frequent value (ties go to the one listed first) and the position of the first
    value that differs from it (None: all agree)."""
    first = values[0]
    if values.count(first) == len(values):  # the usual case, without the counting below
        return first, None
    best = max(values, key=lambda v: (values.count(v), -values.index(v)))
    return best, next(i for i, v in enumerate(values) if v != best)


def _agree_size(quantity: str, sources: list[_Size]) -> int:
    """The size most ``sources`` agree on; a ValueError naming the first that does not."""
    values = [s.value for s in sources]
    best, odd = _majority(values)
    if odd is not None:
        s = sources[odd]
        peers = [o.name for o, w in zip(sources, values, strict=True) if w == best]
        described = s.how.format(f"{quantity} {best}")
        raise ValueError(
            f"{s.name}: expected size {best + s.offset} in dim {s.dim} "
            f"({described}, as in {_join(peers)}), got {values[odd] + s.offset} "
            f"(shape {_shape(s.t)})"
        )
    return best


def _agree_attr(attr: str, tensors: dict[str, torch.Tensor], error: type[Exception]) -> object:
    """The dtype or device most ``tensors`` share; an error naming the first that differs."""
    values = [getattr(t, attr) for t in tensors.values()]
    best, odd = _majority(values)
    if odd is not None:
        names = list(tensors)
        peers = [n for n, w in zip(names, values, strict=True) if w == best]
        if len(peers) > 3:
            peers = [peers[0], f"{len(peers) - 1} other inputs"]
        what = f"dtype {best}" if attr == "dtype" else f"a tensor on {best}"
        raise error(f"{names[odd]}: expected {what} (as {_join(peers)}), got {values[odd]}")
    return best


def _at_least(name: str, t: torch.Tensor, dim: int, what: str, minimum: int = 1) -> None:
    if t.shape[dim] < minimum:
        raise ValueError(
            f"{name}: expected {what} >= {minimum} in dim {dim}, got {t.shape[dim]} "
            f"(shape {_shape(t)})"
        )


def _blocks_text(axis: str, size: int, granularity: int) -> str:
    if granularity == 0:
        return f"1 (whole {axis} {size})"
    return f"ceil({axis} {size} / {granularity})"


def _check_scales(
    name: str,
    scales: torch.Tensor,
    num_heads: int,
    rows: tuple[str, int],
    cols: tuple[str, int],
    g: ScaleGranularity,
) -> None:
    expected = scale_shape(num_heads, rows[1], cols[1], g.n, g.k)
    got = _shape(scales)
    if got == expected:
        return
    what = (
        f"[num_heads {num_heads}, {_blocks_text(*rows, g.n)}, {_blocks_text(*cols, g.k)}] "
        f"for scale_granularity {tuple(g)}"
    )
    fits = [
        f"{preset!r} {tuple(p)}"
        for preset, p in PRESETS.items()
        if (p.n, p.k) != (g.n, g.k) and scale_shape(num_heads, rows[1], cols[1], p.n, p.k) == got
    ]
    hint = f"; that shape fits scale_granularity {' or '.join(fits)}" if fits else ""
    raise ValueError(f"{name}: expected shape {expected} ({what}), got {got}{hint}")


# ---------------------------------------------------------------- the op


def check_cache_format(kv_blocks: torch.Tensor, dtype: torch.dtype) -> None:
    """``uint8`` blocks (``fp8_ds_mla`` rows) serve a bfloat16 op (CPU and GPU alike)."""
    if kv_blocks.dtype != FP8_STORAGE:
        return
    if dtype != FP8_VALUE_DTYPE:
        raise TypeError(
            f"kv_blocks: expected dtype {dtype} (q's), or uint8 fp8_ds_mla rows with a "
            f"{FP8_VALUE_DTYPE} q, got uint8 with {dtype}"
        )


FP8_GPU_KEY_DIM_MAX = 576
"""The GPU reads fp8_ds_mla rows with its tensor-core attention kernels only (mojo_kernels/gpu/plan.mojo
``check_fp8_shapes``): key dim ``R + Dr`` a multiple of 16 up to 576, ``R`` up to 512."""
FP8_GPU_RANK_MAX = 512


def check_fp8_gpu_sizes(kv_lora_rank: int, rope_dim: int, device: torch.device) -> None:
    """On a GPU, ``fp8_ds_mla`` rows need sizes the tensor-core attention kernels take."""
    if device.type == "cpu":
        return
    key_dim = kv_lora_rank + rope_dim
    if key_dim % 16 or key_dim > FP8_GPU_KEY_DIM_MAX or kv_lora_rank > FP8_GPU_RANK_MAX:
        raise ValueError(
            f"kv_blocks: expected, for fp8_ds_mla rows on {device}, kv_lora_rank + "
            f"qk_rope_head_dim a multiple of 16 up to {FP8_GPU_KEY_DIM_MAX} and kv_lora_rank up to "
            f"{FP8_GPU_RANK_MAX} (the GPU's tensor-core attention kernels), got kv_lora_rank "
            f"{kv_lora_rank} and qk_rope_head_dim {rope_dim}"
        )


def check_fp8_row_width(
    kv_blocks: torch.Tensor, kv_lora_rank: int, rope_dim: int, device: torch.device
) -> None:
    """The last dim of ``fp8_ds_mla`` blocks: ``R + 4 R / 128 + 2 Dr`` bytes, ``R`` a multiple of
    128; on a GPU also :func:`check_fp8_gpu_sizes`."""
    if kv_lora_rank % SCALE_BLOCK:
        raise ValueError(
            f"kv_blocks: expected kv_lora_rank a multiple of {SCALE_BLOCK} for uint8 fp8_ds_mla "
            f"rows (one float32 scale per {SCALE_BLOCK} latent values), got kv_lora_rank "
            f"{kv_lora_rank} (of w_uk)"
        )
    expected = fp8_row_bytes(kv_lora_rank, rope_dim)
    if kv_blocks.shape[5] != expected:
        raise ValueError(
            f"kv_blocks: expected size {expected} in dim 5 (fp8_ds_mla row bytes: kv_lora_rank "
            f"{kv_lora_rank} + 4 * {kv_lora_rank // SCALE_BLOCK} scale bytes + 2 * "
            f"qk_rope_head_dim {rope_dim}), got {kv_blocks.shape[5]} (shape {_shape(kv_blocks)})"
        )
    check_fp8_gpu_sizes(kv_lora_rank, rope_dim, device)


def check_shard_device(shard, score_mod: ScoreMod | str, device: torch.device) -> None:
    """A shard of the cache with ALiBi runs on the CPU only (the GPU kernels take slots for positions)."""
    if shard is None or shard.whole or device.type == "cpu":
        return
    if ScoreMod.parse(score_mod) == ScoreMod.ALIBI_POS:
        raise ValueError(
            f"score_mod: expected 'no_pos' for a shard of the cache on {device} (ALiBi on a "
            "shard runs on the CPU only), got 'alibi_pos'"
        )


_TENSOR_SPECS = {
    a.name: (a.rank, a.torch_dtypes(), " (fp8_ds_mla rows)" if a.name == "kv_blocks" else "")
    for a in ARGS
    if not a.is_scalar
}
"""Each tensor argument's rank, dtypes and dtype note (:data:`pymla.args.ARGS`), read once."""


def check_inputs(
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
    *,
    options: DecodeOptions,
    scale_granularity: ScaleGranularity,
    check_values: bool = True,
    attention_out: torch.Tensor | None = None,
    new_rows: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    first_step: int = 1,
) -> Dims:
    """Checks every argument of the op; with ``check_values`` also the values it indexes with.

    ``check_values=False`` checks only metadata (what torch's fake tensors
    have), for tracing. ``attention_out``, ``lse``, ``new_rows`` and ``out``
    are optional: None or an empty rank-1 tensor (the torch op's placeholder)
    means not given (no ``out``: the op stops after step 5, which then needs
    ``attention_out``). ``options`` (a :class:`pymla.DecodeOptions`, checked
    when made: scale, epsilon, mask, score mod, window, the cache's shard) and
    ``scale_granularity`` (``ScaleGranularity.parse``) come parsed.
    ``first_step`` 6 (step 6 alone) reads ``attention_out`` and needs ``out``.
    """
    first_step = as_int("first_step", first_step)
    if first_step not in (1, 6):
        raise ValueError(
            f"first_step: expected 1 (the six steps) or 6 (step 6 alone), got {first_step}"
        )
    layer_idx = as_int("layer_idx", layer_idx)

    # Each input on its own: type, dtype, rank, contiguity (ranks and dtypes: pymla.args).
    inputs = {
        "q": q,
        "input_row_offsets": input_row_offsets,
        "freqs_cis": freqs_cis,
        "kv_norm_gamma": kv_norm_gamma,
        "kv_blocks": kv_blocks,
        "cache_lengths": cache_lengths,
        "lookup_table": lookup_table,
        "w_uk": w_uk,
        "w_uk_scale": w_uk_scale,
        "w_uv": w_uv,
        "w_uv_scale": w_uv_scale,
    }
    for name, t in inputs.items():
        rank, dtypes, note = _TENSOR_SPECS[name]
        check_tensor(name, t, rank=rank, dtypes=dtypes, dtype_note=note)
    dev = _agree_attr("device", inputs, ValueError)
    fp8_cache = kv_blocks.dtype == FP8_STORAGE  # rows in the fp8_ds_mla format
    valued = {"q": q, "freqs_cis": freqs_cis, "kv_norm_gamma": kv_norm_gamma}
    if not fp8_cache:
        valued["kv_blocks"] = kv_blocks
    dtype = _agree_attr("dtype", valued, TypeError)
    check_cache_format(kv_blocks, dtype)

    # Sizes shared between arguments.
    num_tokens = q.shape[0]
    num_heads = _agree_size(
        "num_heads", [_Size("q", q, 1), _Size("w_uk", w_uk, 0), _Size("w_uv", w_uv, 0)]
    )
    _at_least("q", q, 1, "num_heads")
    kv_lora_rank = _agree_size(
        "kv_lora_rank",
        [_Size("w_uk", w_uk, 1), _Size("w_uv", w_uv, 2), _Size("kv_norm_gamma", kv_norm_gamma, 0)],
    )
    _at_least("w_uk", w_uk, 1, "kv_lora_rank")
    nope_dim = w_uk.shape[2]
    _at_least("w_uk", w_uk, 2, "qk_nope_head_dim")
    rope_sources = [_Size("freqs_cis", freqs_cis, 1)]
    if not fp8_cache:
        rope_sources.append(
            _Size("kv_blocks", kv_blocks, 5, kv_lora_rank, f"kv_lora_rank {kv_lora_rank} + {{}}")
        )
    rope_sources.append(_Size("q", q, 2, nope_dim, f"w_uk's qk_nope_head_dim {nope_dim} + {{}}"))
    rope_dim = _agree_size("qk_rope_head_dim", rope_sources)
    if rope_dim < 2 or rope_dim % 2:
        raise ValueError(
            f"freqs_cis: expected an even qk_rope_head_dim >= 2 in dim 1 (q's dim 2 minus w_uk's "
            f"qk_nope_head_dim {nope_dim}), got {rope_dim} (shape {_shape(freqs_cis)})"
        )
    v_head_dim = w_uv.shape[1]
    _at_least("w_uv", w_uv, 1, "v_head_dim")

    g = scale_granularity
    _check_scales(
        "w_uk_scale",
        w_uk_scale,
        num_heads,
        ("kv_lora_rank", kv_lora_rank),
        ("qk_nope_head_dim", nope_dim),
        g,
    )
    _check_scales(
        "w_uv_scale",
        w_uv_scale,
        num_heads,
        ("v_head_dim", v_head_dim),
        ("kv_lora_rank", kv_lora_rank),
        g,
    )

    # The cache.
    check_shape(
        "kv_blocks",
        kv_blocks,
        (None, 1, None, None, 1, None if fp8_cache else kv_lora_rank + rope_dim),
        "[num_blocks, 1, num_layers, page_size, 1, kv_lora_rank + qk_rope_head_dim]",
    )
    if fp8_cache:
        check_fp8_row_width(kv_blocks, kv_lora_rank, rope_dim, dev)
    _at_least("kv_blocks", kv_blocks, 3, "page_size")
    num_blocks, _, num_layers, page_size, _, _ = _shape(kv_blocks)
    if not 0 <= layer_idx < num_layers:
        raise ValueError(
            f"layer_idx: expected 0 <= layer_idx < {num_layers} (kv_blocks' num_layers), got {layer_idx}"
        )
    num_requests = _agree_size(
        "num_requests",
        [
            _Size("input_row_offsets", input_row_offsets, 0, 1, "{} + 1"),
            _Size("cache_lengths", cache_lengths, 0),
            _Size("lookup_table", lookup_table, 0),
        ],
    )
    if num_requests < 0:
        raise ValueError(
            "input_row_offsets: expected shape [num_requests + 1] (at least [0]), got an empty tensor"
        )

    # The outputs.
    written = {"kv_blocks": kv_blocks}
    optional = {
        "out": (
            out,
            (num_tokens, num_heads, v_head_dim),
            "[tot_seq_len of q, num_heads, v_head_dim of w_uv]",
        ),
        "attention_out": (
            attention_out,
            (num_tokens, num_heads, kv_lora_rank),
            "[tot_seq_len of q, num_heads, kv_lora_rank]",
        ),
        "lse": (lse, (num_tokens, num_heads), "[tot_seq_len of q, num_heads]"),
        "new_rows": (
            new_rows,
            (num_tokens, kv_lora_rank + rope_dim),
            "[tot_seq_len of q, kv_lora_rank + qk_rope_head_dim]",
        ),
    }
    given = set()
    for name, (t, shape, what) in optional.items():
        if t is None or (isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == 0):
            continue  # not given
        given.add(name)
        t_dtype, note = (torch.float32, "") if name == "lse" else (dtype, " (q's dtype)")
        check_tensor(name, t, rank=len(shape), dtypes=(t_dtype,), device=dev, dtype_note=note)
        check_shape(name, t, shape, what)
        if name == "new_rows":
            inputs[name] = t
        else:
            written[name] = t
    check_shard_device(options.shard, options.score_mod, dev)
    if "out" in given:  # first, as the op's own result: an overlap is named after it
        written = {"out": written.pop("out"), **written}
    if first_step == 6 and not {"out", "attention_out"} <= given:
        raise ValueError(
            "first_step: expected out and attention_out with 6 (step 6 alone reads "
            f"attention_out, writes out), got {' and '.join(sorted(given)) or 'neither'}"
        )
    if "out" not in given and "attention_out" not in given:
        raise ValueError(
            "out: expected a tensor [tot_seq_len of q, num_heads, v_head_dim of w_uv] "
            "(without it the op stops after step 5, so attention_out is needed), got none"
        )

    offsets = None
    if check_values:
        value_checks._check_no_overlap(written, inputs)
        value_checks.check_finite_scales(w_uk_scale, w_uv_scale)
        offsets = value_checks.check_positions(
            input_row_offsets,
            cache_lengths,
            lookup_table,
            num_tokens=num_tokens,
            max_seq_len=freqs_cis.shape[0],
            num_blocks=num_blocks,
            page_size=page_size,
            shard=options.shard,
        )
    return Dims(
        num_tokens, num_requests, num_heads, nope_dim, rope_dim, kv_lora_rank, v_head_dim, offsets
    )
