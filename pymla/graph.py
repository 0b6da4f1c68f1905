"""Building MAX graphs with the ``pymla.mla_decode_branch_fp8`` custom op.

For users who build their own graphs: pass :func:`kernels_path` to
``Graph(..., custom_extensions=[kernels_path()])`` and call
:func:`mla_decode_branch_fp8_graph` inside it. :func:`build_graph` makes a
complete graph with symbolic batch, token, head and page dimensions, which
is what :mod:`pymla.runtime` compiles once per configuration.
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

from .args import ACTIVATION, ARGS, CACHE, INPUT_NAMES, Mask, ScoreMod
from .cpu_paths import configure_cpu_target
from .quant import ScaleGranularity

__all__ = [
    "INPUT_NAMES",
    "OpConfig",
    "build_graph",
    "input_types",
    "kernels_path",
    "mask_code",
    "mla_decode_branch_fp8_graph",
    "score_mod_code",
]

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


def mojo_binary() -> str:
    """The Mojo compiler of this environment (next to the Python executable, else on PATH)."""
    mojo = pathlib.Path(sys.executable).with_name("mojo")
    return str(mojo) if mojo.exists() else "mojo"


def kernels_path() -> pathlib.Path:
    """The compiled Mojo package (``.mojoc``) holding the op, built once per source version.

    The package is keyed by a hash of the sources and kept under
    ``$PYMLA_CACHE_DIR`` (default ``~/.cache/pymla``). Every graph with the op
    needs it, so it also sets MAX's CPU target for the compile that follows
    (:func:`pymla.cpu_paths.configure_cpu_target`: the host's, unless LLVM
    misnames a CPU whose features the kernels use).
    """
    configure_cpu_target()
    src = _source_dir()
    digest = hashlib.sha256()
    for f in sorted(src.rglob("*.mojo")):
        digest.update(str(f.relative_to(src)).encode())
        digest.update(f.read_bytes())
    target = _cache_dir() / f"mojo_kernels_{digest.hexdigest()[:16]}.mojoc"
    if not target.exists():
        cmd = [mojo_binary(), "precompile", str(src), "-o"]
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            staged = pathlib.Path(tmp) / target.name
            # env: importing max.nn putenv()s PYTHONEXECUTABLE (a Python outside this venv)
            # into the C environment; os.environ never saw it, so pass os.environ.
            result = subprocess.run(
                cmd + [str(staged)], capture_output=True, text=True, env=dict(os.environ)
            )
            if result.returncode != 0:
                raise RuntimeError(f"pymla: building the Mojo kernels failed:\n{result.stderr}")
            staged.replace(target)
    return target


@dataclass(frozen=True)
class OpConfig:
    """What a compiled op is specialized on: its device, dtype and the cache blocks' dtype.

    Everything else (sizes, scale granularity, mask, score_mod, scalars) is a
    runtime input, so one compiled model serves every configuration.
    ``cache_dtype`` None: the blocks are of ``dtype``; ``DType.uint8``: rows
    in the ``fp8_ds_mla`` format (:mod:`pymla.cache_format`).
    """

    dtype: DType
    device: DeviceRef
    cache_dtype: DType | None = None


def mask_code(mask: str | Mask) -> int:
    """The kernel's code for a mask (:class:`pymla.Mask` or its name, :meth:`pymla.Mask.parse`)."""
    return int(Mask.parse(mask))


