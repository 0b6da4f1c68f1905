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
    for f in sorted(src.glob("*.mojo")):
        digest.update(f.name.encode())
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
    """What a compiled op is specialized on; everything else is a runtime input."""

    dtype: DType
    scale_granularity: ScaleGranularity
    mask: str
    score_mod: str
    device: DeviceRef

    def parameters(self) -> dict[str, int | str]:
        g = self.scale_granularity
        return {
            "m_scale_granularity": g.m,
            "n_scale_granularity": g.n,
            "k_scale_granularity": g.k,
            "mask_str": self.mask,
            "score_mod_str": self.score_mod,
        }


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
    local_window_size: int | TensorValue = 0,
    scale_granularity: ScaleGranularity | tuple[int, int, int] | str = "blockwise",
    mask: str = "causal",
    score_mod: str = "no_pos",
) -> TensorValue:
    """Adds the fused op to the current graph; returns ``output [T, H, v_head_dim]``.

    Tensor arguments are as in :func:`pymla.mla_decode_branch_fp8`, with fp8
    weights typed ``uint8`` and ``kv_blocks`` a buffer (it is updated in
    place). ``layer_idx`` is a uint32 scalar; ``scale``, ``epsilon`` and
    ``local_window_size`` may be Python numbers (graph constants) or scalar
    tensors (float32, float32, int32). The graph needs
    ``custom_extensions=[kernels_path()]``.
    """
    if mask not in MASKS:
        raise ValueError(f"mask: expected one of {MASKS}, got {mask!r}")
    if score_mod not in SCORE_MODS:
        raise ValueError(f"score_mod: expected one of {SCORE_MODS}, got {score_mod!r}")
    config = OpConfig(q.dtype, ScaleGranularity.parse(scale_granularity), mask, score_mod, q.device)

    def scalar(value: float | int | TensorValue, dtype: DType) -> TensorValue:
        if isinstance(value, TensorValue):
            return value
        return ops.constant(value, dtype, device=DeviceRef.CPU())

    out_type = TensorType(q.dtype, [q.shape[0], q.shape[1], w_uv.shape[1]], q.device)
    values = [
        q,
        input_row_offsets,
        freqs_cis,
        kv_norm_gamma,
        kv_blocks,
        cache_lengths,
        lookup_table,
        layer_idx,
        scalar(scale, DType.float32),
        scalar(epsilon, DType.float32),
        scalar(local_window_size, DType.int32),
        w_uk,
        w_uk_scale,
        w_uv,
        w_uv_scale,
    ]
    return ops.inplace_custom(
        OP_NAME, device=q.device, values=values, out_types=[out_type], parameters=config.parameters()
    )[0].tensor


INPUT_NAMES = (
    "q",
    "input_row_offsets",
    "freqs_cis",
    "kv_norm_gamma",
    "kv_blocks",
    "cache_lengths",
    "lookup_table",
    "layer_idx",
    "scale",
    "epsilon",
    "local_window_size",
    "w_uk",
    "w_uk_scale",
    "w_uv",
    "w_uv_scale",
)


def input_types(dtype: DType, device: DeviceRef) -> Sequence[TensorType | BufferType]:
    """Graph inputs with symbolic sizes: one compiled model serves every batch and cache shape."""
    cpu = DeviceRef.CPU()
    return [
        TensorType(dtype, ["tokens", "heads", "q_head_dim"], device),
        TensorType(DType.uint32, ["offsets"], device),
        TensorType(dtype, ["max_seq_len", "rope_dim"], device),
        TensorType(dtype, ["kv_lora_rank"], device),
        BufferType(dtype, ["num_blocks", 1, "num_layers", "page_size", 1, "cache_head_dim"], device),
        TensorType(DType.uint32, ["requests"], device),
        TensorType(DType.uint32, ["requests", "pages_per_request"], device),
        TensorType(DType.uint32, [], cpu),
        TensorType(DType.float32, [], cpu),
        TensorType(DType.float32, [], cpu),
        TensorType(DType.int32, [], cpu),
        TensorType(FP8_BYTES, ["heads", "kv_lora_rank", "nope_dim"], device),
        TensorType(DType.float32, ["heads", "uk_n_blocks", "uk_k_blocks"], device),
        TensorType(FP8_BYTES, ["heads", "v_head_dim", "kv_lora_rank"], device),
        TensorType(DType.float32, ["heads", "uv_n_blocks", "uv_k_blocks"], device),
    ]


def build_graph(config: OpConfig) -> Graph:
    """A graph whose only op is the fused op, inputs in :data:`INPUT_NAMES` order."""
    name = "pymla_mla_decode_branch_fp8"
    with Graph(
        name,
        input_types=input_types(config.dtype, config.device),
        custom_extensions=[kernels_path()],
    ) as graph:
        args = dict(zip(INPUT_NAMES, graph.inputs, strict=True))
        tensors = {k: (v if k == "kv_blocks" else v.tensor) for k, v in args.items()}
        out = mla_decode_branch_fp8_graph(
            tensors["q"],
            tensors["input_row_offsets"],
            tensors["freqs_cis"],
            tensors["kv_norm_gamma"],
            args["kv_blocks"].buffer,
            tensors["cache_lengths"],
            tensors["lookup_table"],
            tensors["layer_idx"],
            tensors["w_uk"],
            tensors["w_uk_scale"],
            tensors["w_uv"],
            tensors["w_uv_scale"],
            scale=tensors["scale"],
            epsilon=tensors["epsilon"],
            local_window_size=tensors["local_window_size"],
            scale_granularity=config.scale_granularity,
            mask=config.mask,
            score_mod=config.score_mod,
        )
        graph.output(out)
    return graph
