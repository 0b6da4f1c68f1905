"""MAX's built-in fused MLA decode op on the GPU, against pymla's reference (and pymla's own op).

The built-in op is ``mo.mla.graph.decode.paged.fp8`` (Python:
``max.nn.kernels.mla_decode_graph`` with a blockwise fp8 ``QuantConfig``). It
is GPU-only; this script runs on the device machine (see scripts/README.md)::

    python3 -m pymla.tools.max_builtin              # parity: built-in vs reference
    python3 -m pymla.tools.max_builtin --pymla      # ... and pymla's op on cuda tensors
    python3 -m pymla.tools.max_builtin --bench      # parity, then timing at DeepSeek-V3 shapes
    python3 -m pymla.tools.max_builtin --dry-run    # no GPU: build graphs and inputs, check shapes

Input conventions of the built-in op (max 26.7), and how this harness meets them
---------------------------------------------------------------------------
* ``kv [T, 576]`` (bf16 only) holds the new tokens' raw latent rows, as the
  first projection produced them. The op itself writes, for token ``i`` of
  request ``b``, ``rms_norm(kv[t, :512]) * gamma`` and ``rope(kv[t, 512:])``
  into the cache at position ``cache_lengths[b] + i`` of layer ``layer_idx``
  (``fused_rope_rmsnorm_quantization_kernel``: ``post_seq_idx =
  k_cache.cache_length(b) + token_idx``), then attends over
  ``cache_lengths[b] + n_b`` keys. pymla instead expects those raw rows
  already in the cache at those positions. The harness gives both: the cache
  copy handed to the built-in holds the raw rows at the new positions (as
  ``make_case`` wrote them) *and* ``kv`` holds the same rows, so the two ops
  see equivalent inputs whichever source the built-in reads. The kv-source
  probe (first case) poisons one source at a time to show which it reads.
* ``cache_lengths [B]`` uint32 = tokens cached before this step (pymla's
  convention). ``max_prompt_length`` = max new tokens per request,
  ``max_cache_length`` = max of ``cache_lengths[b] + n_b`` (the "valid"
  length, as MAX's cache manager builds them), both uint32 ``[1]`` on the CPU.
* ``lookup_table [B, padded_lut_cols(pages)]`` uint32: the kernel's SIMD page
  lookup over-reads up to 16 entries and multiplies every entry by the page
  stride, so columns are padded (``max.nn.kv_cache.utils.padded_lut_cols``)
  and unused entries point at an extra all-zero "null" page appended to the
  blocks (MAX allocates ``total_num_pages + 1`` and fills with
  ``total_num_pages``); pymla's 0xFFFFFFFF sentinel would fault there.
* ``page_stride`` int64 ``[1]`` on the CPU: -1 (``PACKED_PAGE_STRIDE``) for
  contiguous blocks ``[pages, 1, num_layers, page_size, 1, 576]``.
* ``scalar_args`` int64 ``[3]`` on the GPU = ``(batch_size, q_max_seq_len,
  num_partitions)`` and ``num_partitions_scalar`` int64 ``[1]`` on the CPU,
  both from ``MLAKVCacheParams.resolve_attn_key(B, max_prompt_length,
  max_cache_length)`` (which calls ``max._kv_cache_ops.mla_dispatch_args_scalar``
  with the device context) and ``MLAAttnKey.pack_into``, as MAX's runtime does.
* Mask: a compile-time parameter (``MHAMaskVariant``: causal or null; no
  window size, no score_mod). Scale and epsilon are graph constants.
* Scale granularity: ``m = input_scale.block_size[0] = 1``, ``n = k = 128``
  (``QuantConfig.blockscaled_fp8``, ``scale_granularity_override=128``):
  1x128 dynamic activation groups, 128x128 weight blocks, weight scales
  ``[H, ceil(N/128), ceil(K/128)]`` (pymla's BLOCKWISE layout); w_uk
  ``[H, 512, 128]`` fp8, w_uv ``[H, 128, 512]`` fp8.
* ``freqs_cis [max_seq_len, 64]`` interleaved (cos, sin) pairs, q's dtype;
  ``layer_idx`` a uint32 CPU scalar. The op does not modify ``q``.

Everything is sized symbolically except the head count, the layer count (2)
and the page size (128), so one compiled model per head count serves every
case and every benchmark configuration (MAX's disk cache keeps it between
calls on a warm machine).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pymla.parity import compare_cache, compare_output
from pymla.quant import BLOCKWISE, make_mla_weights
from pymla.reference import default_scale, rope_freqs_cis
from pymla.tools.scenario import make_case, run_reference

START = time.perf_counter()
RANK, NOPE, ROPE, V_HEAD = 512, 128, 64, 128
CACHE_DIM = RANK + ROPE
NUM_LAYERS, LAYER_IDX, PAGE_SIZE = 2, 1, 128
GRANULARITY = 128

# Parity cases: (heads, cached tokens per request, new tokens per request).
PARITY_CASES = [
    (16, (5, 40, 0), (1, 2, 3)),
    (16, (1000, 517, 129, 64, 127), (1, 1, 1, 1, 1)),
    (128, (300, 2000), (1, 1)),
    (128, (33, 250, 7), (2, 1, 4)),
]
QUICK_CASES = [PARITY_CASES[0], PARITY_CASES[2]]

# Built-in vs the float32 reference: both quantize to fp8, but the built-in
# rounds intermediates to bf16 (q_nope projection, attention output before
# its fp8 re-quantization, RMSNorm before gamma), so fp8 rounding flips are
# expected; a wrong convention (positions, rope pairs, pages, scales) gives
# errors of order 1.
BUILTIN_REL_L2 = 3e-2
BUILTIN_CACHE_TOL = 2**-5


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- graph


@dataclass(frozen=True)
class BuiltinConfig:
    num_heads: int
    scale: float
    epsilon: float = 1e-6
    mask: str = "causal"  # or "null"
    num_layers: int = NUM_LAYERS
    page_size: int = PAGE_SIZE


INPUT_NAMES = (
    "q",
    "kv",
    "input_row_offsets",
    "freqs_cis",
    "kv_norm_gamma",
    "w_uk",
    "w_uk_scale",
    "w_uv",
    "w_uv_scale",
    "kv_blocks",
    "page_stride",
    "cache_lengths",
    "lookup_table",
    "max_prompt_length",
    "max_cache_length",
    "layer_idx",
    "scalar_args",
    "num_partitions",
)


def input_types(cfg: BuiltinConfig, dev):
    """Graph input types, in INPUT_NAMES order (symbolic sizes except heads/layers/page)."""
    from max.dtype import DType
    from max.graph import BufferType, DeviceRef, TensorType

    cpu = DeviceRef.CPU()
    h = cfg.num_heads
    g = GRANULARITY
    return [
        TensorType(DType.bfloat16, ["tokens", h, NOPE + ROPE], dev),
        TensorType(DType.bfloat16, ["tokens", CACHE_DIM], dev),
        TensorType(DType.uint32, ["offsets"], dev),
        TensorType(DType.bfloat16, ["max_seq_len", ROPE], dev),
        TensorType(DType.bfloat16, [RANK], dev),
        TensorType(DType.float8_e4m3fn, [h, RANK, NOPE], dev),
        TensorType(DType.float32, [h, -(-RANK // g), -(-NOPE // g)], dev),
        TensorType(DType.float8_e4m3fn, [h, V_HEAD, RANK], dev),
        TensorType(DType.float32, [h, -(-V_HEAD // g), -(-RANK // g)], dev),
        BufferType(
            DType.bfloat16,
            ["total_pages", 1, cfg.num_layers, cfg.page_size, 1, CACHE_DIM],
            dev,
        ),
        TensorType(DType.int64, [1], cpu),
        TensorType(DType.uint32, ["batch"], dev),
        TensorType(DType.uint32, ["batch", "lut_cols"], dev),
        TensorType(DType.uint32, [1], cpu),
        TensorType(DType.uint32, [1], cpu),
        TensorType(DType.uint32, [], cpu),
        TensorType(DType.int64, [3], dev),
        TensorType(DType.int64, [1], cpu),
    ]


_PARAMS: dict = {}


def kv_params(cfg: BuiltinConfig, dev):
    """MLAKVCacheParams of ``cfg`` (cached per config and device: it holds a device handle)."""
    key = (cfg, str(dev))
    if key in _PARAMS:
        return _PARAMS[key]
    from max.dtype import DType
    from max.nn.kv_cache import MLAKVCacheParams

    _PARAMS[key] = MLAKVCacheParams(
        dtype=DType.bfloat16,
        head_dim=CACHE_DIM,
        num_layers=cfg.num_layers,
        devices=[dev],
        page_size=cfg.page_size,
        num_q_heads=cfg.num_heads,
    )
    return _PARAMS[key]


def build_builtin_graph(cfg: BuiltinConfig, dev):
    """A graph whose only op is MAX's ``mo.mla.graph.decode.paged.fp8``."""
    from max.graph import Graph
    from max.nn.attention.mask_config import MHAMaskVariant
    from max.nn.kernels import mla_decode_graph
    from max.nn.kv_cache.input_types import KVCacheInputsPerDevice
    from max.nn.quant_config import QuantConfig

    mask = {"causal": MHAMaskVariant.CAUSAL_MASK, "null": MHAMaskVariant.NULL_MASK}[cfg.mask]
    quant = QuantConfig.blockscaled_fp8(
        mlp_quantized_layers=[], attn_quantized_layers=[0], block_size=GRANULARITY
    )
    params = kv_params(cfg, dev)
    name = f"builtin_mla_decode_fp8_h{cfg.num_heads}"
    with Graph(name, input_types=input_types(cfg, dev)) as graph:
        v = dict(zip(INPUT_NAMES, graph.inputs, strict=True))
        t = {k: x.tensor for k, x in v.items() if k != "kv_blocks"}
        collection = KVCacheInputsPerDevice(
            kv_blocks=v["kv_blocks"].buffer,
            cache_lengths=t["cache_lengths"],
            lookup_table=t["lookup_table"],
            max_prompt_length=t["max_prompt_length"],
            max_cache_length=t["max_cache_length"],
            page_stride=t["page_stride"],
        )
        out = mla_decode_graph(
            q=t["q"],
            kv=t["kv"],
            input_row_offsets=t["input_row_offsets"],
            freqs_cis=t["freqs_cis"],
            kv_norm_gamma=t["kv_norm_gamma"],
            w_uk=t["w_uk"],
            w_uv=t["w_uv"],
            kv_params=params,
            kv_collection=collection,
            layer_idx=t["layer_idx"],
            mask_variant=mask,
            scale=cfg.scale,
            epsilon=cfg.epsilon,
            v_head_dim=V_HEAD,
            scalar_args=t["scalar_args"],
            num_partitions_scalar=t["num_partitions"],
            w_uk_scale=t["w_uk_scale"],
            w_uv_scale=t["w_uv_scale"],
            quant_config=quant,
            scale_granularity_override=GRANULARITY,
        )
        graph.output(out)
    return graph


