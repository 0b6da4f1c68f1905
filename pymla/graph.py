"""Building MAX graphs with the ``pymla.mla_decode_branch_fp8`` custom op.

For users who build their own graphs: pass :func:`kernels_path` to
``Graph(..., custom_extensions=[kernels_path()])`` and call
:func:`mla_decode_branch_fp8_graph` inside it. :func:`build_graph` makes a
complete graph with symbolic batch, token, head and page dimensions, which
is what :mod:`pymla.op` compiles once per configuration.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from max.dtype import DType
from max.graph import BufferType, BufferValue, DeviceRef, Graph, TensorType, TensorValue, ops

from .quant import ScaleGranularity
from .reference import MASKS, SCORE_MODS

OP_NAME = "pymla.mla_decode_branch_fp8"
FP8_BYTES = DType.uint8  # fp8 weights cross as raw bytes (see pymla.bridge)


def _source_dir() -> pathlib.Path:
    here = pathlib.Path(__file__).resolve().parent
    for candidate in (here / "mojo_kernels", here.parent / "mojo_kernels"):
        if (candidate / "mla_decode_branch_fp8.mojo").is_file():
            return candidate
    raise FileNotFoundError("pymla: cannot find the mojo_kernels sources next to the package")


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("PYMLA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pymla"
    )
    path = pathlib.Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def kernels_path() -> pathlib.Path:
    """The compiled Mojo package (``.mojoc``) holding the op, built once per source version.

    The package is keyed by a hash of the sources and kept under
    ``$PYMLA_CACHE_DIR`` (default ``~/.cache/pymla``).
    """
    src = _source_dir()
    digest = hashlib.sha256()
    for f in sorted(src.rglob("*.mojo")):
        digest.update(str(f.relative_to(src)).encode())
        digest.update(f.read_bytes())
    target = _cache_dir() / f"mojo_kernels_{digest.hexdigest()[:16]}.mojoc"
    if not target.exists():
        mojo = pathlib.Path(sys.executable).with_name("mojo")
        cmd = [str(mojo) if mojo.exists() else "mojo", "precompile", str(src), "-o"]
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            staged = pathlib.Path(tmp) / target.name
            result = subprocess.run(cmd + [str(staged)], capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"pymla: building the Mojo kernels failed:\n{result.stderr}")
            staged.replace(target)
    return target


@dataclass(frozen=True)
class OpConfig:
    """What a compiled op is specialized on: its device and dtype.

    Everything else (sizes, scale granularity, mask, score_mod, scalars) is a
    runtime input, so one compiled model serves every configuration.
    """

    dtype: DType
    device: DeviceRef


def mask_code(mask: str) -> int:
    """The kernel's code for a mask name (its index in :data:`pymla.reference.MASKS`)."""
    if mask not in MASKS:
        raise ValueError(f"mask: expected one of {MASKS}, got {mask!r}")
    return MASKS.index(mask)


def score_mod_code(score_mod: str) -> int:
    """The kernel's code for a score_mod name (its index in :data:`pymla.reference.SCORE_MODS`)."""
    if score_mod not in SCORE_MODS:
        raise ValueError(f"score_mod: expected one of {SCORE_MODS}, got {score_mod!r}")
    return SCORE_MODS.index(score_mod)


def mla_decode_branch_fp8_graph(
    q: TensorValue,
    input_row_offsets: TensorValue,
    freqs_cis: TensorValue,
    kv_norm_gamma: TensorValue,
    kv_blocks: BufferValue,
    cache_lengths: TensorValue,
    lookup_table: TensorValue,
    layer_idx: TensorValue,
    w_uk: TensorValue,
    w_uk_scale: TensorValue,
    w_uv: TensorValue,
    w_uv_scale: TensorValue,
    *,
    scale: float | TensorValue,
    epsilon: float | TensorValue = 1e-6,
    scale_granularity: ScaleGranularity
    | tuple[int, int, int]
    | str
    | Sequence[TensorValue] = "blockwise",
    mask: str | TensorValue = "causal",
    score_mod: str | TensorValue = "no_pos",
    local_window_size: int | TensorValue = 0,
    out: BufferValue | None = None,
    new_rows: TensorValue | None = None,
    attention_out: BufferValue | None = None,
) -> TensorValue | None:
    """Adds the fused op to the current graph.

    Returns ``output [T, H, v_head_dim]`` as a new tensor, or, when ``out``
    (a buffer of that shape and q's dtype) is given, writes it there and
    returns None. ``attention_out`` (a buffer ``[T, H, kv_lora_rank]`` of q's
    dtype, or one with zero tokens) receives the attention output before
    step 6. ``new_rows`` (``[T, kv_lora_rank + qk_rope_head_dim]``, or zero
    rows) holds the new tokens' raw latent rows: the op normalizes, rotates
    and writes them into the cache; without it they must be in the cache already.

    Tensor arguments are as in :func:`pymla.mla_decode_branch_fp8`, with fp8
    weights typed ``uint8`` and ``kv_blocks`` a buffer (it is updated in
    place). ``layer_idx`` is a uint32 scalar tensor. The options may be
    Python values (folded into the graph as constants) or scalar tensors on
    the CPU: ``scale`` and ``epsilon`` float32; ``mask`` and ``score_mod``
    int32 codes (:func:`mask_code`, :func:`score_mod_code`);
    ``local_window_size`` and the three ``scale_granularity`` values int32.
    The graph needs ``custom_extensions=[kernels_path()]``.
    """

    def scalar(value: float | int | TensorValue, dtype: DType) -> TensorValue:
        if isinstance(value, TensorValue):
            return value
        return ops.constant(value, dtype, device=DeviceRef.CPU())

    if isinstance(scale_granularity, (str, ScaleGranularity)) or not isinstance(
        scale_granularity[0], TensorValue
    ):
        scale_granularity = ScaleGranularity.parse(scale_granularity)
    if isinstance(mask, str):
        mask = mask_code(mask)
    if isinstance(score_mod, str):
        score_mod = score_mod_code(score_mod)
    if new_rows is None:
        new_rows = ops.buffer_load(ops.buffer_create(BufferType(q.dtype, [0, 1], q.device)))
    if attention_out is None:
        attention_out = ops.buffer_create(BufferType(q.dtype, [0, 1, 1], q.device))
    result = out
    if result is None:
        result = ops.buffer_create(
            BufferType(q.dtype, [q.shape[0], q.shape[1], w_uv.shape[1]], q.device)
        )
    values = [
        result,
        attention_out,
        q,
        input_row_offsets,
        freqs_cis,
        kv_norm_gamma,
        new_rows,
        kv_blocks,
        cache_lengths,
        lookup_table,
        layer_idx,
        scalar(scale, DType.float32),
        scalar(epsilon, DType.float32),
        scalar(mask, DType.int32),
        scalar(score_mod, DType.int32),
        scalar(local_window_size, DType.int32),
        *(scalar(g, DType.int32) for g in scale_granularity),
        w_uk,
        w_uk_scale,
        w_uv,
        w_uv_scale,
    ]
    ops.inplace_custom(OP_NAME, device=q.device, values=values)
    return ops.buffer_load(result) if out is None else None


