"""Bad input: a clear error before any kernel runs, and nothing lost.

Every refused call must raise ``TypeError`` (wrong type or dtype) or
``ValueError`` (wrong shape, layout, device or value) whose message names the
argument, what was expected and what was given, and must leave every byte of
the cache (and of every other argument) as it was. The kernel is replaced by
a tripwire in these tests, so a check that lets bad input through fails
loudly instead of reaching the kernel.

Zero requests and zero-token requests are not errors: they have a defined
result (an empty output; a skipped request).
"""

from __future__ import annotations

import contextlib
import copy
import re
from unittest import mock

import pytest
import torch
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import pymla
from pymla.args import MASKS, SCORE_MODS, KVCacheTensors
from pymla.cache import UNUSED_PAGE
from pymla.parity import compare_output
from pymla.reference import mla_decode_branch_fp8_reference

from helpers import check_parity, make_case, torch_op_args

TENSOR_ARGS = (
    "q",
    "input_row_offsets",
    "freqs_cis",
    "kv_norm_gamma",
    "w_uk",
    "w_uk_scale",
    "w_uv",
    "w_uv_scale",
)
CACHE_PARTS = ("kv_blocks", "cache_lengths", "lookup_table")
ALL_TENSORS = (*TENSOR_ARGS, *CACHE_PARTS)


def small_case(seed: int = 0, **kw):
    """2 heads, pages of 4, requests with 5 and 9 cached + 1 and 2 new tokens, 2 layers.

    Blocks [12, 1, 2, 4, 1, 576]; lookup_table [[8, 0, unused], [5, 9, 7]];
    freqs_cis 18 rows; blockwise scales w_uk_scale [2, 4, 1], w_uv_scale [2, 1, 4].
    """
    params = dict(
        num_heads=2,
        page_size=4,
        cache_lengths=(5, 9),
        new_tokens=(1, 2),
        num_layers=2,
        layer_idx=1,
    )
    params.update(kw)
    return make_case(seed, **params)


class Call:
    """The arguments of one op call, each replaceable by name.

    Cache parts (``kv_blocks``, ``cache_lengths``, ``lookup_table``) are
    passed as a tuple once one of them is replaced; ``kv_blocks`` stays the
    case's own blocks tensor unless replaced.
    """

    def __init__(self, case, *, with_out: bool = False) -> None:
        self.case = case
        w = case.weights
        self.args = {
            "q": case.q,
            "input_row_offsets": case.input_row_offsets,
            "freqs_cis": case.freqs_cis,
            "kv_norm_gamma": case.kv_norm_gamma,
            "layer_idx": case.layer_idx,
            "w_uk": w["w_uk"],
            "w_uk_scale": w["w_uk_scale"],
            "w_uv": w["w_uv"],
            "w_uv_scale": w["w_uv_scale"],
            **case.options,
        }
        self.parts: dict[str, torch.Tensor] | None = None
        self.cache: object = case.cache
        self.out = None
        if with_out:
            self.ensure_out()

    def get(self, name: str):
        if name in CACHE_PARTS:
            return self.parts[name] if self.parts else self._cache_part(name)
        if name == "out":
            return self.out
        return self.args[name]

    def _cache_part(self, name: str) -> torch.Tensor:
        kv = self.case.cache_tensors()
        return {"kv_blocks": kv.blocks, "cache_lengths": kv.cache_lengths}.get(
            name, kv.lookup_table
        )

    def set(self, name: str, value) -> Call:
        if name in CACHE_PARTS:
            if self.parts is None:
                self.parts = {p: self._cache_part(p) for p in CACHE_PARTS}
            self.parts[name] = value
            self.cache = KVCacheTensors(*(self.parts[p] for p in CACHE_PARTS))
        elif name == "out":
            self.out = value
        elif name == "cache":
            self.cache = value
        else:
            self.args[name] = value
        return self

    def ensure_out(self) -> None:
        if self.out is None:
            q, w_uv = self.case.q, self.case.weights["w_uv"]
            self.out = torch.full(
                (q.shape[0], q.shape[1], w_uv.shape[1]), float("nan"), dtype=q.dtype
            )

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the call receives, the case's cache blocks included."""
        found = [self.get(n) for n in (*ALL_TENSORS, "out")] + [self.case.cache.blocks]
        return [t for t in found if isinstance(t, torch.Tensor) and t.device.type != "meta"]

    def run(self) -> torch.Tensor:
        return pymla.mla_decode_branch_fp8(cache=self.cache, out=self.out, **self.args)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone() if t.dim() else t.clone()


@contextlib.contextmanager
def no_kernel():
    """Fails the test if the compiled MAX model is ever asked for."""

    def tripwire(*_args, **_kwargs):
        raise AssertionError("the kernel was reached: validation let bad input through")

    with mock.patch("pymla.runtime.compiled_model", tripwire):
        yield


def assert_refused(call: Call, error, pattern: str | None) -> Exception:
    """The call raises ``error`` matching ``pattern``; no tensor, above all no cache byte, changed."""
    tensors = call.tensors()
    before = [_bytes(t) for t in tensors]
    blocks_before = call.case.cache.blocks.view(torch.uint8).clone()
    with no_kernel(), pytest.raises(error, match=pattern) as info:
        call.run()
    assert torch.equal(call.case.cache.blocks.view(torch.uint8), blocks_before), "cache changed"
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(_bytes(t), b), "an argument changed"
    return info.value


def exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Same shape, dtype and values, with a stride gap in the last dim of size > 1."""
    dim = max(d for d in range(t.dim()) if t.shape[d] > 1)
    shape = list(t.shape)
    shape[dim] *= 2
    buf = torch.zeros(shape, dtype=t.dtype)
    view = buf[(slice(None),) * dim + (slice(None, None, 2),)]
    view.copy_(t)
    assert not view.is_contiguous()
    return view


# ---------------------------------------------------------------- rank, dtype, layout

RANKS = {
    "q": 3,
    "input_row_offsets": 1,
    "freqs_cis": 2,
    "kv_norm_gamma": 1,
    "w_uk": 3,
    "w_uk_scale": 3,
    "w_uv": 3,
    "w_uv_scale": 3,
    "kv_blocks": 6,
    "cache_lengths": 1,
    "lookup_table": 2,
    "out": 3,
}


@pytest.mark.parametrize("name", list(RANKS))
@pytest.mark.parametrize("change", ["extra_dim", "missing_dim"])
def test_wrong_rank(name, change):
    call = Call(small_case(), with_out=True)
    t = call.get(name)
    if change == "extra_dim":
        bad = t.unsqueeze(0)
    elif t.dim() == 1:
        bad = t[0]  # rank 0
    else:
        bad = t.reshape(t.shape[0], -1) if t.dim() > 2 else t.reshape(-1)
    call.set(name, bad)
    assert_refused(
        call,
        ValueError,
        exact(f"{name}: expected a rank-{RANKS[name]} tensor, got shape {tuple(bad.shape)}"),
    )


ACT = "torch.bfloat16 or torch.float16 or torch.float32"
WRONG_DTYPES = [
    ("q", torch.float64, ACT),
    ("q", torch.int32, ACT),
    ("freqs_cis", torch.float64, ACT),
    ("kv_norm_gamma", torch.int64, ACT),
    ("kv_blocks", torch.float8_e4m3fn, f"{ACT} or torch.uint8 (fp8_ds_mla rows)"),
    ("input_row_offsets", torch.int64, "torch.uint32"),
    ("input_row_offsets", torch.int32, "torch.uint32"),
    ("cache_lengths", torch.int64, "torch.uint32"),
    ("lookup_table", torch.int32, "torch.uint32"),
    ("w_uk", torch.bfloat16, "torch.float8_e4m3fn"),
    ("w_uk", torch.uint8, "torch.float8_e4m3fn"),
    ("w_uv", torch.float8_e5m2, "torch.float8_e4m3fn"),
    ("w_uk_scale", torch.bfloat16, "torch.float32"),
    ("w_uv_scale", torch.float64, "torch.float32"),
    ("out", torch.float32, "torch.bfloat16 (q's dtype)"),
]


@pytest.mark.parametrize(
    ("name", "dtype", "expected"), WRONG_DTYPES, ids=[f"{n}-{d}" for n, d, _ in WRONG_DTYPES]
)
def test_wrong_dtype(name, dtype, expected):
    call = Call(small_case(), with_out=True)
    call.set(name, call.get(name).to(dtype))
    assert_refused(call, TypeError, exact(f"{name}: expected dtype {expected}, got {dtype}"))


MIXED_ACTIVATIONS = [
    ("q", torch.float32, "freqs_cis, kv_norm_gamma and kv_blocks"),
    ("freqs_cis", torch.float32, "q, kv_norm_gamma and kv_blocks"),
    ("kv_norm_gamma", torch.float16, "q, freqs_cis and kv_blocks"),
    ("kv_blocks", torch.float16, "q, freqs_cis and kv_norm_gamma"),
]


@pytest.mark.parametrize(("name", "dtype", "peers"), MIXED_ACTIVATIONS)
def test_activation_dtypes_must_agree(name, dtype, peers):
    """The odd one out among q, freqs_cis, kv_norm_gamma and the cache is named."""
    call = Call(small_case())
    call.set(name, call.get(name).to(dtype))
    assert_refused(
        call, TypeError, exact(f"{name}: expected dtype torch.bfloat16 (as {peers}), got {dtype}")
    )


@pytest.mark.parametrize("name", [*ALL_TENSORS, "out"])
def test_non_contiguous(name):
    call = Call(small_case(), with_out=True)
    bad = non_contiguous(call.get(name))
    call.set(name, bad)
    assert_refused(
        call,
        ValueError,
        exact(
            f"{name}: expected a contiguous tensor (call .contiguous()), got strides "
            f"{bad.stride()} for shape {tuple(bad.shape)}"
        ),
    )


@pytest.mark.parametrize("name", [*TENSOR_ARGS, "out"])
@pytest.mark.parametrize("value", [None, [1, 2], 3.0], ids=["None", "list", "float"])
def test_not_a_tensor(name, value):
    if name == "out" and value is None:
        return  # out=None is the default: the op allocates the output
    call = Call(small_case()).set(name, value)
    expected = "a torch.Tensor or None" if name == "out" else "a torch.Tensor"
    assert_refused(
        call, TypeError, exact(f"{name}: expected {expected}, got {type(value).__name__}")
    )


@pytest.mark.parametrize(
    ("cache", "got"),
    [
        ([1, 2, 3], "got list"),
        (None, "got NoneType"),
        ((1, 2), "got tuple"),
    ],
)
def test_cache_not_a_cache(cache, got):
    call = Call(small_case()).set("cache", cache)
    assert_refused(
        call,
        TypeError,
        exact(
            "cache: expected a PagedLatentCache or a (blocks, cache_lengths, lookup_table) "
            f"tuple, {got}"
        ),
    )


def test_cache_tuple_of_non_tensors():
    case = small_case()
    call = Call(case).set("cache", (case.cache.blocks, [5, 9], case.cache.lookup_table))
    assert_refused(
        call,
        TypeError,
        exact(
            "cache: expected a (blocks, cache_lengths, lookup_table) tuple of tensors, "
            "got (Tensor, list, Tensor)"
        ),
    )


@pytest.mark.parametrize("name", ["q", "w_uk", "w_uv_scale", "kv_blocks", "lookup_table", "out"])
def test_wrong_device(name):
    """A tensor away from the others (meta stands in for another device on a CPU-only host)."""
    call = Call(small_case(), with_out=True)
    call.set(name, call.get(name).to("meta"))
    if name == "out":
        pattern = exact("out: expected a tensor on cpu (where q is), got meta")
    else:
        pattern = rf"^{name}: expected a tensor on cpu \(as \w+ and 9 other inputs\), got meta$"
    assert_refused(call, ValueError, pattern)


# ---------------------------------------------------------------- sizes shared between arguments


def _shrink(t: torch.Tensor, dim: int, by: int) -> torch.Tensor:
    return t.narrow(dim, 0, t.shape[dim] - by).contiguous()


def _grow(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat([t, t.narrow(dim, 0, 1)], dim=dim)


SIZE_MISMATCHES = [
    # (argument, how it changes, message)
    (
        "q",
        lambda t: _shrink(t, 1, 1),
        "q: expected size 2 in dim 1 (num_heads 2, as in w_uk and w_uv), got 1 (shape (3, 1, 192))",
    ),
    (
        "w_uk",
        lambda t: _grow(t, 0),
        "w_uk: expected size 2 in dim 0 (num_heads 2, as in q and w_uv), got 3 (shape (3, 512, 128))",
    ),
    (
        "w_uv",
        lambda t: _shrink(t, 0, 1),
        "w_uv: expected size 2 in dim 0 (num_heads 2, as in q and w_uk), got 1 (shape (1, 128, 512))",
    ),
    (
        "w_uk",
        lambda t: _shrink(t, 1, 256),
        "w_uk: expected size 512 in dim 1 (kv_lora_rank 512, as in w_uv and kv_norm_gamma), "
        "got 256 (shape (2, 256, 128))",
    ),
    (
        "w_uv",
        lambda t: _shrink(t, 2, 2),
        "w_uv: expected size 512 in dim 2 (kv_lora_rank 512, as in w_uk and kv_norm_gamma), "
        "got 510 (shape (2, 128, 510))",
    ),
    (
        "kv_norm_gamma",
        lambda t: _grow(t, 0),
        "kv_norm_gamma: expected size 512 in dim 0 (kv_lora_rank 512, as in w_uk and w_uv), "
        "got 513 (shape (513,))",
    ),
    (
        "freqs_cis",
        lambda t: _shrink(t, 1, 32),
        "freqs_cis: expected size 64 in dim 1 (qk_rope_head_dim 64, as in kv_blocks and q), "
        "got 32 (shape (18, 32))",
    ),
    (
        "kv_blocks",
        lambda t: _shrink(t, 5, 2),
        "kv_blocks: expected size 576 in dim 5 (kv_lora_rank 512 + qk_rope_head_dim 64, "
        "as in freqs_cis and q), got 574 (shape (12, 1, 2, 4, 1, 574))",
    ),
    (
        "q",
        lambda t: _shrink(t, 2, 2),
        "q: expected size 192 in dim 2 (w_uk's qk_nope_head_dim 128 + qk_rope_head_dim 64, "
        "as in freqs_cis and kv_blocks), got 190 (shape (3, 2, 190))",
    ),
    (
        # With only q to compare against, a wrong qk_nope_head_dim in w_uk shows up
        # as a q whose last dim does not fit; the message names both.
        "w_uk",
        lambda t: _shrink(t, 2, 64),
        "q: expected size 128 in dim 2 (w_uk's qk_nope_head_dim 64 + qk_rope_head_dim 64, "
        "as in freqs_cis and kv_blocks), got 192 (shape (3, 2, 192))",
    ),
    (
        "w_uk_scale",
        lambda t: _grow(t, 0),
        "w_uk_scale: expected shape (2, 4, 1) ([num_heads 2, ceil(kv_lora_rank 512 / 128), "
        "ceil(qk_nope_head_dim 128 / 128)] for scale_granularity (1, 128, 128)), got (3, 4, 1)",
    ),
    (
        "w_uv_scale",
        lambda t: _shrink(t, 2, 1),
        "w_uv_scale: expected shape (2, 1, 4) ([num_heads 2, ceil(v_head_dim 128 / 128), "
        "ceil(kv_lora_rank 512 / 128)] for scale_granularity (1, 128, 128)), got (2, 1, 3)",
    ),
    (
        "out",
        lambda t: _shrink(t, 2, 1),
        "out: expected shape (3, 2, 128) ([tot_seq_len of q, num_heads, v_head_dim of w_uv]), "
        "got (3, 2, 127)",
    ),
    (
        "out",
        lambda t: _grow(t, 0),
        "out: expected shape (3, 2, 128) ([tot_seq_len of q, num_heads, v_head_dim of w_uv]), "
        "got (4, 2, 128)",
    ),
    (
        "kv_blocks",
        lambda t: _grow(t, 1),
        "kv_blocks: expected shape (*, 1, *, *, 1, 576) ([num_blocks, 1, num_layers, page_size, 1, "
        "kv_lora_rank + qk_rope_head_dim]), got (12, 2, 2, 4, 1, 576)",
    ),
    (
        "kv_blocks",
        lambda t: _shrink(t, 3, 4),
        "kv_blocks: expected page_size >= 1 in dim 3, got 0 (shape (12, 1, 2, 0, 1, 576))",
    ),
    (
        "input_row_offsets",
        lambda t: t[:-1],
        "input_row_offsets: expected size 3 in dim 0 (num_requests 2 + 1, as in cache_lengths "
        "and lookup_table), got 2 (shape (2,))",
    ),
    (
        "input_row_offsets",
        lambda t: t[:0],
        "input_row_offsets: expected size 3 in dim 0 (num_requests 2 + 1, as in cache_lengths "
        "and lookup_table), got 0 (shape (0,))",
    ),
    (
        "cache_lengths",
        lambda t: _grow(t, 0),
        "cache_lengths: expected size 2 in dim 0 (num_requests 2, as in input_row_offsets and "
        "lookup_table), got 3 (shape (3,))",
    ),
    (
        "lookup_table",
        lambda t: _shrink(t, 0, 1),
        "lookup_table: expected size 2 in dim 0 (num_requests 2, as in input_row_offsets and "
        "cache_lengths), got 1 (shape (1, 3))",
    ),
]


@pytest.mark.parametrize(
    ("name", "change", "message"),
    SIZE_MISMATCHES,
    ids=[f"{i}-{n}" for i, (n, _, _) in enumerate(SIZE_MISMATCHES)],
)
def test_inconsistent_sizes(name, change, message):
    """Heads and dims of q, w_uk, w_uv, the scales, the cache and out must fit together."""
    call = Call(small_case(), with_out=True)
    call.set(name, change(call.get(name)))
    assert_refused(call, ValueError, exact(message))


def test_odd_rope_dim():
    """q, freqs_cis and the cache agree on a rope dim of 63, which RoPE's pairs cannot take."""
    call = Call(small_case())
    call.set("q", _shrink(call.get("q"), 2, 1))
    call.set("freqs_cis", _shrink(call.get("freqs_cis"), 1, 1))
    call.set("kv_blocks", _shrink(call.get("kv_blocks"), 5, 1))
    assert_refused(
        call,
        ValueError,
        exact(
            "freqs_cis: expected an even qk_rope_head_dim >= 2 in dim 1 (q's dim 2 minus w_uk's "
            "qk_nope_head_dim 128), got 63 (shape (18, 63))"
        ),
    )


