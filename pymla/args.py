"""The op's argument list, written once.

:data:`ARGS` lists the arguments of the Mojo op ``execute`` in its order
(``mojo_kernels/mla_decode_branch_fp8.mojo``). Everything that needs the
list derives from it: the MAX graph's input types and names
(:mod:`pymla.graph`), the torch custom op's schema (:mod:`pymla.torch_op`), the
dtypes of the scalar inputs, the rank and dtype checks
(:mod:`pymla.validate`), and which object of the plan/run API holds each
value (:mod:`pymla.plan`).

The op's vocabulary lives here too: the masks and score mods (:class:`Mask`,
:class:`ScoreMod`, their names :data:`MASKS` and :data:`SCORE_MODS`, and the
one parser of a name or code, :meth:`Mask.parse`), and the cache's three
tensors (:class:`KVCacheTensors`). The mask and score-mod codes are the
kernel's (``mojo_kernels/spec.mojo``: ``MASK_*``, ``SCORE_MOD_*``).
:func:`torch_op_args` and :func:`call_torch_op` spell out the call of the
torch custom op (registered by :mod:`pymla.torch_op`) on named values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch
from max.dtype import DType

ACTIVATION = "activation"
"""Dtype marker: the op's dtype (q's): bfloat16, float16 or float32."""

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

CACHE = "cache"
"""Dtype marker: the cache blocks' dtype: the op's, or uint8 for rows in the
``fp8_ds_mla`` format (:mod:`pymla.cache_format`; with a bfloat16 op)."""


class _Named(enum.IntEnum):
    """An enum of kernel codes whose names (lower case) are the public spelling."""

    @property
    def label(self) -> str:
        """The name used by the reference and the public function (``"causal"``, ...)."""
        return self.name.lower()

    @classmethod
    def labels(cls) -> tuple[str, ...]:
        return tuple(_MEMBERS[cls])

    @classmethod
    def parse(cls, value: object, name: str | None = None, *, codes: bool = False):
        """The member for ``value``: a member, its name in any case, or (``codes``) its code.

        TypeError for another type (a code without ``codes``), ValueError for
        an unknown name or code. ``name`` names the argument in the messages
        (default: the enum's, ``"mask"`` or ``"score_mod"``).

        It looks members up in tables built at import (``_MEMBERS``), never by
        iterating the enum class: torch 2.11's dynamo cannot trace that
        iteration, and the op parses its options inside ``torch.compile``.
        """
        if isinstance(value, cls):
            return value
        name = cls._argument if name is None else name
        members = _MEMBERS[cls]
        if codes and isinstance(value, int) and not isinstance(value, bool):
            for member in members.values():
                if int(member) == value:
                    return member
            known = {label: int(m) for label, m in members.items()}
            raise ValueError(f"{name}: expected one of the codes {known}, got {value}")
        if not isinstance(value, str):
            raise TypeError(
                f"{name}: expected a str, one of {cls.labels()}, got {type(value).__name__}"
            )
        member = members.get(value.lower())
        if member is None:
            raise ValueError(f"{name}: expected one of {cls.labels()} (any case), got {value!r}")
        return member


class Mask(_Named):
    """Attention masks; the values are the kernel's ``MASK_*`` codes."""

    _argument = enum.nonmember("mask")

    NULL = 0
    CAUSAL = 1
    SLIDING_WINDOW_CAUSAL = 2
    CHUNKED_CAUSAL = 3

    @property
    def windowed(self) -> bool:
        """Whether the mask takes a ``local_window_size`` (sliding window, chunk)."""
        return self in (Mask.SLIDING_WINDOW_CAUSAL, Mask.CHUNKED_CAUSAL)


class ScoreMod(_Named):
    """Score modifications; the values are the kernel's ``SCORE_MOD_*`` codes."""

    _argument = enum.nonmember("score_mod")

    NO_POS = 0
    ALIBI_POS = 1


_MEMBERS: dict[type[_Named], dict[str, _Named]] = {
    named: {m.label: m for m in named} for named in (Mask, ScoreMod)
}
"""Each :class:`_Named` enum's members by label, in definition order (:meth:`_Named.parse`)."""

MASKS: tuple[str, ...] = Mask.labels()
"""The mask names: ``("null", "causal", "sliding_window_causal", "chunked_causal")``."""
SCORE_MODS: tuple[str, ...] = ScoreMod.labels()
"""The score-mod names: ``("no_pos", "alibi_pos")``."""
WINDOWED_MASKS: tuple[str, ...] = tuple(m.label for m in Mask if m.windowed)
"""The masks that take a ``local_window_size``."""


class KVCacheTensors(NamedTuple):
    """The three tensors of a paged latent cache, as the op consumes them."""

    blocks: torch.Tensor  # [num_blocks, 1, num_layers, page_size, 1, R + Dr]
    cache_lengths: torch.Tensor  # [B] uint32
    lookup_table: torch.Tensor  # [B, max_pages] uint32


class Source(enum.Enum):
    """Which object of the plan/run API supplies an argument."""

    CALL = "call"  # given to every run(): q and the tensors it writes
    STEP = "step"  # the decode step's plan: cache, positions, options
    LAYER = "layer"  # run()'s layer index
    WEIGHTS = "weights"  # one layer's LayerWeights


@dataclass(frozen=True)
class Arg:
    """One argument of the op.

    ``dims`` are the graph's symbolic dims (ints are static); ``()`` is a
    host scalar. ``dtype`` is a MAX dtype or :data:`ACTIVATION`. fp8 weights
    cross as their ``uint8`` bytes (see :mod:`pymla.bridge`).
    """

    name: str
    dims: tuple[str | int, ...]
    dtype: DType | str
    source: Source
    mutable: bool = False
    optional: bool = False  # an empty tensor means "not given"

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def is_scalar(self) -> bool:
        return not self.dims

    def torch_dtypes(self) -> tuple[torch.dtype, ...]:
        """The torch dtypes the public tensor may have."""
        if self.dtype == ACTIVATION:
            return ACTIVATION_DTYPES
        if self.dtype == CACHE:
            return (*ACTIVATION_DTYPES, torch.uint8)
        return _TORCH_DTYPES[self.dtype]


_TORCH_DTYPES = {
    DType.uint32: (torch.uint32,),
    DType.int32: (torch.int32,),
    DType.float32: (torch.float32,),
    # fp8 weights: the public function takes float8_e4m3fn, the op their uint8 bytes.
    DType.uint8: (torch.float8_e4m3fn, torch.uint8),
}

_A, _C, _S, _L, _W = ACTIVATION, Source.CALL, Source.STEP, Source.LAYER, Source.WEIGHTS

ARGS: tuple[Arg, ...] = (
    # output: dims of its own: empty, the op stops after step 5 (context-parallel ranks).
    Arg(
        "output",
        ("output_tokens", "output_heads", "output_dim"),
        _A,
        _C,
        mutable=True,
        optional=True,
    ),
    Arg(
        "attention_output",
        ("attention_tokens", "attention_heads", "attention_dim"),
        _A,
        _C,
        mutable=True,
        optional=True,
    ),
    Arg("lse", ("lse_tokens", "lse_heads"), DType.float32, _C, mutable=True, optional=True),
    Arg("q", ("tokens", "heads", "q_head_dim"), _A, _C),
    Arg("input_row_offsets", ("offsets",), DType.uint32, _S),
    Arg("freqs_cis", ("max_seq_len", "rope_dim"), _A, _S),
    Arg("kv_norm_gamma", ("kv_lora_rank",), _A, _W),
    Arg("new_rows", ("new_rows", "new_row_dim"), _A, _C, optional=True),
    Arg(
        "kv_blocks",
        ("num_blocks", 1, "num_layers", "page_size", 1, "cache_head_dim"),
        CACHE,
        _S,
        mutable=True,
    ),
    Arg("cache_lengths", ("requests",), DType.uint32, _S),
    Arg("lookup_table", ("requests", "pages_per_request"), DType.uint32, _S),
    Arg("layer_idx", (), DType.uint32, _L),
    # 1: the six steps; 6: step 6 alone, from attention_output (STEP_6_ONLY).
    Arg("first_step", (), DType.int32, _C),
    Arg("scale", (), DType.float32, _S),
    Arg("epsilon", (), DType.float32, _S),
    Arg("mask", (), DType.int32, _S),
    Arg("score_mod", (), DType.int32, _S),
    Arg("local_window_size", (), DType.int32, _S),
    Arg("shard_rank", (), DType.int32, _S),
    Arg("num_shards", (), DType.int32, _S),
    Arg("shard_interleave", (), DType.int32, _S),
    Arg("m_scale_granularity", (), DType.int32, _W),
    Arg("n_scale_granularity", (), DType.int32, _W),
    Arg("k_scale_granularity", (), DType.int32, _W),
    Arg("w_uk", ("heads", "kv_lora_rank", "nope_dim"), DType.uint8, _W),
    Arg("w_uk_scale", ("heads", "uk_n_blocks", "uk_k_blocks"), DType.float32, _W),
    Arg("w_uv", ("heads", "v_head_dim", "kv_lora_rank"), DType.uint8, _W),
    Arg("w_uv_scale", ("heads", "uv_n_blocks", "uv_k_blocks"), DType.float32, _W),
)

BY_NAME: dict[str, Arg] = {a.name: a for a in ARGS}
ALL_STEPS, STEP_6_ONLY = 1, 6
"""``first_step`` values: the whole op, or step 6 alone on a given attention output."""
INPUT_NAMES: tuple[str, ...] = tuple(a.name for a in ARGS)
"""The graph's (and the kernel's, and the torch op's) argument order."""

TORCH_SCALAR_DTYPES = {
    DType.uint32: torch.uint32,
    DType.int32: torch.int32,
    DType.float32: torch.float32,
}
_SCHEMA_SCALARS = {DType.uint32: "int", DType.int32: "int", DType.float32: "float"}


def torch_schema() -> str:
    """The torch custom op's schema: the kernel's arguments, then ``bool check_values``.

    Tensors the kernel writes are declared mutated (``Tensor(x!)``); an
    optional tensor that was not given is an empty rank-1 tensor.
    """
    params = []
    for i, a in enumerate(ARGS):
        if a.is_scalar:
            params.append(f"{_SCHEMA_SCALARS[a.dtype]} {a.name}")
        else:
            params.append(f"Tensor{f'(a{i}!)' if a.mutable else ''} {a.name}")
    params.append("bool check_values")
    return f"({', '.join(params)}) -> ()"


def mutated_names() -> tuple[str, ...]:
    return tuple(a.name for a in ARGS if a.mutable)


def torch_op_args(
    *,
    out: torch.Tensor,
    q: torch.Tensor,
    input_row_offsets: torch.Tensor,
    freqs_cis: torch.Tensor,
    kv: KVCacheTensors,
    layer_idx: int,
    options,
    granularity,
    weights: dict[str, torch.Tensor],
    attention_out: torch.Tensor | None = None,
    new_rows: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    first_step: int = ALL_STEPS,
    check_values: bool = True,
) -> tuple:
    """The positional arguments of ``torch.ops.pymla.mla_decode_branch_fp8`` (:data:`INPUT_NAMES` order).

    ``options``: a :class:`pymla.DecodeOptions`; ``granularity``: a
    :class:`pymla.ScaleGranularity`; ``weights``: a :class:`pymla.LayerWeights`'
    ``tensors`` (fp8 weights as float8_e4m3fn). ``out`` None: the op stops
    after step 5 (an empty ``output``); the cache shard is ``options.shard``.
    """
    values = {
        "output": _absent(q) if out is None else out,
        "attention_output": _absent(q) if attention_out is None else attention_out,
        "lse": _absent_f32(q) if lse is None else lse,
        "q": q,
        "input_row_offsets": input_row_offsets,
        "freqs_cis": freqs_cis,
        "new_rows": _absent(q) if new_rows is None else new_rows,
        "kv_blocks": kv.blocks,
        "cache_lengths": kv.cache_lengths,
        "lookup_table": kv.lookup_table,
        "layer_idx": layer_idx,
        "first_step": first_step,
        **options.scalars(),
        "m_scale_granularity": granularity.m,
        "n_scale_granularity": granularity.n,
        "k_scale_granularity": granularity.k,
        **{k: t.view(torch.uint8) if k in ("w_uk", "w_uv") else t for k, t in weights.items()},
    }
    return (*(values[n] for n in INPUT_NAMES), bool(check_values))


def call_torch_op(**values) -> None:
    """``torch.ops.pymla.mla_decode_branch_fp8`` on named values (see :func:`torch_op_args`).

    The one place that spells that call out; the op is registered by
    :mod:`pymla.torch_op` (imported by ``import pymla``).
    """
    torch.ops.pymla.mla_decode_branch_fp8(*torch_op_args(**values))


def _absent(q: torch.Tensor) -> torch.Tensor:
    """The placeholder of an optional tensor argument that was not given (no elements)."""
    return q.new_empty(0) if isinstance(q, torch.Tensor) else torch.empty(0)


def _absent_f32(q: torch.Tensor) -> torch.Tensor:
    """The placeholder of an optional float32 tensor (``lse``) that was not given."""
    device = q.device if isinstance(q, torch.Tensor) else "cpu"
    return torch.empty(0, dtype=torch.float32, device=device)