INPUT_NAMES = (
    "output",
    "attention_output",
    "q",
    "input_row_offsets",
    "freqs_cis",
    "kv_norm_gamma",
    "new_rows",
    "kv_blocks",
    "cache_lengths",
    "lookup_table",
    "layer_idx",
    "scale",
    "epsilon",
    "mask",
    "score_mod",
    "local_window_size",
    "m_scale_granularity",
    "n_scale_granularity",
    "k_scale_granularity",
    "w_uk",
    "w_uk_scale",
    "w_uv",
    "w_uv_scale",
)


def input_types(dtype: DType, device: DeviceRef) -> Sequence[TensorType | BufferType]:
    """Graph inputs with symbolic sizes: one compiled model serves every batch and cache shape."""
    cpu = DeviceRef.CPU()

    def scalar(dt: DType) -> TensorType:
        return TensorType(dt, [], cpu)

    return [
        BufferType(dtype, ["tokens", "heads", "v_head_dim"], device),
        BufferType(dtype, ["attention_tokens", "attention_heads", "attention_dim"], device),
        TensorType(dtype, ["tokens", "heads", "q_head_dim"], device),
        TensorType(DType.uint32, ["offsets"], device),
        TensorType(dtype, ["max_seq_len", "rope_dim"], device),
        TensorType(dtype, ["kv_lora_rank"], device),
        TensorType(dtype, ["new_rows", "new_row_dim"], device),
        BufferType(
            dtype, ["num_blocks", 1, "num_layers", "page_size", 1, "cache_head_dim"], device
        ),
        TensorType(DType.uint32, ["requests"], device),
        TensorType(DType.uint32, ["requests", "pages_per_request"], device),
        scalar(DType.uint32),
        scalar(DType.float32),
        scalar(DType.float32),
        *(scalar(DType.int32) for _ in range(6)),
        TensorType(FP8_BYTES, ["heads", "kv_lora_rank", "nope_dim"], device),
        TensorType(DType.float32, ["heads", "uk_n_blocks", "uk_k_blocks"], device),
        TensorType(FP8_BYTES, ["heads", "v_head_dim", "kv_lora_rank"], device),
        TensorType(DType.float32, ["heads", "uv_n_blocks", "uv_k_blocks"], device),
    ]


def build_graph(config: OpConfig) -> Graph:
    """A graph whose only op is the fused op, inputs in :data:`INPUT_NAMES` order.

    The output and the cache blocks are buffers the caller owns; the graph
    returns nothing.
    """
    with Graph(
        "pymla_mla_decode_branch_fp8",
        input_types=input_types(config.dtype, config.device),
        custom_extensions=[kernels_path()],
    ) as graph:
        args = dict(zip(INPUT_NAMES, graph.inputs, strict=True))
        buffers = ("output", "attention_output", "kv_blocks")
        t = {name: value.tensor for name, value in args.items() if name not in buffers}
        mla_decode_branch_fp8_graph(
            t["q"],
            t["input_row_offsets"],
            t["freqs_cis"],
            t["kv_norm_gamma"],
            args["kv_blocks"].buffer,
            t["cache_lengths"],
            t["lookup_table"],
            t["layer_idx"],
            t["w_uk"],
            t["w_uk_scale"],
            t["w_uv"],
            t["w_uv_scale"],
            scale=t["scale"],
            epsilon=t["epsilon"],
            scale_granularity=[t[f"{axis}_scale_granularity"] for axis in "mnk"],
            mask=t["mask"],
            score_mod=t["score_mod"],
            local_window_size=t["local_window_size"],
            out=args["output"].buffer,
            new_rows=t["new_rows"],
            attention_out=args["attention_output"].buffer,
        )
        graph.output()
    return graph


from .max_native import mla_decode_graph  # noqa: E402, F401