def test_zero_heads():
    call = Call(small_case())
    for name, dim in (("q", 1), ("w_uk", 0), ("w_uv", 0), ("w_uk_scale", 0), ("w_uv_scale", 0)):
        call.set(name, call.get(name).narrow(dim, 0, 0).contiguous())
    assert_refused(
        call,
        ValueError,
        exact("q: expected num_heads >= 1 in dim 1, got 0 (shape (3, 0, 192))"),
    )


# ---------------------------------------------------------------- scale granularity

GRANULARITY_MISMATCHES = [
    (
        "blockwise",
        "per_channel",
        "w_uk_scale: expected shape (2, 512, 1) ([num_heads 2, ceil(kv_lora_rank 512 / 1), "
        "1 (whole qk_nope_head_dim 128)] for scale_granularity (1, 1, 0)), got (2, 4, 1); "
        "that shape fits scale_granularity 'blockwise' (1, 128, 128)",
    ),
    (
        "per_tensor",
        "blockwise",
        "w_uk_scale: expected shape (2, 4, 1) ([num_heads 2, ceil(kv_lora_rank 512 / 128), "
        "ceil(qk_nope_head_dim 128 / 128)] for scale_granularity (1, 128, 128)), got (2, 1, 1); "
        "that shape fits scale_granularity 'per_tensor' (0, 0, 0)",
    ),
    (
        "per_channel",
        (1, 64, 64),
        "w_uk_scale: expected shape (2, 8, 2) ([num_heads 2, ceil(kv_lora_rank 512 / 64), "
        "ceil(qk_nope_head_dim 128 / 64)] for scale_granularity (1, 64, 64)), got (2, 512, 1); "
        "that shape fits scale_granularity 'per_channel' (1, 1, 0)",
    ),
]


