"""Input checks of the op: every problem is a clear error before any kernel runs.

Errors name the argument, what was expected and what was given. ``TypeError``
means a wrong type or dtype; ``ValueError`` a wrong shape, layout or value.
Nothing here writes to any tensor, so a refused call leaves the cache as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .quant import ScaleGranularity, scale_shape
from .reference import MASKS, SCORE_MODS

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPE = torch.float8_e4m3fn


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


def check_tensor(
    name: str,
    t: object,
    *,
    rank: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
) -> torch.Tensor:
    """Type, dtype, rank, contiguity and device of one tensor argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {expected}, got {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected a rank-{rank} tensor, got shape {_shape(t)}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor (call .contiguous()), got strides {t.stride()}"
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
        shown = tuple("*" if e is None else e for e in expected)
        raise ValueError(f"{name}: expected shape {shown} ({what}), got {got}")


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
    mask: str,
    score_mod: str,
    local_window_size: int,
    check_values: bool = True,
) -> Dims:
    """Checks every argument of the op; with ``check_values`` also the values it indexes with.

    ``check_values=False`` checks only metadata (what torch's fake tensors
    have), for tracing.
    """
    if mask not in MASKS:
        raise ValueError(f"mask: expected one of {MASKS}, got {mask!r}")
    if score_mod not in SCORE_MODS:
        raise ValueError(f"score_mod: expected one of {SCORE_MODS}, got {score_mod!r}")
    if mask in ("sliding_window_causal", "chunked_causal") and local_window_size < 1:
        raise ValueError(
            f"local_window_size: expected >= 1 for mask {mask!r}, got {local_window_size}"
        )
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale}")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon: expected a finite float >= 0, got {epsilon}")

    check_tensor("q", q, rank=3, dtypes=ACTIVATION_DTYPES)
    dev, dtype = q.device, q.dtype
    num_tokens, num_heads, q_head_dim = _shape(q)
    check_tensor("w_uk", w_uk, rank=3, dtypes=(FP8_DTYPE,), device=dev)
    _, kv_lora_rank, nope_dim = _shape(w_uk)
    check_shape(
        "w_uk", w_uk, (num_heads, None, None), "[num_heads of q, kv_lora_rank, qk_nope_head_dim]"
    )
    rope_dim = q_head_dim - nope_dim
    if rope_dim < 2 or rope_dim % 2:
        raise ValueError(
            f"q: last dim {q_head_dim} minus w_uk's qk_nope_head_dim {nope_dim} gives "
            f"qk_rope_head_dim {rope_dim}; expected an even number >= 2"
        )
    check_tensor("w_uv", w_uv, rank=3, dtypes=(FP8_DTYPE,), device=dev)
    v_head_dim = w_uv.shape[1]
    check_shape(
        "w_uv",
        w_uv,
        (num_heads, None, kv_lora_rank),
        "[num_heads of q, v_head_dim, kv_lora_rank of w_uk]",
    )
    g = scale_granularity
    for name, scales, n, k in (
        ("w_uk_scale", w_uk_scale, kv_lora_rank, nope_dim),
        ("w_uv_scale", w_uv_scale, v_head_dim, kv_lora_rank),
    ):
        check_tensor(name, scales, rank=3, dtypes=(torch.float32,), device=dev)
        check_shape(
            name, scales, scale_shape(num_heads, n, k, g.n, g.k), f"scale granularity {tuple(g)}"
        )
    check_tensor("out", out, rank=3, dtypes=(dtype,), device=dev)
    check_shape(
        "out", out, (num_tokens, num_heads, v_head_dim), "[tot_seq_len, num_heads, v_head_dim]"
    )
    check_tensor("freqs_cis", freqs_cis, rank=2, dtypes=(dtype,), device=dev)
    check_shape("freqs_cis", freqs_cis, (None, rope_dim), "[max_seq_len, qk_rope_head_dim]")
    check_tensor("kv_norm_gamma", kv_norm_gamma, rank=1, dtypes=(dtype,), device=dev)
    check_shape("kv_norm_gamma", kv_norm_gamma, (kv_lora_rank,), "[kv_lora_rank]")
    check_tensor("kv_blocks", kv_blocks, rank=6, dtypes=(dtype,), device=dev)
    check_shape(
        "kv_blocks",
        kv_blocks,
        (None, 1, None, None, 1, kv_lora_rank + rope_dim),
        "[num_blocks, 1, num_layers, page_size, 1, kv_lora_rank + qk_rope_head_dim]",
    )
    num_blocks, _, num_layers, page_size, _, _ = _shape(kv_blocks)
    check_tensor("input_row_offsets", input_row_offsets, rank=1, dtypes=(torch.uint32,), device=dev)
    num_requests = input_row_offsets.shape[0] - 1
    if num_requests < 0:
        raise ValueError(
            "input_row_offsets: expected shape [num_requests + 1], got an empty tensor"
        )
    check_tensor("cache_lengths", cache_lengths, rank=1, dtypes=(torch.uint32,), device=dev)
    check_shape("cache_lengths", cache_lengths, (num_requests,), "[num_requests]")
    check_tensor("lookup_table", lookup_table, rank=2, dtypes=(torch.uint32,), device=dev)
    check_shape(
        "lookup_table", lookup_table, (num_requests, None), "[num_requests, pages_per_request]"
    )
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
        raise TypeError(f"layer_idx: expected an int, got {type(layer_idx).__name__}")
    if not 0 <= layer_idx < num_layers:
        raise ValueError(
            f"layer_idx: expected 0 <= layer_idx < {num_layers} (kv_blocks' num_layers), got {layer_idx}"
        )

    if check_values:
        _check_values(
            input_row_offsets,
            cache_lengths,
            lookup_table,
            w_uk_scale,
            w_uv_scale,
            num_tokens=num_tokens,
            max_seq_len=freqs_cis.shape[0],
            num_blocks=num_blocks,
            page_size=page_size,
        )
    return Dims(num_tokens, num_requests, num_heads, nope_dim, rope_dim, kv_lora_rank, v_head_dim)