# --------------------------------------------------------------------------- inputs


def padded_cols(pages: int) -> int:
    try:
        from max.nn.kv_cache.utils import padded_lut_cols

        return padded_lut_cols(pages)
    except ImportError:  # same rule as max 26.7
        return ((pages + 7) // 8) * 8 + 16


def dispatch_scalars(cfg: BuiltinConfig, batch: int, max_prompt: int, max_cache: int, dry: bool):
    """(scalar_args int64[3], num_partitions int64[1]) as MAX's runtime resolves them."""
    if dry:
        return torch.tensor([batch, max_prompt, 1], dtype=torch.int64), torch.tensor(
            [1], dtype=torch.int64
        )
    from max.graph import DeviceRef

    try:
        key = kv_params(cfg, DeviceRef.GPU()).resolve_attn_key(batch, max_prompt, max_cache)
        packed = np.zeros(3, dtype=np.int64)
        key.pack_into(packed, max_cache)
        values, parts = packed.tolist(), int(key.num_partitions)
    except Exception as exc:  # noqa: BLE001
        log(f"  resolve_attn_key failed ({exc!r}); calling mla_dispatch_args_scalar directly")
        from max import driver
        from max._kv_cache_ops import mla_dispatch_args_scalar

        b, p, n = mla_dispatch_args_scalar(
            batch, max_cache, max_prompt, cfg.num_heads, False, driver.Accelerator(0)
        )
        values, parts = [b, p, n], int(n)
    return torch.tensor(values, dtype=torch.int64), torch.tensor([parts], dtype=torch.int64)


def case_inputs(case, cfg: BuiltinConfig, dry: bool = False) -> dict[str, torch.Tensor]:
    """The built-in op's inputs (CPU tensors) equivalent to a pymla ``Case``."""
    cache = case.cache
    offsets = [int(v) for v in case.input_row_offsets.tolist()]
    new = [offsets[b + 1] - offsets[b] for b in range(len(offsets) - 1)]
    lengths = [cache.length(b) for b in range(len(new))]
    # The raw new rows, as make_case appended them (before any rotation/normalization).
    kv = torch.cat(
        [cache.rows(b, case.layer_idx, lengths[b], lengths[b] + n) for b, n in enumerate(new)]
        + [torch.zeros(0, CACHE_DIM, dtype=cache.dtype)]
    )
    num_blocks = cache.blocks.shape[0]
    null_page = torch.zeros_like(cache.blocks[:1])
    blocks = torch.cat([cache.blocks, null_page]).contiguous()
    max_cache = max(c + n for c, n in zip(lengths, new, strict=True))
    pages = [cache.pages_of(b) for b in range(len(new))]
    cols = padded_cols(max([-(-max_cache // cache.page_size)] + [len(p) for p in pages]))
    lut = torch.full((len(new), cols), num_blocks, dtype=torch.int64)
    for b, p in enumerate(pages):
        lut[b, : len(p)] = torch.tensor(p, dtype=torch.int64)
    scalar_args, parts = dispatch_scalars(cfg, len(new), max(new), max_cache, dry)
    w = case.weights
    return {
        "q": case.q.contiguous(),
        "kv": kv.contiguous(),
        "input_row_offsets": case.input_row_offsets.to(torch.uint32),
        "freqs_cis": case.freqs_cis,
        "kv_norm_gamma": case.kv_norm_gamma,
        "w_uk": w["w_uk"],
        "w_uk_scale": w["w_uk_scale"],
        "w_uv": w["w_uv"],
        "w_uv_scale": w["w_uv_scale"],
        "kv_blocks": blocks,
        "page_stride": torch.tensor([-1], dtype=torch.int64),
        "cache_lengths": torch.tensor(lengths, dtype=torch.int64).to(torch.uint32),
        "lookup_table": lut.to(torch.uint32),
        "max_prompt_length": torch.tensor([max(new)], dtype=torch.int64).to(torch.uint32),
        "max_cache_length": torch.tensor([max_cache], dtype=torch.int64).to(torch.uint32),
        "layer_idx": torch.tensor(case.layer_idx, dtype=torch.int64).to(torch.uint32),
        "scalar_args": scalar_args,
        "num_partitions": parts,
    }


CPU_INPUTS = ("page_stride", "max_prompt_length", "max_cache_length", "layer_idx", "num_partitions")


def to_device(inputs: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: (v if k in CPU_INPUTS else v.to(device)) for k, v in inputs.items()}


def check_against_types(inputs: dict[str, torch.Tensor], types) -> list[str]:
    """Mismatches between tensors and graph input types (dtype, rank, static dims, symbols)."""
    from max.dtype import DType

    to_max = {
        torch.bfloat16: DType.bfloat16,
        torch.float32: DType.float32,
        torch.float8_e4m3fn: DType.float8_e4m3fn,
        torch.uint32: DType.uint32,
        torch.int64: DType.int64,
    }
    problems, symbols = [], {}
    for name, ty in zip(INPUT_NAMES, types, strict=True):
        t = inputs[name]
        if to_max.get(t.dtype) != ty.dtype:
            problems.append(f"{name}: dtype {t.dtype} vs {ty.dtype}")
        dims = list(ty.shape)
        if t.dim() != len(dims):
            problems.append(f"{name}: rank {t.dim()} vs {len(dims)}")
            continue
        for i, d in enumerate(dims):
            s = str(d)
            if s.lstrip("-").isdigit():
                if int(s) != t.shape[i]:
                    problems.append(f"{name}: dim {i} is {t.shape[i]}, graph wants {s}")
            elif symbols.setdefault(s, t.shape[i]) != t.shape[i]:
                problems.append(f"{name}: dim {i} ({s}) is {t.shape[i]}, was {symbols[s]}")
    if symbols.get("offsets") != symbols.get("batch", -1) + 1:
        problems.append(f"offsets {symbols.get('offsets')} != batch + 1")
    return problems


# --------------------------------------------------------------------------- running


class Runner:
    """Compiles built-in graphs (one per config) and runs them on torch tensors."""

    def __init__(self, transfer: str = "auto"):
        from max import driver, engine

        self.driver = driver
        self.accel = driver.Accelerator(0)
        self.session = engine.InferenceSession(devices=[self.accel])
        self.models = {}
        self.transfer = transfer  # auto | dlpack | copy

    def model(self, cfg: BuiltinConfig):
        if cfg not in self.models:
            from max.graph import DeviceRef

            log(f"compiling built-in graph for {cfg} ...")
            t0 = time.perf_counter()
            graph = build_builtin_graph(cfg, DeviceRef.GPU())
            self.models[cfg] = self.session.load(graph)
            log(f"compiled in {time.perf_counter() - t0:.1f} s")
        return self.models[cfg]

    def _buffer(self, t: torch.Tensor):
        from max.dtype import DType

        fp8 = t.dtype == torch.float8_e4m3fn
        src = t.contiguous().view(torch.uint8) if fp8 else t.contiguous()
        if t.device.type == "cpu":
            buf = self.driver.Buffer.from_dlpack(src)
        elif self.transfer == "copy":
            buf = self.driver.Buffer.from_dlpack(src.cpu()).to(self.accel)
        else:
            try:
                buf = self.driver.Buffer.from_dlpack(src)
            except Exception as exc:
                if self.transfer == "dlpack":
                    raise
                log(f"  DLPack of a cuda tensor failed ({exc!r}); copying through the host")
                self.transfer = "copy"
                buf = self.driver.Buffer.from_dlpack(src.cpu()).to(self.accel)
        return buf.view(DType.float8_e4m3fn) if fp8 else buf

    def buffers(self, inputs: dict[str, torch.Tensor]) -> list:
        torch.cuda.synchronize()
        return [self._buffer(inputs[name]) for name in INPUT_NAMES]

    def execute(self, cfg: BuiltinConfig, buffers: list):
        out = self.model(cfg).execute(*buffers)
        self.accel.synchronize()
        return out

    def to_torch(self, buf) -> torch.Tensor:
        try:
            return torch.from_dlpack(buf).clone()
        except Exception:  # noqa: BLE001
            return torch.from_dlpack(buf.to(self.driver.CPU())).clone()

    def run(self, cfg: BuiltinConfig, inputs: dict[str, torch.Tensor]):
        """(output [T, H, 128], kv_blocks after the call), as CPU tensors."""
        buffers = self.buffers(inputs)
        out = self.execute(cfg, buffers)
        blocks = buffers[INPUT_NAMES.index("kv_blocks")]
        return self.to_torch(out[0]).cpu(), self.to_torch(blocks).cpu()


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o, r = out.float().cpu(), ref.float().cpu()
    finite = bool(torch.isfinite(o).all())
    diff = (o - r).nan_to_num(nan=float("inf"))
    return {
        "finite": finite,
        "rel_l2": float(diff.norm() / r.norm()) if finite else float("inf"),
        "max_rel": float(diff.abs().max() / r.abs().max()) if finite else float("inf"),
    }


# --------------------------------------------------------------------------- parity


def parity(args, runner: Runner | None) -> list[dict]:
    if args.cases:
        chosen = [int(x) for x in args.cases.split(",")]
    else:
        chosen = [PARITY_CASES.index(c) for c in QUICK_CASES] if args.quick else None
    results = []
    probed = False
    for i, (heads, cached, new) in enumerate(PARITY_CASES):
        if chosen is not None and i not in chosen:
            continue
        cfg = BuiltinConfig(num_heads=heads, scale=default_scale(), mask=args.mask)
        log(f"parity case {i}: {heads} heads, cached {list(cached)}, new {list(new)}, {args.mask}")
        case = make_case(
            100 + i,
            num_heads=heads,
            page_size=PAGE_SIZE,
            cache_lengths=cached,
            new_tokens=new,
            num_layers=NUM_LAYERS,
            layer_idx=LAYER_IDX,
            granularity="blockwise",
            mask=args.mask,
        )
        case.options["scale"] = cfg.scale
        case.options["epsilon"] = cfg.epsilon
        inputs = case_inputs(case, cfg, dry=runner is None)
        row = {"case": i, "heads": heads, "cached": list(cached), "new": list(new)}
        if runner is None:
            problems = check_against_types(inputs, input_types(cfg, _gpu_ref()))
            shapes = {k: list(v.shape) for k, v in inputs.items()}
            log(f"  inputs {problems if problems else 'OK'}: {shapes}")
            problems += emulate_check(case, inputs)
            row["input_problems"] = problems
            results.append(row)
            continue

        ref_out, ref_blocks = run_reference(case)
        before = case.cache.blocks
        updated = case.new_rows_mask()
        nb = before.shape[0]
        out = None
        try:
            out, blocks = runner.run(cfg, to_device(inputs, "cuda"))
            e = errors(out, ref_out)
            strict = compare_output(out, ref_out)
            crep = compare_cache(before, blocks[:nb], ref_blocks, updated)
            ok = (
                e["finite"]
                and e["rel_l2"] <= BUILTIN_REL_L2
                and crep.max_row_error <= BUILTIN_CACHE_TOL
                and crep.untouched_identical
            )
            row["builtin"] = {
                **e,
                "strict_pymla_tolerance": strict.passed,
                "cache_row_err": crep.max_row_error,
                "cache_untouched_identical": crep.untouched_identical,
                "pass": ok,
            }
            log(
                f"  built-in vs reference: rel L2 {e['rel_l2']:.3g}, max {e['max_rel']:.3g} x max|ref| "
                f"-> {'PASS' if ok else 'FAIL'} (allowed rel L2 {BUILTIN_REL_L2})"
            )
            log(f"    pymla's strict tolerance: {strict.describe()}")
            log(f"    cache: {crep.describe()}; built-in allowance {BUILTIN_CACHE_TOL:.3g}")
            if not probed and not args.no_probe:
                probed = True
                row["kv_source"] = probe_kv_source(runner, cfg, inputs, ref_out, updated, nb)
        except Exception as exc:  # noqa: BLE001
            log(f"  built-in FAILED: {exc!r}")
            traceback.print_exc()
            row["builtin"] = {"error": repr(exc)[:500], "pass": False}

        if args.pymla:
            row["pymla"] = pymla_parity(case, before, ref_out, ref_blocks, updated, out)
        results.append(row)
    return results


def emulate_check(case, inputs: dict[str, torch.Tensor]) -> list[str]:
    """Offline check of the harness: the built-in's documented cache write, done in torch.

    Writes ``rms_norm(kv[t, :512]) * gamma`` and ``rope(kv[t, 512:])`` at position
    ``cache_lengths[b] + i`` through the padded lookup table into the extended
    blocks, and checks that the result equals the reference's cache after the
    call, and that every visible row reads the same through both lookup tables.
    """
    from pymla.reference import rms_norm, rope_interleaved

    _, ref_blocks = run_reference(case)
    blocks = inputs["kv_blocks"].clone()
    lut = inputs["lookup_table"].to(torch.int64)
    lengths = inputs["cache_lengths"].to(torch.int64).tolist()
    offsets = inputs["input_row_offsets"].to(torch.int64).tolist()
    kv, layer, eps = inputs["kv"].float(), int(inputs["layer_idx"]), case.options["epsilon"]
    problems = []
    for b in range(len(lengths)):
        for t in range(offsets[b], offsets[b + 1]):
            pos = lengths[b] + t - offsets[b]
            page = int(lut[b, pos // PAGE_SIZE])
            row = torch.cat(
                [
                    rms_norm(kv[t, :RANK], inputs["kv_norm_gamma"], eps),
                    rope_interleaved(kv[t, RANK:], inputs["freqs_cis"][pos]),
                ]
            )
            blocks[page, 0, layer, pos % PAGE_SIZE, 0] = row.to(blocks.dtype)
        visible = lengths[b] + offsets[b + 1] - offsets[b]
        pos = torch.arange(visible)
        mine = blocks[lut[b, pos // PAGE_SIZE], 0, layer, pos % PAGE_SIZE, 0]
        pages = torch.tensor(case.cache.pages_of(b))[pos // PAGE_SIZE]
        theirs = ref_blocks[pages, 0, layer, pos % PAGE_SIZE, 0]
        if not torch.equal(mine, theirs):
            problems.append(f"request {b}: emulated cache rows differ from the reference's")
    nb = ref_blocks.shape[0]
    if not torch.equal(blocks[:nb], ref_blocks):
        problems.append("emulated cache write differs from the reference's cache")
    if int(lut.max()) != nb or bool((blocks[nb] != 0).any()):
        problems.append("null page / lookup-table fill wrong")
    log(f"  emulated built-in cache write vs reference: {problems if problems else 'identical'}")
    return problems


def probe_kv_source(runner, cfg, inputs, ref_out, updated, nb) -> str:
    """Which source of the new rows the built-in reads: poison one at a time."""
    verdict = {}
    for poisoned in ("cache", "kv"):
        probe = dict(inputs)
        if poisoned == "cache":
            blocks = inputs["kv_blocks"].clone()
            blocks[:nb][updated] = float("nan")
            probe["kv_blocks"] = blocks
        else:
            probe["kv"] = torch.full_like(inputs["kv"], float("nan"))
        out, _ = runner.run(cfg, to_device(probe, "cuda"))
        e = errors(out, ref_out)
        verdict[poisoned] = e["finite"] and e["rel_l2"] <= BUILTIN_REL_L2
        log(
            f"  probe: new rows NaN in {poisoned:5s} -> output {'still right' if verdict[poisoned] else 'WRONG'}"
        )
    if verdict["cache"] and not verdict["kv"]:
        source = "kv"
    elif verdict["kv"] and not verdict["cache"]:
        source = "cache"
    else:
        source = f"unclear {verdict}"
    log(f"  => the built-in takes the new tokens' rows from: {source}")
    return source


def pymla_parity(case, before, ref_out, ref_blocks, updated, builtin_out) -> dict:
    try:
        import pymla

        gpu = copy.deepcopy(case).to("cuda")
        t0 = time.perf_counter()
        out = pymla.mla_decode_branch_fp8(*gpu.args(), **gpu.options)
        torch.cuda.synchronize()
        log(f"  pymla op on cuda ran in {time.perf_counter() - t0:.1f} s (first call compiles)")
        rep = compare_output(out.cpu(), ref_out)
        crep = compare_cache(before, gpu.cache.blocks.cpu(), ref_blocks, updated)
        e = errors(out, ref_out)
        log(f"  pymla vs reference: {rep.describe()} -> {'PASS' if rep.passed else 'FAIL'}")
        log(f"    cache: {crep.describe()} -> {'PASS' if crep.passed else 'FAIL'}")
        res = {**e, "pass": rep.passed and crep.passed, "cache_row_err": crep.max_row_error}
        if builtin_out is not None:
            vs = errors(out.cpu(), builtin_out)
            res["vs_builtin_rel_l2"] = vs["rel_l2"]
            log(f"  pymla vs built-in: rel L2 {vs['rel_l2']:.3g}, max {vs['max_rel']:.3g}")
        return res
    except Exception as exc:  # noqa: BLE001
        log(f"  pymla op on cuda FAILED (expected until the GPU port): {exc!r}")
        traceback.print_exc(limit=3)
        return {"error": repr(exc)[:500], "pass": False}


# --------------------------------------------------------------------------- bench


def bench_inputs(heads, batch, ctx, pool, weights, freqs, gamma, gen_device, cfg, dry):
    """Inputs for ``batch`` requests with ``ctx`` cached tokens and 1 new token each."""
    total_pages = pool.shape[0] - 1  # the last page is the null page
    ppr = -(-(ctx + 1) // PAGE_SIZE)
    need = batch * ppr
    if need > total_pages:
        raise ValueError(f"pool has {total_pages} pages, need {need}")
    # Index tensors are made on the CPU and moved as uint32 (torch's uint32 support on
    # cuda is limited to copies).
    perm = torch.randperm(total_pages)[:need].view(batch, ppr)
    lut = torch.full((batch, padded_cols(ppr)), total_pages, dtype=torch.int64)
    lut[:, :ppr] = perm
    scalar_args, parts = dispatch_scalars(cfg, batch, 1, ctx + 1, dry)

    def u32(values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64).to(torch.uint32)

    return {
        "q": torch.randn(batch, heads, NOPE + ROPE, device=gen_device).to(torch.bfloat16),
        "kv": (torch.randn(batch, CACHE_DIM, device=gen_device) * 2 + 0.5).to(torch.bfloat16),
        "input_row_offsets": u32(torch.arange(batch + 1)).to(gen_device),
        "freqs_cis": freqs,
        "kv_norm_gamma": gamma,
        **weights,
        "kv_blocks": pool,
        "page_stride": torch.tensor([-1], dtype=torch.int64),
        "cache_lengths": u32(torch.full((batch,), ctx)).to(gen_device),
        "lookup_table": u32(lut).to(gen_device),
        "max_prompt_length": u32([1]),
        "max_cache_length": u32([ctx + 1]),
        "layer_idx": u32(LAYER_IDX),
        "scalar_args": scalar_args.to(gen_device),
        "num_partitions": parts,
    }


def bytes_moved(heads, batch, ctx) -> int:
    """Fewest bytes through device memory: cache rows read once, weights, q, kv and output."""
    cache = batch * (ctx + 1) * CACHE_DIM * 2
    weights = heads * (RANK * NOPE + V_HEAD * RANK) + heads * 8 * 4
    io = batch * heads * (NOPE + ROPE) * 2 + batch * CACHE_DIM * 2 + batch * heads * V_HEAD * 2
    return cache + weights + io


def time_it(fn, warmup: int, repeat: int) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), min(samples)


def bench(args, runner: Runner | None, results: dict, save) -> None:
    dry = runner is None
    dev = "cpu" if dry else "cuda"
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    heads_list = [int(x) for x in args.heads.split(",")]
    if dry:  # shapes only, small
        batches, contexts = batches[:2], contexts[:1]
    max_pages = max(b * -(-(c + 1) // PAGE_SIZE) for b in batches for c in contexts)
    pool_gb = (max_pages + 1) * NUM_LAYERS * PAGE_SIZE * CACHE_DIM * 2 / 1e9
    log(f"bench: heads {heads_list}, batches {batches}, contexts {contexts}; pool {pool_gb:.1f} GB")
    shape = (max_pages + 1, 1, NUM_LAYERS, PAGE_SIZE, 1, CACHE_DIM)
    if not dry:
        results["hbm_copy_bytes_per_s"] = measure_copy_bandwidth()
        log(
            f"device-to-device copy: {results['hbm_copy_bytes_per_s'] / 1e9:.0f} GB/s (read + write)"
        )
    pool = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_()
    freqs = rope_freqs_cis(max(contexts) + 8, ROPE).to(torch.bfloat16).to(dev)
    gamma = (1 + 0.25 * torch.randn(RANK)).to(torch.bfloat16).to(dev)
    rows = results.setdefault("bench", [])
    pymla_ok = args.pymla and not dry
    for heads in heads_list:
        cfg = BuiltinConfig(num_heads=heads, scale=default_scale())
        w = make_mla_weights(heads, granularity=BLOCKWISE)
        weights = {k: w[k].to(dev) for k in ("w_uk", "w_uk_scale", "w_uv", "w_uv_scale")}
        plain = plain_torch_formulations(weights, cfg) if args.plain_torch else {}
        if not dry:
            runner.model(cfg)
        for batch in batches:
            for ctx in contexts:
                if time.perf_counter() - START > args.time_budget:
                    log(f"time budget {args.time_budget} s reached: stopping the sweep")
                    results["truncated"] = True
                    return
                row = {"h": heads, "b": batch, "ctx": ctx}
                try:
                    inputs = bench_inputs(
                        heads, batch, ctx, pool, weights, freqs, gamma, dev, cfg, dry
                    )
                    if dry:
                        problems = check_against_types(inputs, input_types(cfg, _gpu_ref()))
                        log(
                            f"  h{heads} b{batch} ctx{ctx}: inputs {problems if problems else 'OK'}"
                        )
                        row["input_problems"] = problems
                        for kind, fn in plain.items():  # runs once on the CPU: inputs fit it
                            fn(*plain_torch_args(inputs))
                            log(f"  h{heads} b{batch} ctx{ctx}: plain torch ({kind}) ran")
                        rows.append(row)
                        continue
                    bufs = runner.buffers(inputs)
                    med, best = time_it(
                        lambda bufs=bufs, cfg=cfg: runner.execute(cfg, bufs),
                        args.warmup,
                        args.repeat,
                    )
                    gbps = bytes_moved(heads, batch, ctx) / med / 1e9
                    row.update(builtin_ms=round(med * 1e3, 4), builtin_min_ms=round(best * 1e3, 4))
                    row["builtin_gbps"] = round(gbps, 1)
                    msg = f"  h{heads:3d} b{batch:3d} ctx{ctx:6d}: built-in {med * 1e3:8.3f} ms ({gbps:6.0f} GB/s)"
                    if pymla_ok:
                        try:
                            pm = time_pymla(inputs, cfg, args)
                            pk = time_pymla_kernel(inputs, cfg, args)
                            row["pymla_ms"] = round(pm * 1e3, 4)
                            row["pymla_kernel_ms"] = round(pk * 1e3, 4)
                            msg += f"  pymla {pm * 1e3:8.3f} ms (kernel {pk * 1e3:8.3f} ms)"
                            hbm = results.get("hbm_copy_bytes_per_s")
                            if hbm:
                                moved = bytes_moved(heads, batch, ctx)
                                row["builtin_hbm_fraction"] = round(moved / med / hbm, 4)
                                row["pymla_kernel_hbm_fraction"] = round(moved / pk / hbm, 4)
                        except Exception as exc:  # noqa: BLE001
                            log(f"  pymla op failed, not timing it further: {exc!r}")
                            results["pymla_error"] = repr(exc)[:500]
                            pymla_ok = False
                    if plain:
                        kind, seconds = time_plain_torch(plain, inputs, args)
                        row["plain_torch_ms"] = round(seconds * 1e3, 4)
                        row["plain_torch_attention"] = kind
                        msg += f"  plain torch {seconds * 1e3:8.3f} ms ({kind})"
                    log(msg)
                except Exception as exc:  # noqa: BLE001
                    log(f"  h{heads} b{batch} ctx{ctx}: FAILED {exc!r}")
                    row["error"] = repr(exc)[:300]
                rows.append(row)
        save()


def plain_torch_formulations(weights: dict, cfg: BuiltinConfig) -> dict:
    """pymla's plain-torch baseline (weights dequantized once), matmul and SDPA attention."""
    from pymla.tools.plain_torch import PlainTorchDecode

    return {
        kind: PlainTorchDecode(
            weights["w_uk"],
            weights["w_uk_scale"],
            weights["w_uv"],
            weights["w_uv_scale"],
            dtype=torch.bfloat16,
            scale=cfg.scale,
            epsilon=cfg.epsilon,
            attention=kind,
        )
        for kind in ("matmul", "sdpa")
    }


def plain_torch_args(inputs: dict) -> tuple:
    """The positional arguments of a ``PlainTorchDecode`` call on bench inputs."""
    from pymla.reference import KVCacheTensors

    cache = KVCacheTensors(inputs["kv_blocks"], inputs["cache_lengths"], inputs["lookup_table"])
    return (
        inputs["q"],
        inputs["input_row_offsets"],
        inputs["freqs_cis"],
        inputs["kv_norm_gamma"],
        cache,
        LAYER_IDX,
    )


def time_plain_torch(plain: dict, inputs: dict, args) -> tuple[str, float]:
    """The faster plain-torch formulation on ``inputs`` and its median seconds per call."""
    call_args = plain_torch_args(inputs)
    seconds = {}
    for kind, fn in plain.items():

        def call(fn=fn):
            fn(*call_args)
            torch.cuda.synchronize()

        seconds[kind] = time_it(call, args.warmup, args.repeat)[0]
    kind = min(seconds, key=seconds.get)
    return kind, seconds[kind]


def measure_copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """Bytes per second of a device-to-device torch copy, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
        torch.cuda.synchronize()

    seconds = time_it(copy, 3, 10)[0]
    return 2 * nbytes / seconds


def pymla_lookup_table(inputs: dict) -> torch.Tensor:
    """The bench lookup table with the built-in's null-page entries (past the pool) set to 0.

    pymla checks only the entries a request uses; the rest are kept in range anyway.
    """
    nb = inputs["kv_blocks"].shape[0] - 1
    lut = inputs["lookup_table"].cpu().to(torch.int64)
    lut[lut >= nb] = 0
    return lut.to(torch.uint32).to(inputs["lookup_table"].device)


def time_pymla_kernel(inputs, cfg, args) -> float:
    """pymla's compiled model alone on prepared buffers (no input checks), like the built-in."""
    from pymla import bridge, runtime
    from pymla.graph import INPUT_NAMES, mask_code, score_mod_code

    q = inputs["q"]
    tensors = {
        "output": torch.empty(q.shape[0], q.shape[1], V_HEAD, dtype=q.dtype, device=q.device),
        "attention_output": q.new_empty(0, 1, 1),  # not wanted
        "new_rows": q.new_empty(0, 1),  # the rows are in the cache
        "q": q,
        "input_row_offsets": inputs["input_row_offsets"],
        "freqs_cis": inputs["freqs_cis"],
        "kv_norm_gamma": inputs["kv_norm_gamma"],
        "kv_blocks": inputs["kv_blocks"],
        "cache_lengths": inputs["cache_lengths"],
        "lookup_table": pymla_lookup_table(inputs),
        "layer_idx": torch.tensor(LAYER_IDX, dtype=torch.uint32),
        "scale": torch.tensor(cfg.scale, dtype=torch.float32),
        "epsilon": torch.tensor(cfg.epsilon, dtype=torch.float32),
        "mask": torch.tensor(mask_code(cfg.mask), dtype=torch.int32),
        "score_mod": torch.tensor(score_mod_code("no_pos"), dtype=torch.int32),
        "local_window_size": torch.tensor(0, dtype=torch.int32),
        "m_scale_granularity": torch.tensor(1, dtype=torch.int32),
        "n_scale_granularity": torch.tensor(128, dtype=torch.int32),
        "k_scale_granularity": torch.tensor(128, dtype=torch.int32),
        "w_uk": inputs["w_uk"].view(torch.uint8),
        "w_uk_scale": inputs["w_uk_scale"],
        "w_uv": inputs["w_uv"].view(torch.uint8),
        "w_uv_scale": inputs["w_uv_scale"],
    }
    model = runtime.model_for(q.dtype, q.device)
    accel = runtime.session(q.device)[1]
    buffers = [bridge.to_max(tensors[name]) for name in INPUT_NAMES]
    torch.cuda.synchronize()

    def call():
        model.execute(*buffers)
        accel.synchronize()

    return time_it(call, args.warmup, args.repeat)[0]


def time_pymla(inputs, cfg, args) -> float:
    import pymla

    cache = (inputs["kv_blocks"], inputs["cache_lengths"], pymla_lookup_table(inputs))

    def call():
        pymla.mla_decode_branch_fp8(
            inputs["q"],
            inputs["input_row_offsets"],
            inputs["freqs_cis"],
            inputs["kv_norm_gamma"],
            cache,
            LAYER_IDX,
            inputs["w_uk"],
            inputs["w_uk_scale"],
            inputs["w_uv"],
            inputs["w_uv_scale"],
            scale=cfg.scale,
            epsilon=cfg.epsilon,
            scale_granularity="blockwise",
            mask=cfg.mask,
        )
        torch.cuda.synchronize()

    return time_it(call, args.warmup, args.repeat)[0]


# --------------------------------------------------------------------------- main


def _gpu_ref():
    from max.graph import DeviceRef

    return DeviceRef.GPU()


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        from importlib.metadata import version

        env["max"] = version("max")
    except Exception as exc:  # noqa: BLE001
        env["max"] = f"unknown: {exc!r}"
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def compact_json(results: dict) -> str:
    """One line per top-level key, and one per row of a list (small and diffable)."""
    lines = []
    for key, value in results.items():
        if isinstance(value, list):
            rows = ",\n  ".join(json.dumps(r, default=str) for r in value)
            lines.append(f"{json.dumps(key)}: [\n  {rows}\n]")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value, default=str)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dry-run", action="store_true", help="no GPU: build graphs and inputs, check shapes"
    )
    p.add_argument("--bench", action="store_true", help="time the built-in op after parity")
    p.add_argument("--bench-only", action="store_true", help="skip parity")
    p.add_argument("--pymla", action="store_true", help="also run pymla's own op on cuda tensors")
    p.add_argument(
        "--plain-torch",
        action="store_true",
        help="also time pymla's plain-torch formulation (the faster of matmul and SDPA attention)",
    )
    p.add_argument("--quick", action="store_true", help="parity cases 0 and 2 only")
    p.add_argument(
        "--cases", default="", help="parity case indices, e.g. 0,1 (16 heads) or 2,3 (128)"
    )
    p.add_argument("--no-probe", action="store_true", help="skip the kv-source probe")
    p.add_argument("--mask", choices=("causal", "null"), default="causal")
    p.add_argument("--heads", default="16,128")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    p.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument(
        "--time-budget", type=float, default=500.0, help="stop the sweep after this many seconds"
    )
    p.add_argument("--transfer", choices=("auto", "dlpack", "copy"), default="auto")
    p.add_argument(
        "--json",
        default="benchmarks/results/gpu_builtin.json",
        help="results file (a relative path is under the current folder, the checkout's root)",
    )
    args = p.parse_args(argv)

    env = environment()
    log(f"gpu_builtin: {env}")
    results: dict = {"env": env, "args": vars(args)}
    out_paths = [Path(args.json)]
    if os.environ.get("OUT") and not args.dry_run:
        in_out = Path(os.environ["OUT"]) / Path(args.json).name
        if in_out.resolve() != out_paths[0].resolve():
            out_paths.append(in_out)

    def save() -> None:
        if args.dry_run:
            return
        for path in out_paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(compact_json(results))
        log(f"wrote {', '.join(map(str, out_paths))}")

    log("importing max.nn (compiles max/_kv_cache_ops the first time, ~15 s) ...")
    import max.nn.kernels  # noqa: F401

    runner = None
    if args.dry_run:
        for heads in (int(x) for x in args.heads.split(",")):
            cfg = BuiltinConfig(num_heads=heads, scale=default_scale(), mask=args.mask)
            graph = build_builtin_graph(cfg, _gpu_ref())
            ops = [
                line.split("symbol = ")[1].split(",")[0]
                for line in str(graph).splitlines()
                if "mo.custom" in line
            ]
            log(f"graph for {heads} heads built on DeviceRef.GPU(): custom ops {ops}")
    else:
        if not torch.cuda.is_available():
            log("no CUDA device visible to torch; use --dry-run on a machine without a GPU")
            return 2
        from max import driver

        log(f"MAX accelerators: {driver.accelerator_count()}")
        runner = Runner(args.transfer)

    status = 0
    if not args.bench_only:
        results["parity"] = parity(args, runner)
        save()
        if not args.dry_run:
            failed = [r["case"] for r in results["parity"] if not r.get("builtin", {}).get("pass")]
            log(f"parity: built-in {'all PASS' if not failed else f'FAIL in cases {failed}'}")
            status = 1 if failed else 0
    if args.bench or args.bench_only or args.dry_run:
        bench(args, runner, results, save)
        save()
    if args.dry_run:
        problems = [
            r
            for r in results.get("parity", []) + results.get("bench", [])
            if r.get("input_problems")
        ]
        log(f"dry run: {problems if problems else 'all inputs match the graph types'}")
        status = 1 if problems else 0
    summary(results)
    log("done")
    return status


def summary(results: dict) -> None:
    """A short table last: the device reply carries the end of the output."""
    for r in results.get("parity", []):
        b = r.get("builtin", {})
        p = r.get("pymla", {})
        line = f"case {r['case']} h{r['heads']}: built-in "
        line += (
            f"rel L2 {b['rel_l2']:.3g} cache {b['cache_row_err']:.3g} {'PASS' if b['pass'] else 'FAIL'}"
            if "rel_l2" in b
            else b.get("error", "not run")[:80]
        )
        if p:
            line += f" | pymla {'PASS' if p.get('pass') else 'FAIL'}"
            line += f" rel L2 {p['rel_l2']:.3g}" if "rel_l2" in p else f" {p.get('error', '')[:60]}"
        if "kv_source" in r:
            line += f" | new rows read from: {r['kv_source']}"
        print(line, flush=True)
    rows = [r for r in results.get("bench", []) if "builtin_ms" in r]
    if rows:
        print("heads batch context built-in_ms GB/s pymla_ms", flush=True)
        for r in rows:
            pm = r.get("pymla_ms", "-")
            print(
                f"{r['h']:5d} {r['b']:5d} {r['ctx']:7d} {r['builtin_ms']:11.3f} "
                f"{r['builtin_gbps']:6.0f} {pm}",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