@pytest.mark.parametrize(("made_with", "called_with", "message"), GRANULARITY_MISMATCHES)
def test_scales_do_not_fit_granularity(made_with, called_with, message):
    call = Call(small_case(granularity=made_with)).set("scale_granularity", called_with)
    assert_refused(call, ValueError, exact(message))


def test_one_scale_tensor_of_another_granularity():
    """w_uv_scale from per-channel weights next to blockwise w_uk_scale."""
    call = Call(small_case())
    other = small_case(granularity="per_channel")
    call.set("w_uv_scale", other.weights["w_uv_scale"])
    assert_refused(
        call,
        ValueError,
        exact(
            "w_uv_scale: expected shape (2, 1, 4) ([num_heads 2, ceil(v_head_dim 128 / 128), "
            "ceil(kv_lora_rank 512 / 128)] for scale_granularity (1, 128, 128)), got (2, 128, 1); "
            "that shape fits scale_granularity 'per_channel' (1, 1, 0)"
        ),
    )


PRESET_LIST = "['blockwise', 'per_channel', 'per_tensor']"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "blockwize",
            f"scale_granularity: expected a preset name, one of {PRESET_LIST}, "
            "or an (m, n, k) triple of ints, got 'blockwize'",
        ),
        (
            (1, 128),
            "scale_granularity: expected a preset name or an (m, n, k) triple of ints, got (1, 128)",
        ),
        (
            (1, 128, 128, 1),
            "scale_granularity: expected a preset name or an (m, n, k) triple of ints, "
            "got (1, 128, 128, 1)",
        ),
        (
            (1.5, 128, 128),
            "scale_granularity: expected a preset name or an (m, n, k) triple of ints, "
            "got (1.5, 128, 128)",
        ),
        (
            (True, 1, 0),
            "scale_granularity: expected a preset name or an (m, n, k) triple of ints, "
            "got (True, 1, 0)",
        ),
        (
            None,
            "scale_granularity: expected a preset name or an (m, n, k) triple of ints, got None",
        ),
        (
            (-1, 128, 128),
            "scale_granularity: expected values >= 0 (0 = whole axis), got (-1, 128, 128)",
        ),
        (
            (1, 2**31, 128),
            "scale_granularity: expected an (m, n, k) triple of ints in [0, 2**31), "
            "got (1, 2147483648, 128)",
        ),
    ],
    ids=["unknown", "short", "long", "float", "bool", "None", "negative", "int32"],
)
def test_invalid_scale_granularity(value, message):
    call = Call(small_case()).set("scale_granularity", value)
    assert_refused(call, ValueError, exact(message))


# ---------------------------------------------------------------- input_row_offsets


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([1, 1, 3], "input_row_offsets: expected to start at 0, got 1"),
        (
            [0, 4, 3],
            "input_row_offsets: expected non-decreasing values, got 4 then 3 at request 1",
        ),
        (
            [0, 2, 1],
            "input_row_offsets: expected non-decreasing values, got 2 then 1 at request 1",
        ),
        (
            [0, 1, 2],
            "input_row_offsets: expected to end at tot_seq_len = 3 (q's dim 0), got 2",
        ),
        (
            [0, 1, 4],
            "input_row_offsets: expected to end at tot_seq_len = 3 (q's dim 0), got 4",
        ),
    ],
    ids=["start", "decreasing-past-end", "decreasing", "short-end", "long-end"],
)
@pytest.mark.parametrize("cache_kind", ["paged", "tuple"])
def test_bad_row_offsets(offsets, message, cache_kind):
    call = Call(small_case())
    if cache_kind == "tuple":
        call.set("cache", call.case.cache_tensors())
    call.set("input_row_offsets", torch.tensor(offsets, dtype=torch.uint32))
    assert_refused(call, ValueError, exact(message))


def test_offsets_disagree_with_the_rows_appended_to_the_cache():
    """The PagedLatentCache knows how many rows each request appended: 1 and 2, not 2 and 1."""
    call = Call(small_case()).set("input_row_offsets", torch.tensor([0, 2, 3], dtype=torch.uint32))
    assert_refused(
        call,
        ValueError,
        exact(
            "input_row_offsets: expected 1 new token for request 0 (the rows appended to the "
            "cache since its last advance()), got 2"
        ),
    )


# ---------------------------------------------------------------- positions, pages, lookup table


def _with_cache_lengths(call: Call, lengths) -> Call:
    return call.set("cache_lengths", torch.tensor(lengths, dtype=torch.uint32))


def test_positions_past_freqs_cis():
    call = Call(small_case())
    call.set("freqs_cis", call.get("freqs_cis")[:10])
    assert_refused(
        call,
        ValueError,
        exact(
            "cache_lengths: expected cached + new tokens <= 10 (freqs_cis' rows), "
            "got 9 + 2 = 11 for request 1"
        ),
    )


def test_positions_past_the_lookup_table():
    call = _with_cache_lengths(Call(small_case()), [5, 14])
    assert_refused(
        call,
        ValueError,
        exact(
            "lookup_table: expected >= 4 pages per request (request 1 has 14 cached + 2 new "
            "tokens in pages of 4), got shape (2, 3) (were its new rows appended to the cache?)"
        ),
    )


def test_positions_past_the_pages_a_request_owns():
    """Request 0 owns 2 pages; 8 cached + 1 new tokens need a third (an unused-page entry)."""
    call = _with_cache_lengths(Call(small_case()), [8, 9])
    assert_refused(
        call,
        ValueError,
        exact(
            "lookup_table: expected a page at [0, 2] (request 0 has 8 cached + 1 new tokens in "
            "pages of 4), got the unused-page marker 0xffffffff: the request owns only 2 pages "
            "(were its new rows appended to the cache?)"
        ),
    )