def _check_values(
    input_row_offsets: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    w_uk_scale: torch.Tensor,
    w_uv_scale: torch.Tensor,
    *,
    num_tokens: int,
    max_seq_len: int,
    num_blocks: int,
    page_size: int,
) -> None:
    for name, scales in (("w_uk_scale", w_uk_scale), ("w_uv_scale", w_uv_scale)):
        if not bool(torch.isfinite(scales).all()):
            bad = scales[~torch.isfinite(scales)][0].item()
            raise ValueError(f"{name}: expected finite scales, found {bad}")
    offsets = input_row_offsets.to(torch.int64).cpu()
    if int(offsets[0]) != 0:
        raise ValueError(f"input_row_offsets: expected to start at 0, got {int(offsets[0])}")
    steps = offsets[1:] - offsets[:-1]
    if bool((steps < 0).any()):
        b = int(torch.nonzero(steps < 0)[0])
        raise ValueError(
            f"input_row_offsets: expected non-decreasing values, got {int(offsets[b])} then {int(offsets[b + 1])} at request {b}"
        )
    if int(offsets[-1]) != num_tokens:
        raise ValueError(
            f"input_row_offsets: expected to end at tot_seq_len = {num_tokens} (q's first dim), got {int(offsets[-1])}"
        )
    if steps.numel() == 0:
        return
    ends = cache_lengths.to(torch.int64).cpu() + steps  # one past each request's last position
    worst = int(torch.argmax(ends))
    if int(ends[worst]) > max_seq_len:
        raise ValueError(
            f"cache_lengths: request {worst} has {int(ends[worst]) - int(steps[worst])} cached + "
            f"{int(steps[worst])} new tokens = {int(ends[worst])} positions, past freqs_cis' {max_seq_len} rows"
        )
    pages_needed = (ends + page_size - 1) // page_size
    capacity = lookup_table.shape[1]
    if int(pages_needed.max()) > capacity:
        b = int(torch.argmax(pages_needed))
        raise ValueError(
            f"lookup_table: request {b} needs {int(pages_needed[b])} pages of {page_size} tokens for "
            f"{int(ends[b])} positions, but lookup_table has {capacity} per request"
        )
    table = lookup_table.to(torch.int64).cpu()
    used = torch.arange(capacity)[None, :] < pages_needed[:, None]
    outside = used & (table >= num_blocks)
    if bool(outside.any()):
        b, p = (int(v) for v in torch.nonzero(outside)[0])
        raise ValueError(
            f"lookup_table: entry [{b}, {p}] = {int(table[b, p])} is outside kv_blocks' {num_blocks} blocks"
        )