def score_mod_code(score_mod: str | ScoreMod) -> int:
    """The kernel's code for a score mod (:class:`pymla.ScoreMod` or its name)."""
    return int(ScoreMod.parse(score_mod))


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
    lse: BufferValue | None = None,
    shard: Sequence[int | TensorValue] = (0, 1, 1),
    first_step: int | TensorValue = 1,
) -> TensorValue | None:
    """Adds the fused op to the current graph.

    Returns ``output [T, H, v_head_dim]`` as a new tensor, or, when ``out``
    (a buffer of that shape and q's dtype) is given, writes it there and
    returns None. ``attention_out`` (a buffer ``[T, H, kv_lora_rank]`` of q's
    dtype, or one with zero tokens) receives the attention output before
    step 6; ``lse`` (a float32 buffer ``[T, H]``, or one with zero tokens) its
    log-sum-exp per row; ``out`` with zero tokens stops the op after step 5.
    ``shard``: ``(shard_rank, num_shards, shard_interleave)``, the positions
    this cache holds (:class:`pymla.CacheShard`; int32). ``first_step`` 6
    (int32) runs step 6 alone on ``attention_out`` (read). ``new_rows`` (``[T, kv_lora_rank + qk_rope_head_dim]``, or zero
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
    if not isinstance(mask, TensorValue):
        mask = int(Mask.parse(mask, codes=True))
    if not isinstance(score_mod, TensorValue):
        score_mod = int(ScoreMod.parse(score_mod, codes=True))
    if new_rows is None:
        new_rows = ops.buffer_load(ops.buffer_create(BufferType(q.dtype, [0, 1], q.device)))
    if attention_out is None:
        attention_out = ops.buffer_create(BufferType(q.dtype, [0, 1, 1], q.device))
    if lse is None:
        lse = ops.buffer_create(BufferType(DType.float32, [0, 1], q.device))
    result = out
    if result is None:
        result = ops.buffer_create(
            BufferType(q.dtype, [q.shape[0], q.shape[1], w_uv.shape[1]], q.device)
        )
    given = {
        "output": result,
        "attention_output": attention_out,
        "lse": lse,
        "q": q,
        "input_row_offsets": input_row_offsets,
        "freqs_cis": freqs_cis,
        "kv_norm_gamma": kv_norm_gamma,
        "new_rows": new_rows,
        "kv_blocks": kv_blocks,
        "cache_lengths": cache_lengths,
        "lookup_table": lookup_table,
        "layer_idx": layer_idx,
        "first_step": first_step,
        "scale": scale,
        "epsilon": epsilon,
        "mask": mask,
        "score_mod": score_mod,
        "local_window_size": local_window_size,
        **dict(zip(("shard_rank", "num_shards", "shard_interleave"), shard, strict=True)),
        **{
            f"{axis}_scale_granularity": g for axis, g in zip("mnk", scale_granularity, strict=True)
        },
        "w_uk": w_uk,
        "w_uk_scale": w_uk_scale,
        "w_uv": w_uv,
        "w_uv_scale": w_uv_scale,
    }
    values = [scalar(given[a.name], a.dtype) if a.is_scalar else given[a.name] for a in ARGS]
    ops.inplace_custom(OP_NAME, device=q.device, values=values)
    return ops.buffer_load(result) if out is None else None


def input_types(
    dtype: DType, device: DeviceRef, cache_dtype: DType | None = None
) -> Sequence[TensorType | BufferType]:
    """Graph inputs (:data:`pymla.args.ARGS`) with symbolic sizes: one model serves every shape.

    Scalars live on the host; the tensors the op writes are buffers. The cache
    blocks are of ``cache_dtype`` (None: ``dtype``; uint8: ``fp8_ds_mla`` rows).
    """
    types = []
    for a in ARGS:
        if a.dtype == CACHE:
            dt = dtype if cache_dtype is None else cache_dtype
        else:
            dt = dtype if a.dtype == ACTIVATION else a.dtype
        if a.is_scalar:
            types.append(TensorType(dt, [], DeviceRef.CPU()))
        else:
            types.append((BufferType if a.mutable else TensorType)(dt, list(a.dims), device))
    return types


def build_graph(config: OpConfig) -> Graph:
    """A graph whose only op is the fused op, inputs in :data:`INPUT_NAMES` order.

    The output and the cache blocks are buffers the caller owns; the graph
    returns nothing.
    """
    with Graph(
        "pymla_mla_decode_branch_fp8",
        input_types=input_types(config.dtype, config.device, config.cache_dtype),
        custom_extensions=[kernels_path()],
    ) as graph:
        args = dict(zip(INPUT_NAMES, graph.inputs, strict=True))
        t = {a.name: args[a.name].tensor for a in ARGS if not a.mutable}
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
            lse=args["lse"].buffer,
            shard=[t[name] for name in ("shard_rank", "num_shards", "shard_interleave")],
            first_step=t["first_step"],
        )
        graph.output()
    return graph


def __getattr__(name: str):
    """``pymla.graph.mla_decode_graph``: MAX's drop-in (:mod:`pymla.max_native`, which builds
    on this module), imported on first use so that neither module imports the other at load.
    """
    if name == "mla_decode_graph":
        from .max_native import mla_decode_graph

        return mla_decode_graph
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