def test_new_token_not_appended_to_the_cache():
    """A step that forgot ``cache.append``: the new token's position has no page yet."""
    cache = pymla.PagedLatentCache(num_blocks=4, page_size=4, num_layers=1)
    b = cache.add_request()
    cache.fill(b, 8, generator=torch.Generator().manual_seed(0))
    case = small_case(num_layers=1, layer_idx=0)
    case.cache = cache
    case.q = case.q[:1].contiguous()
    case.input_row_offsets = torch.tensor([0, 1], dtype=torch.uint32)
    assert_refused(
        Call(case),
        ValueError,
        exact(
            "lookup_table: expected >= 3 pages per request (request 0 has 8 cached + 1 new tokens "
            "in pages of 4), got shape (1, 2) (were its new rows appended to the cache?)"
        ),
    )


@pytest.mark.parametrize("entry", [12, 1000, UNUSED_PAGE - 1])
def test_lookup_entry_outside_the_cache(entry):
    call = Call(small_case())
    table = call.get("lookup_table").clone()
    table[1, 0] = entry
    call.set("lookup_table", table)
    assert_refused(
        call,
        ValueError,
        exact(
            f"lookup_table: expected entries < 12 (kv_blocks' num_blocks), got {entry} at [1, 0]"
        ),
    )


def test_unused_lookup_entries_are_ignored():
    """Entries past the pages a request needs may hold anything: the op never reads them."""
    case = small_case()
    table = case.cache.lookup_table.clone()
    table[0, 2] = 12345
    check_parity_with_table(case, table)


def check_parity_with_table(case, table: torch.Tensor) -> None:
    """Op vs reference on the case's cache with another lookup table."""
    kv = KVCacheTensors(case.cache.blocks.clone(), case.cache.cache_lengths, table)
    ref = mla_decode_branch_fp8_reference(*case.args(cache=kv), **case.options)
    kv_op = KVCacheTensors(case.cache.blocks, case.cache.cache_lengths, table)
    out = pymla.mla_decode_branch_fp8(*case.args(cache=kv_op), **case.options)
    report = compare_output(out, ref)
    assert report.passed, report.describe()
    assert torch.equal(case.cache.blocks, kv.blocks)


def test_new_tokens_sharing_a_cache_row():
    """Two requests whose new tokens map to the same row would both rewrite it in place."""
    call = Call(small_case())
    table = call.get("lookup_table").clone()
    table[1, 2] = table[0, 1]  # request 1's position 9 -> request 0's block, row 1 (position 5)
    call.set("lookup_table", table)
    assert_refused(
        call,
        ValueError,
        exact(
            "lookup_table: expected a cache row of its own for each new token, got request 0 "
            f"position 5 and request 1 position 9 both in block {int(table[0, 1])} row 1"
        ),
    )


def test_shared_cached_pages_are_allowed():
    """Requests may share pages of cached tokens (a common prefix); only new rows must be their own."""
    case = small_case(cache_lengths=(8, 9), new_tokens=(1, 2))
    table = case.cache.lookup_table.clone()
    table[1, 0] = table[0, 0]  # positions 0..3 of both requests: the same cached rows
    check_parity_with_table(case, table)


# ---------------------------------------------------------------- layer, scales' values, options


@pytest.mark.parametrize("layer_idx", [2, 7, -1])
def test_layer_idx_out_of_range(layer_idx):
    call = Call(small_case()).set("layer_idx", layer_idx)
    assert_refused(
        call,
        ValueError,
        exact(f"layer_idx: expected 0 <= layer_idx < 2 (kv_blocks' num_layers), got {layer_idx}"),
    )


@pytest.mark.parametrize("value", [1.0, "1", None, True], ids=["float", "str", "None", "bool"])
def test_layer_idx_not_an_int(value):
    call = Call(small_case()).set("layer_idx", value)
    assert_refused(
        call, TypeError, exact(f"layer_idx: expected an int, got {type(value).__name__}")
    )


