"""Input checks of the op: every problem is a clear error before any kernel runs.

Errors name the argument, what was expected and what was given, in the form
``"<arg>: expected <what>, got <actual>"``. ``TypeError`` means a wrong type
or dtype; ``ValueError`` a wrong shape, layout, device or value. Nothing here
writes to any tensor, so a refused call leaves the cache as it was.

Sizes that several arguments share (heads, kv_lora_rank, qk_rope_head_dim,
the number of requests, dtype, device) are read off all of them; when they
disagree, the error names the argument that disagrees with the others (with
two, the first one listed wins).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .args import BY_NAME, WINDOWED_MASKS, Mask, ScoreMod
from .quant import PRESETS, ScaleGranularity, scale_shape

if TYPE_CHECKING:  # pymla.cache imports this module's checks
    from .cache import PagedLatentCache

FP8_DTYPE = torch.float8_e4m3fn
INDEX_DTYPE = torch.uint32
INT32_MAX = 2**31 - 1
FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_MIN_POSITIVE = 2.0**-149  # the smallest positive (subnormal) float32
UNUSED_PAGE = 0xFFFFFFFF
"""The lookup-table entry of a page a request does not own (:mod:`pymla.cache` writes it)."""


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


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _join(names: Sequence[str]) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


# ---------------------------------------------------------------- python scalars


def as_int(name: str, value: object) -> int:
    """An int argument (Python or numpy int, not bool): TypeError otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