@pytest.mark.parametrize("name", ["w_uk_scale", "w_uv_scale"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_scales(name, bad):
    call = Call(small_case())
    scales = call.get(name).clone()
    index = (1, 0, 0)
    scales[index] = bad
    call.set(name, scales)
    assert_refused(
        call, ValueError, exact(f"{name}: expected finite scales, got {bad} at [1, 0, 0]")
    )


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    [
        ("mask", "casual", ValueError, f"mask: expected one of {MASKS} (any case), got 'casual'"),
        ("mask", "", ValueError, f"mask: expected one of {MASKS} (any case), got ''"),
        ("mask", 1, TypeError, f"mask: expected a str, one of {MASKS}, got int"),
        ("mask", pymla.ScoreMod.NO_POS, TypeError, f"mask: expected a str, one of {MASKS}, got ScoreMod"),
        ("score_mod", "alibi", ValueError, f"score_mod: expected one of {SCORE_MODS} (any case), got 'alibi'"),
        ("score_mod", None, TypeError, f"score_mod: expected a str, one of {SCORE_MODS}, got NoneType"),
        ("scale", float("nan"), ValueError, "scale: expected a finite float32 value > 0, got nan"),
        ("scale", float("inf"), ValueError, "scale: expected a finite float32 value > 0, got inf"),
        ("scale", 1e39, ValueError, "scale: expected a finite float32 value > 0, got 1e+39"),
        ("scale", -1, ValueError, "scale: expected a finite float32 value > 0, got -1.0"),
        ("scale", 0.0, ValueError, "scale: expected a finite float32 value > 0, got 0.0"),
        ("scale", -0.07, ValueError, "scale: expected a finite float32 value > 0, got -0.07"),
        ("scale", "0.1", TypeError, "scale: expected a float, got str"),
        ("scale", None, TypeError, "scale: expected a float, got NoneType"),
        ("epsilon", -1e-6, ValueError, "epsilon: expected a finite float32 value >= 0, got -1e-06"),
        ("epsilon", float("nan"), ValueError, "epsilon: expected a finite float32 value >= 0, got nan"),
        ("epsilon", [1e-6], TypeError, "epsilon: expected a float, got list"),
        ("local_window_size", -1, ValueError, "local_window_size: expected 0 <= local_window_size < 2**31, got -1"),
        ("local_window_size", 2**31, ValueError, "local_window_size: expected 0 <= local_window_size < 2**31, got 2147483648"),
        ("local_window_size", 4.0, TypeError, "local_window_size: expected an int, got float"),
    ],
)  # fmt: skip
def test_bad_options(name, value, error, message):
    call = Call(small_case()).set(name, value)
    assert_refused(call, error, exact(message))


@pytest.mark.parametrize("mask", ["sliding_window_causal", "chunked_causal"])
def test_window_masks_need_a_window(mask):
    call = Call(small_case(mask=mask, local_window_size=0))
    assert_refused(
        call,
        ValueError,
        exact(f"local_window_size: expected >= 1 for mask {mask!r}, got 0"),
    )


@pytest.mark.parametrize(("mask", "window"), [("causal", 8), ("NULL", 1), (pymla.Mask.CAUSAL, 3)])
def test_other_masks_take_no_window(mask, window):
    """A window the mask would ignore is refused, not dropped silently."""
    call = Call(small_case()).set("mask", mask).set("local_window_size", window)
    label = mask.label if isinstance(mask, pymla.Mask) else mask.lower()
    assert_refused(
        call,
        ValueError,
        exact(
            f"local_window_size: expected 0 for mask {label!r} (only sliding_window_causal and "
            f"chunked_causal take a window), got {window}"
        ),
    )


def test_option_names_take_any_case():
    """The names "Sliding_Window_CAUSAL" and "NO_POS" are the lower-case ones: the same bytes."""
    case = small_case(mask="sliding_window_causal", local_window_size=3)
    upper = copy.deepcopy(case)
    expected = Call(case).run()
    call = Call(upper).set("mask", "Sliding_Window_CAUSAL").set("score_mod", "NO_POS")
    got = call.run()
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(upper.cache.blocks.view(torch.uint8), case.cache.blocks.view(torch.uint8))


# ---------------------------------------------------------------- out


@pytest.mark.parametrize("target", ["kv_blocks", "q", "freqs_cis"])
def test_out_overlapping_an_input(target):
    """An output placed in the cache's (or an input's) memory would overwrite it."""
    call = Call(small_case())
    out = call.get(target).view(-1)[: 3 * 2 * 128].view(3, 2, 128)
    call.set("out", out)
    assert_refused(
        call,
        ValueError,
        exact(
            f"out: expected memory of its own (the op writes it), got a tensor overlapping {target}"
        ),
    )


def test_out_is_written_when_valid():
    case = small_case()
    out = torch.full((3, 2, 128), float("nan"), dtype=torch.bfloat16)
    result = Call(case).set("out", out).run()
    assert result is out and not torch.isnan(out).any()


# ---------------------------------------------------------------- direct custom-op call


def test_torch_op_checks_too():
    """``torch.ops.pymla.mla_decode_branch_fp8`` (no wrapper) runs the same checks."""
    case = small_case()
    before = case.cache.blocks.clone()
    args = list(torch_op_args(case))
    i = pymla.args.INPUT_NAMES.index("lookup_table")
    table = args[i].clone()
    table[0, 0] = 12
    args[i] = table
    with no_kernel(), pytest.raises(ValueError, match=r"^lookup_table: expected entries < 12"):
        torch.ops.pymla.mla_decode_branch_fp8(*args)
    assert torch.equal(case.cache.blocks.view(torch.uint8), before.view(torch.uint8))


# ---------------------------------------------------------------- defined results, not errors


@pytest.mark.parametrize("with_out", [False, True])
def test_zero_requests(with_out):
    """An empty batch: an empty [0, H, v_head_dim] output, the cache untouched."""
    cache = pymla.PagedLatentCache(num_blocks=3, page_size=4, num_layers=2)
    cache.blocks.normal_(generator=torch.Generator().manual_seed(1))
    before = cache.blocks.clone()
    w = pymla.make_mla_weights(4)
    args = (
        torch.empty(0, 4, 192, dtype=torch.bfloat16),
        torch.zeros(1, dtype=torch.uint32),
        torch.randn(8, 64).to(torch.bfloat16),
        torch.ones(512, dtype=torch.bfloat16),
        cache,
        1,
        w["w_uk"],
        w["w_uk_scale"],
        w["w_uv"],
        w["w_uv_scale"],
    )
    out = torch.empty(0, 4, 128, dtype=torch.bfloat16) if with_out else None
    with no_kernel():  # nothing to compute: the kernel is not needed
        result = pymla.mla_decode_branch_fp8(*args, scale=0.07, out=out)
    assert result.shape == (0, 4, 128) and result.dtype == torch.bfloat16
    assert out is None or result is out
    assert torch.equal(cache.blocks.view(torch.uint8), before.view(torch.uint8))
    ref = mla_decode_branch_fp8_reference(
        *args[:4],
        KVCacheTensors(before, cache.cache_lengths, cache.lookup_table),
        *args[5:],
        scale=0.07,
    )
    assert ref.shape == (0, 4, 128)


def test_requests_without_new_tokens_only():
    """Requests in the batch but no new token at all: an empty output, the cache untouched."""
    case = small_case(cache_lengths=(5, 9, 0), new_tokens=(0, 0, 0))
    before = case.cache.blocks.clone()
    with no_kernel():
        out = Call(case).run()
    assert out.shape == (0, 2, 128)
    assert torch.equal(case.cache.blocks.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("new_tokens", [(0, 2, 1), (3, 1, 0), (0, 1, 0)])
def test_zero_token_requests_are_skipped(new_tokens):
    """A request with no new tokens is skipped: output rows for the others, its cache untouched."""
    check_parity(small_case(cache_lengths=(6, 0, 13), new_tokens=new_tokens))


# ---------------------------------------------------------------- property-based

GRANULARITIES = ("blockwise", "per_channel", "per_tensor")


def _needed_pages(call: Call) -> torch.Tensor:
    offsets = call.get("input_row_offsets").to(torch.int64)
    ends = call.get("cache_lengths").to(torch.int64) + offsets[1:] - offsets[:-1]
    return (ends + call.case.cache.page_size - 1) // call.case.cache.page_size


def _draw_tensor(call, data, names=(*ALL_TENSORS, "out")) -> str:
    name = data.draw(st.sampled_from(names), label="tensor")
    if name == "out":
        call.ensure_out()
    return name


def _corrupt_non_contiguous(call, data):
    name = _draw_tensor(call, data)
    t = call.get(name)
    assume(t.numel() > 1)  # empty tensors and single elements are always contiguous
    call.set(name, non_contiguous(t))
    return ValueError, (name,), name


def _corrupt_rank(call, data):
    name = _draw_tensor(call, data)
    call.set(name, call.get(name).unsqueeze(0))
    return ValueError, (name,), name


def _corrupt_dtype(call, data):
    name = _draw_tensor(call, data)
    t = call.get(name)
    other = {torch.float8_e4m3fn: torch.bfloat16, torch.uint32: torch.int64}.get(
        t.dtype, torch.float16
    )
    call.set(name, t.to(other))
    return TypeError, (name,), name


def _corrupt_device(call, data):
    name = _draw_tensor(call, data, ALL_TENSORS)
    call.set(name, call.get(name).to("meta"))
    return ValueError, (name,), name


def _corrupt_size(call, data):
    name, dim = data.draw(
        st.sampled_from(
            [
                ("q", 1),
                ("q", 2),
                ("w_uk", 0),
                ("w_uk", 1),
                ("w_uv", 0),
                ("w_uv", 2),
                ("kv_norm_gamma", 0),
                ("freqs_cis", 1),
                ("kv_blocks", 5),
                ("w_uk_scale", 0),
                ("w_uv_scale", 0),
                ("input_row_offsets", 0),
                ("cache_lengths", 0),
                ("lookup_table", 0),
                ("out", 0),
                ("out", 1),
                ("out", 2),
            ]
        ),
        label="dim",
    )
    if name == "out":
        call.ensure_out()
    t = call.get(name)
    # +2/-2 keeps the rope dim even; offsets grow by a copy of their last value
    if name == "input_row_offsets":
        call.set(name, torch.cat([t, t[-1:]]))
    elif t.shape[dim] > 2 and data.draw(st.booleans(), label="shrink"):
        call.set(name, _shrink(t, dim, 2))
    else:
        extra = list(t.shape)
        extra[dim] = 2
        call.set(name, torch.cat([t, t.new_zeros(extra)], dim=dim))
    return ValueError, (name,), name


def _corrupt_granularity(call, data):
    current = call.get("scale_granularity")
    other = data.draw(
        st.sampled_from([g for g in GRANULARITIES if pymla.quant.PRESETS[g] != current]),
        label="granularity",
    )
    call.set("scale_granularity", other)
    return ValueError, ("w_uk_scale",), "scale_granularity"


def _corrupt_offsets_value(call, data):
    offsets = call.get("input_row_offsets").to(torch.int64)
    kind = data.draw(st.sampled_from(["start", "end", "decreasing"]), label="kind")
    if kind == "start":
        offsets[0] = 1
    elif kind == "end":
        offsets[-1] += 1
    else:
        assume(len(offsets) >= 3)
        offsets[1] = offsets[-1] + 1
    call.set("input_row_offsets", offsets.to(torch.uint32))
    return ValueError, ("input_row_offsets",), "input_row_offsets"


def _corrupt_freqs_rows(call, data):
    offsets = call.get("input_row_offsets").to(torch.int64)
    longest = int((call.get("cache_lengths").to(torch.int64) + offsets.diff()).max())
    assume(longest >= 1)
    call.set("freqs_cis", call.get("freqs_cis")[: longest - 1])
    return ValueError, ("cache_lengths",), "freqs_cis"


def _corrupt_cache_length(call, data):
    """A cache length past the pages its request owns (freqs_cis made long enough)."""
    lengths = call.get("cache_lengths").to(torch.int64)
    b = data.draw(st.integers(0, len(lengths) - 1), label="request")
    page_size = call.case.cache.page_size
    lengths[b] += page_size * call.get("lookup_table").shape[1] + 1
    call.set("cache_lengths", lengths.to(torch.uint32))
    freqs = call.get("freqs_cis")
    call.set("freqs_cis", freqs.repeat(int(lengths.max()) // freqs.shape[0] + 2, 1))
    return ValueError, ("lookup_table",), "lookup_table"


def _corrupt_lookup(call, data):
    needed = _needed_pages(call)
    users = [b for b in range(len(needed)) if needed[b] > 0]
    assume(users)
    b = data.draw(st.sampled_from(users), label="request")
    p = data.draw(st.integers(0, int(needed[b]) - 1), label="page")
    value = data.draw(
        st.sampled_from([call.case.cache.blocks.shape[0], 10**6, UNUSED_PAGE]), label="entry"
    )
    table = call.get("lookup_table").clone()
    table[b, p] = value
    call.set("lookup_table", table)
    return ValueError, ("lookup_table",), "lookup_table"


def _corrupt_layer(call, data):
    layers = call.case.cache.num_layers
    call.set("layer_idx", data.draw(st.sampled_from([layers, layers + 5, -1]), label="layer"))
    return ValueError, ("layer_idx",), "layer_idx"


def _corrupt_scale_value(call, data):
    name = data.draw(st.sampled_from(["w_uk_scale", "w_uv_scale"]), label="scales")
    scales = call.get(name).clone()
    flat = scales.view(-1)
    flat[data.draw(st.integers(0, flat.numel() - 1), label="index")] = data.draw(
        st.sampled_from([float("nan"), float("inf"), float("-inf")]), label="value"
    )
    call.set(name, scales)
    return ValueError, (name,), name


def _corrupt_name(call, data):
    name = data.draw(st.sampled_from(["mask", "score_mod"]), label="option")
    call.set(name, data.draw(st.sampled_from(["", "causal_", "alibi", "none"]), label="value"))
    return ValueError, (name,), name


def _corrupt_window(call, data):
    mask = data.draw(st.sampled_from(MASKS), label="mask")
    windowed = mask in ("sliding_window_causal", "chunked_causal")
    bad = [0, -3] if windowed else [-3, 1, 8]  # windowed masks need one, the others none
    call.set("mask", mask)
    call.set("local_window_size", data.draw(st.sampled_from(bad), label="window"))
    return ValueError, ("local_window_size",), "local_window_size"


CORRUPTIONS = {
    f.__name__.removeprefix("_corrupt_"): f
    for f in (
        _corrupt_non_contiguous,
        _corrupt_rank,
        _corrupt_dtype,
        _corrupt_device,
        _corrupt_size,
        _corrupt_granularity,
        _corrupt_offsets_value,
        _corrupt_freqs_rows,
        _corrupt_cache_length,
        _corrupt_lookup,
        _corrupt_layer,
        _corrupt_scale_value,
        _corrupt_name,
        _corrupt_window,
    )
}


@st.composite
def configurations(draw):
    num_requests = draw(st.integers(1, 3), label="requests")
    num_layers = draw(st.integers(1, 3), label="layers")
    mask = draw(st.sampled_from(MASKS), label="mask")
    return dict(
        seed=draw(st.integers(0, 2**16), label="seed"),
        num_heads=draw(st.sampled_from([1, 2, 16]), label="heads"),
        page_size=draw(st.sampled_from([1, 3, 16, 64]), label="page_size"),
        cache_lengths=tuple(
            draw(st.lists(st.integers(0, 80), min_size=num_requests, max_size=num_requests))
        ),
        new_tokens=tuple(
            draw(st.lists(st.integers(0, 3), min_size=num_requests, max_size=num_requests))
        ),
        num_layers=num_layers,
        layer_idx=draw(st.integers(0, num_layers - 1), label="layer_idx"),
        granularity=draw(st.sampled_from(GRANULARITIES), label="granularity"),
        mask=mask,
        score_mod=draw(st.sampled_from(SCORE_MODS), label="score_mod"),
        local_window_size=(
            draw(st.integers(1, 20), label="window")
            if mask in ("sliding_window_causal", "chunked_causal")
            else 0
        ),
    )


@settings(max_examples=30, deadline=None, derandomize=True)
@given(config=configurations())
def test_random_valid_configurations(config):
    """Random valid configurations (including zero-token requests) match the reference."""
    seed = config.pop("seed")
    check_parity(make_case(seed, **config))


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
@settings(max_examples=12, deadline=None, derandomize=True)
@given(config=configurations(), data=st.data())
def test_random_corrupted_configurations(corruption, config, data):
    """One corruption of a random valid configuration: refused, naming the argument, cache intact."""
    seed = config.pop("seed")
    call = Call(make_case(seed, **config), with_out=data.draw(st.booleans(), label="with_out"))
    error, blamed, mentioned = CORRUPTIONS[corruption](call, data)
    raised = assert_refused(call, (TypeError, ValueError), None)
    message = str(raised)
    event(message.split(":")[0])
    assert isinstance(raised, error), f"{type(raised).__name__}: {message}"
    assert any(message.startswith(f"{name}: expected ") for name in blamed), message
    assert re.search(rf"(?<![\w.]){re.escape(mentioned)}(?!\w)", message), message
    assert " got " in message, message


# ---------------------------------------------------------------- lse, shards


def _small_case(**changes):
    return make_case(
        40,
        num_heads=2,
        cache_lengths=(5, 9),
        new_tokens=(1, 2),
        num_layers=1,
        layer_idx=0,
        **changes,
    )


@pytest.mark.parametrize(
    ("lse", "error", "message"),
    [
        (torch.empty(3, 2, dtype=torch.bfloat16), TypeError, "lse: expected dtype torch.float32"),
        (
            torch.empty(3, 3),
            ValueError,
            r"lse: expected shape \(3, 2\) \(\[tot_seq_len of q, num_heads\]\)",
        ),
        (torch.empty(3, 2, 1), ValueError, "lse: expected a rank-2 tensor"),
    ],
)
def test_bad_lse_is_refused_before_the_kernel(lse, error, message):
    case = _small_case()
    before = case.cache.blocks.clone()
    with pytest.raises(error, match=message):
        pymla.mla_decode_branch_fp8(*case.args(), **case.options, lse=lse)
    assert torch.equal(case.cache.blocks.view(torch.uint8), before.view(torch.uint8))


def test_lse_sharing_memory_with_out_is_refused():
    case = _small_case()
    out = torch.empty(3, 2, 128, dtype=torch.bfloat16)
    lse = out.view(-1).view(torch.float32)[:6].view(3, 2)  # the first bytes of out
    with pytest.raises(ValueError, match="expected memory of its own"):
        pymla.mla_decode_branch_fp8(*case.args(), **case.options, out=out, lse=lse)


def test_shard_of_options_must_be_the_cache_s():
    shard = pymla.CacheShard(1, 2)
    case = _small_case(shard=shard)
    options = {k: v for k, v in case.options.items() if k != "shard"}
    with pytest.raises(ValueError, match=r"shard: expected the cache's shard"):
        pymla.mla_decode_branch_fp8(*case.args(), **options)
    step_options = pymla.DecodeOptions(scale=case.options["scale"], shard=pymla.CacheShard(0, 2))
    with pytest.raises(ValueError, match=r"options: expected the cache's shard"):
        pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, step_options)
    with pytest.raises(TypeError, match="shard: expected a pymla.CacheShard"):
        pymla.DecodeOptions(scale=1.0, shard=(0, 2, 1))


def test_a_shard_needs_only_the_pages_of_its_positions():
    """The lookup-table checks count the shard's positions: 5 + 1 tokens over 2 shards is 3 each."""
    shard = pymla.CacheShard(0, 2)
    cache = pymla.PagedLatentCache(num_blocks=4, page_size=2, kv_lora_rank=8, shard=shard)
    b = cache.add_request()
    cache.fill(b, 5)
    assert len(cache.pages_of(b)) == 2  # positions 0, 2, 4 in pages of 2
    cache.append(b, 0, torch.randn(1, 72))  # position 5: rank 1's, no page needed here
    assert len(cache.pages_of(b)) == 2 and cache.pending(b) == 1
    assert cache.rows(b, 0).shape[0] == 3  # the shard's positions 0, 2, 4
    table = cache.lookup_table.clone()
    table[0, 1] = UNUSED_PAGE
    with pytest.raises(ValueError, match=r"\(3 of them in shard 0\)"):
        pymla.value_checks.check_positions(
            torch.tensor([0, 1], dtype=torch.uint32),
            cache.cache_lengths,
            table,
            num_tokens=1,
            max_seq_len=10,
            num_blocks=4,
            page_size=2,
            shard=shard,
        )


def test_alibi_on_a_shard_is_refused_on_a_gpu():
    """The GPU kernels take key slots for ALiBi's positions: refused before any kernel runs."""
    from pymla.validate import check_shard_device

    shard = pymla.CacheShard(0, 2)
    with pytest.raises(ValueError, match="score_mod: expected 'no_pos' for a shard"):
        check_shard_device(shard, "alibi_pos", torch.device("cuda", 0))
    check_shard_device(shard, "alibi_pos", torch.device("cpu"))
    check_shard_device(pymla.CacheShard(), "alibi_pos", torch.device("cuda", 0))
    check_shard_device(shard, "no_pos", torch.device("cuda", 0))


def test_no_output_needs_attention_out():
    """The torch op without ``output`` stops after step 5, which then needs ``attention_output``."""
    case = _small_case()
    args = list(torch_op_args(case))
    args[0] = torch.empty(0, dtype=case.q.dtype)
    with pytest.raises(ValueError, match="out: expected a tensor"):
        torch.ops.pymla.mla_decode_branch_fp8(*args)