def as_float(name: str, value: object) -> float:
    """A real-number argument (int, float or a one-element real tensor, not bool): TypeError otherwise."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype.is_floating_point:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    return float(value)


def as_bool(name: str, value: object) -> bool:
    """A bool argument: TypeError otherwise (an int is not taken for one)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def as_device(name: str, value: object) -> torch.device:
    """A torch device (a ``torch.device`` or its name) that this torch can use.

    TypeError for another type, ValueError for an unknown name or a CUDA
    device torch does not see.
    """
    if not isinstance(value, (str, torch.device)):
        raise TypeError(
            f"{name}: expected a torch.device or a device name such as 'cpu' or 'cuda:0', "
            f"got {type(value).__name__}"
        )
    try:
        device = torch.device(value)
    except RuntimeError:
        raise ValueError(
            f"{name}: expected a device name such as 'cpu' or 'cuda:0', got {value!r}"
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(
                f"{name}: expected a CUDA device this torch sees ({count} found), got {device}"
            )
    return device


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
    as_tensor(name, t)
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
    if len(got) != len(expected) or any(
        e is not None and e != g for e, g in zip(expected, got, strict=True)
    ):
        shown = ", ".join("*" if e is None else str(e) for e in expected)
        shown = f"({shown},)" if len(expected) == 1 else f"({shown})"
        raise ValueError(f"{name}: expected shape {shown} ({what}), got {got}")


# ---------------------------------------------------------------- agreement


@dataclass(frozen=True)
class _Size:
    """One argument's say on a shared size: ``t.shape[dim] - offset``.

    ``how`` formats the expected ``t.shape[dim]`` from the quantity's
    description, e.g. ``"{} + 1"`` or ``"kv_lora_rank 512 + {}"``.
    """

    name: str
    t: torch.Tensor
    dim: int
    offset: int = 0
    how: str = "{}"

    @property
    def value(self):
        return self.t.shape[self.dim] - self.offset


def _majority(values: list) -> object:
    """The most frequent value; ties go to the one listed first."""
    return max(values, key=lambda v: (values.count(v), -values.index(v)))


def _agree_size(quantity: str, sources: list[_Size]) -> int:
    """The size most ``sources`` agree on; a ValueError naming the first that does not."""
    values = [s.value for s in sources]
    best = _majority(values)
    for s, v in zip(sources, values, strict=True):
        if v != best:
            peers = [o.name for o, w in zip(sources, values, strict=True) if w == best]
            described = s.how.format(f"{quantity} {best}")
            raise ValueError(
                f"{s.name}: expected size {best + s.offset} in dim {s.dim} "
                f"({described}, as in {_join(peers)}), got {v + s.offset} (shape {_shape(s.t)})"
            )
    return best


def _agree_attr(attr: str, tensors: dict[str, torch.Tensor], error: type[Exception]) -> object:
    """The dtype or device most ``tensors`` share; an error naming the first that differs."""
    names = list(tensors)
    values = [getattr(t, attr) for t in tensors.values()]
    best = _majority(values)
    for name, v in zip(names, values, strict=True):
        if v != best:
            peers = [n for n, w in zip(names, values, strict=True) if w == best]
            if len(peers) > 3:
                peers = [peers[0], f"{len(peers) - 1} other inputs"]
            what = f"dtype {best}" if attr == "dtype" else f"a tensor on {best}"
            raise error(f"{name}: expected {what} (as {_join(peers)}), got {v}")
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


# ---------------------------------------------------------------- options


def check_options(
    *,
    scale: float,
    epsilon: float,
    mask: Mask | str,
    score_mod: ScoreMod | str,
    local_window_size: int,
) -> None:
    """The non-tensor options of the op (the scale granularity: ``ScaleGranularity.parse``).

    ``mask`` and ``score_mod`` are the enums or their names in any case
    (:meth:`pymla.Mask.parse`). Only the windowed masks (sliding_window_causal,
    chunked_causal) take a ``local_window_size``; the others need 0, so a
    window given with them is not silently ignored.
    """
    mask = Mask.parse(mask)
    ScoreMod.parse(score_mod)
    window = as_int("local_window_size", local_window_size)
    if mask.windowed and window < 1:
        raise ValueError(f"local_window_size: expected >= 1 for mask {mask.label!r}, got {window}")
    if not 0 <= window <= INT32_MAX:
        raise ValueError(
            f"local_window_size: expected 0 <= local_window_size < 2**31, got {window}"
        )
    if not mask.windowed and window != 0:
        raise ValueError(
            f"local_window_size: expected 0 for mask {mask.label!r} (only {_join(WINDOWED_MASKS)} "
            f"take a window), got {window}"
        )
    scale = as_float("scale", scale)
    if not (math.isfinite(scale) and FLOAT32_MIN_POSITIVE <= scale <= FLOAT32_MAX):
        raise ValueError(f"scale: expected a finite float32 value > 0, got {scale}")
    epsilon = as_float("epsilon", epsilon)
    if not (math.isfinite(epsilon) and 0 <= epsilon <= FLOAT32_MAX):
        raise ValueError(f"epsilon: expected a finite float32 value >= 0, got {epsilon}")


# ---------------------------------------------------------------- the op


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
    scale: float,
    epsilon: float,
    scale_granularity: ScaleGranularity,
    mask: Mask | str,
    score_mod: ScoreMod | str,
    local_window_size: int,
    check_values: bool = True,
    attention_out: torch.Tensor | None = None,
    new_rows: torch.Tensor | None = None,
) -> Dims:
    """Checks every argument of the op; with ``check_values`` also the values it indexes with.

    ``check_values=False`` checks only metadata (what torch's fake tensors
    have), for tracing. ``attention_out`` and ``new_rows`` are optional: None
    or an empty rank-1 tensor (the torch op's placeholder) means not given.
    ``scale_granularity`` is parsed already (``ScaleGranularity.parse``).
    """
    check_options(
        scale=scale,
        epsilon=epsilon,
        mask=mask,
        score_mod=score_mod,
        local_window_size=local_window_size,
    )
    layer_idx = as_int("layer_idx", layer_idx)

    # Each input on its own: type, dtype, rank, contiguity (ranks and dtypes: pymla.args).
    inputs = {
        name: (t, BY_NAME[name].rank, BY_NAME[name].torch_dtypes())
        for name, t in (
            ("q", q),
            ("input_row_offsets", input_row_offsets),
            ("freqs_cis", freqs_cis),
            ("kv_norm_gamma", kv_norm_gamma),
            ("kv_blocks", kv_blocks),
            ("cache_lengths", cache_lengths),
            ("lookup_table", lookup_table),
            ("w_uk", w_uk),
            ("w_uk_scale", w_uk_scale),
            ("w_uv", w_uv),
            ("w_uv_scale", w_uv_scale),
        )
    }
    for name, (t, rank, dtypes) in inputs.items():
        check_tensor(name, t, rank=rank, dtypes=dtypes)
    dev = _agree_attr("device", {name: t for name, (t, _, _) in inputs.items()}, ValueError)
    dtype = _agree_attr(
        "dtype",
        {"q": q, "freqs_cis": freqs_cis, "kv_norm_gamma": kv_norm_gamma, "kv_blocks": kv_blocks},
        TypeError,
    )

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
    rope_dim = _agree_size(
        "qk_rope_head_dim",
        [
            _Size("freqs_cis", freqs_cis, 1),
            _Size("kv_blocks", kv_blocks, 5, kv_lora_rank, f"kv_lora_rank {kv_lora_rank} + {{}}"),
            _Size("q", q, 2, nope_dim, f"w_uk's qk_nope_head_dim {nope_dim} + {{}}"),
        ],
    )
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
        (None, 1, None, None, 1, kv_lora_rank + rope_dim),
        "[num_blocks, 1, num_layers, page_size, 1, kv_lora_rank + qk_rope_head_dim]",
    )
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

    # The output.
    check_tensor("out", out, rank=3, dtypes=(dtype,), device=dev, dtype_note=" (q's dtype)")
    check_shape(
        "out",
        out,
        (num_tokens, num_heads, v_head_dim),
        "[tot_seq_len of q, num_heads, v_head_dim of w_uv]",
    )

    written = {"out": out, "kv_blocks": kv_blocks}
    optional = {
        "attention_out": (
            attention_out,
            (num_tokens, num_heads, kv_lora_rank),
            "[tot_seq_len of q, num_heads, kv_lora_rank]",
        ),
        "new_rows": (
            new_rows,
            (num_tokens, kv_lora_rank + rope_dim),
            "[tot_seq_len of q, kv_lora_rank + qk_rope_head_dim]",
        ),
    }
    for name, (t, shape, what) in optional.items():
        if t is None or (isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == 0):
            continue  # not given
        check_tensor(
            name, t, rank=len(shape), dtypes=(dtype,), device=dev, dtype_note=" (q's dtype)"
        )
        check_shape(name, t, shape, what)
        if name == "attention_out":
            written[name] = t
        else:
            inputs[name] = (t, len(shape), (dtype,))

    if check_values:
        _check_no_overlap(written, {name: t for name, (t, _, _) in inputs.items()})
        check_finite_scales(w_uk_scale, w_uv_scale)
        check_positions(
            input_row_offsets,
            cache_lengths,
            lookup_table,
            num_tokens=num_tokens,
            max_seq_len=freqs_cis.shape[0],
            num_blocks=num_blocks,
            page_size=page_size,
        )
    return Dims(num_tokens, num_requests, num_heads, nope_dim, rope_dim, kv_lora_rank, v_head_dim)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share memory."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _check_no_overlap(written: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
    """The tensors the op writes (out, the cache blocks, attention_out) share memory with no other argument."""
    for name, target in written.items():
        others = {**inputs, **{k: v for k, v in written.items() if k != name}}
        for other, t in others.items():
            if t is not target and other != name and _overlaps(target, t):
                raise ValueError(
                    f"{name}: expected memory of its own (the op writes it), got a tensor "
                    f"overlapping {other}"
                )


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A small integer tensor as an int64 NumPy array on the host.

    The value checks run in NumPy: torch's own small ops would wake its
    OpenMP pool, whose spinning threads then compete with the kernel's.
    """
    return t.to(torch.int64).cpu().numpy()


def check_finite_scales(w_uk_scale: torch.Tensor, w_uv_scale: torch.Tensor) -> None:
    """Every weight scale is finite."""
    for name, scales in (("w_uk_scale", w_uk_scale), ("w_uv_scale", w_uv_scale)):
        values = scales.detach().cpu().numpy()
        finite = np.isfinite(values)
        if not finite.all():
            index = tuple(int(v) for v in np.argwhere(~finite)[0])
            raise ValueError(
                f"{name}: expected finite scales, got {values[index]} at {list(index)}"
            )


def check_positions(
    input_row_offsets: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    *,
    num_tokens: int | None,
    max_seq_len: int,
    num_blocks: int,
    page_size: int,
) -> np.ndarray:
    """The values the kernel indexes with: offsets, positions, pages; returns the offsets.

    ``num_tokens`` None takes the offsets' last value as the token count (a plan's).
    """
    offsets = _as_numpy(input_row_offsets)
    if offsets[0] != 0:
        raise ValueError(f"input_row_offsets: expected to start at 0, got {int(offsets[0])}")
    steps = offsets[1:] - offsets[:-1]  # new tokens per request
    if (steps < 0).any():
        b = int(np.argmax(steps < 0))
        raise ValueError(
            f"input_row_offsets: expected non-decreasing values, got {int(offsets[b])} then "
            f"{int(offsets[b + 1])} at request {b}"
        )
    if num_tokens is None:
        num_tokens = int(offsets[-1])
    if offsets[-1] != num_tokens:
        raise ValueError(
            f"input_row_offsets: expected to end at tot_seq_len = {num_tokens} (q's dim 0), "
            f"got {int(offsets[-1])}"
        )
    if steps.size == 0:
        return offsets
    lengths = _as_numpy(cache_lengths)
    ends = lengths + steps  # one past each request's last position
    worst = int(np.argmax(ends))
    if ends[worst] > max_seq_len:
        raise ValueError(
            f"cache_lengths: expected cached + new tokens <= {max_seq_len} (freqs_cis' rows), got "
            f"{int(lengths[worst])} + {int(steps[worst])} = {int(ends[worst])} for request {worst}"
        )
    pages_needed = (ends + page_size - 1) // page_size
    capacity = lookup_table.shape[1]
    b = int(np.argmax(pages_needed))
    if pages_needed[b] > capacity:
        raise ValueError(
            f"lookup_table: expected >= {int(pages_needed[b])} pages per request (request {b} has "
            f"{int(lengths[b])} cached + {int(steps[b])} new tokens in pages of {page_size}), "
            f"got shape {_shape(lookup_table)} (were its new rows appended to the cache?)"
        )
    table = _as_numpy(lookup_table)
    used = np.arange(capacity)[None, :] < pages_needed[:, None]
    unowned = used & (table == UNUSED_PAGE)
    if unowned.any():
        b, p = (int(v) for v in np.argwhere(unowned)[0])
        raise ValueError(
            f"lookup_table: expected a page at [{b}, {p}] (request {b} has {int(lengths[b])} "
            f"cached + {int(steps[b])} new tokens in pages of {page_size}), got the unused-page "
            f"marker {UNUSED_PAGE:#x}: the request owns only {p} pages "
            "(were its new rows appended to the cache?)"
        )
    outside = used & (table >= num_blocks)
    if outside.any():
        b, p = (int(v) for v in np.argwhere(outside)[0])
        raise ValueError(
            f"lookup_table: expected entries < {num_blocks} (kv_blocks' num_blocks), "
            f"got {int(table[b, p])} at [{b}, {p}]"
        )
    _check_distinct_new_rows(offsets, lengths, table, page_size)
    return offsets


def _check_distinct_new_rows(
    offsets: np.ndarray, lengths: np.ndarray, table: np.ndarray, page_size: int
) -> None:
    """Every new token's cache row belongs to it alone (the op rewrites those rows in place)."""
    steps = offsets[1:] - offsets[:-1]
    request = np.repeat(np.arange(steps.size), steps)
    if request.size < 2:
        return
    position = lengths[request] + np.arange(request.size) - offsets[:-1][request]
    block = table[request, position // page_size]
    row = block * page_size + position % page_size
    _, inverse, counts = np.unique(row, return_inverse=True, return_counts=True)
    shared = counts[inverse.reshape(-1)] > 1
    if shared.any():
        first = int(np.argmax(shared))
        second = int(np.flatnonzero(shared & (row == row[first]))[1])
        raise ValueError(
            f"lookup_table: expected a cache row of its own for each new token, got request "
            f"{int(request[first])} position {int(position[first])} and request "
            f"{int(request[second])} position {int(position[second])} both in block "
            f"{int(block[first])} row {int(position[first]) % page_size}"
        )


class StaleCacheRowsError(ValueError):
    """The cache does not hold the raw rows of a request's new tokens in the layer run.

    The op rotates and normalizes the new rows in place, so it would work on
    whatever the cache holds at the new positions: stale rows of an earlier
    step, rows never written for this layer, or rows an earlier run of this
    layer in the same step already rotated (a second rotation is silently
    wrong). Append the rows (:meth:`pymla.PagedLatentCache.append`, once per
    layer and step), or pass them as ``new_rows`` (and reserve their slots
    with :meth:`~pymla.PagedLatentCache.reserve`).
    """


def check_pending_rows(
    cache: PagedLatentCache, offsets: np.ndarray, *, new_rows_given: bool
) -> frozenset[int]:
    """Each request's new tokens are the rows appended (or reserved) since its last advance().

    Returns the requests with new tokens, which each run then checks per
    layer (:func:`stale_rows_error`).
    """
    steps = offsets[1:] - offsets[:-1]
    for b in range(min(cache.num_requests, steps.size)):
        new, pending = int(steps[b]), cache.pending(b)
        if pending and new != pending:
            raise ValueError(
                f"input_row_offsets: expected {pending} new token{'s' if pending != 1 else ''} "
                f"for request {b} (the rows appended to the cache since its last advance()), "
                f"got {new}"
            )
        if new and not pending and not new_rows_given:
            raise StaleCacheRowsError(
                f"cache: request {b} has {new} new token{'s' if new != 1 else ''} but no rows "
                "appended since its last advance() (call cache.append(...) for this step, or "
                "pass new_rows= with slots from cache.reserve(...))"
            )
    return frozenset(np.flatnonzero(steps).tolist())


def stale_rows_error(
    cache: PagedLatentCache, offsets: torch.Tensor, request: int, layer: int
) -> StaleCacheRowsError:
    """Why a run of ``layer`` may not use ``request``'s new rows (see ``new_rows_state``).

    ``offsets``: the run's ``input_row_offsets`` (read on this error path only).
    """
    if cache.new_rows_state(request, layer) == "rotated":
        return StaleCacheRowsError(
            f"cache: request {request}'s new rows of layer {layer} were already rotated by an "
            "earlier run in this step (another run would rotate them again); append them again "
            f"(cache.append({request}, {layer}, rows)) to redo the layer, or pass "
            "rerun_layers=True to repeat it on purpose"
        )
    start, stop = _as_numpy(offsets[request : request + 2])
    n = int(stop - start)
    return StaleCacheRowsError(
        f"cache: request {request} has {n} new token{'s' if n != 1 else ''} but no rows "
        f"appended for layer {layer} since its last advance() (call "
        f"cache.append({request}, {layer}, rows) before running layer {layer}, or pass new_rows=)"
    )
