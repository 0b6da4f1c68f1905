"""``python -m pymla bench``: time per call of the op, the torch reference and plain torch.

For DeepSeek-V3 shapes (kv_lora_rank 512, rope 64, fp8 128x128 weights, bf16,
causal mask, one new token per request), over heads x batch x context x
page size, all measured in the same run, with:

- ``bytes``: what a call must read at least: every visible cache row
  (576 values per token), both fp8 weight tensors and their scales, q; and
  write: the output and the new cache rows;
- ``floor``: ``bytes`` / the machine's memory bandwidth, measured in the same
  run as a large ``copy_`` (read + write);
- ``bw``: the op's achieved bytes/s as a share of that bandwidth;
- ``GFLOP/s``: the op's rate of multiply-adds (x2) of attention and both
  projections, beside a large float32 torch ``mm``'s rate measured in the same
  run: decode with many heads is compute-bound on a CPU (16 heads do about
  30 flops per byte of cache, 128 heads 240), so the bandwidth floor is out
  of reach there;
- speed-ups of the op over the reference and over plain torch
  (:mod:`pymla.plain_torch`: the faster of its matmul and SDPA attention).

The table is printed and saved as JSON and a PNG plot under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import sys
from pathlib import Path

import torch

from .op import mla_decode_branch_fp8
from .plain_torch import PlainTorchDecode
from .scenario import Case, make_case, run_reference
from .timing import time_call

DEFAULT_OUT = Path("benchmarks/results")


def measure_bandwidth(nbytes: int = 512 * 2**20) -> float:
    """Bytes per second of a large torch copy (counting the read and the write)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), warmup=2, repeat=7)
    return 2 * nbytes / seconds


def measure_flops(n: int = 2048) -> float:
    """Float32 flops per second of a large torch matmul (the machine's practical compute peak)."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    seconds = time_call(lambda: a @ b, warmup=2, repeat=5)
    return 2 * n**3 / seconds


def bytes_per_call(case: Case) -> int:
    """Least traffic of one call: cache rows read, weights, q, output and new rows written."""
    elem = case.q.element_size()
    offsets = case.input_row_offsets.tolist()
    visible = sum(
        case.cache.length(b) + offsets[b + 1] - offsets[b] for b in range(len(offsets) - 1)
    )
    row = case.cache.head_dim * elem
    weights = sum(
        case.weights[k].numel() * case.weights[k].element_size()
        for k in ("w_uk", "w_uk_scale", "w_uv", "w_uv_scale")
    )
    new_rows = case.q.shape[0] * row
    return (
        visible * row
        + weights
        + case.q.numel() * elem
        + case.q.shape[0] * case.q.shape[1] * case.weights["w_uv"].shape[1] * elem
        + new_rows
    )


def flops_per_call(case: Case) -> int:
    """Multiply-adds x 2 of attention and both projections."""
    offsets = case.input_row_offsets.tolist()
    heads = case.q.shape[1]
    rank, nope = case.weights["w_uk"].shape[1:]
    v = case.weights["w_uv"].shape[1]
    keys = sum(case.cache.length(b) + offsets[b + 1] - offsets[b] for b in range(len(offsets) - 1))
    attention = keys * heads * (case.cache.head_dim + rank)
    projections = case.q.shape[0] * heads * (rank * nope + v * rank)
    return 2 * (attention + projections)


def bench_one(
    heads: int, batch: int, context: int, page_size: int, bandwidth: float, repeat: int
) -> dict:
    case = make_case(
        7,
        dtype=torch.bfloat16,
        num_heads=heads,
        page_size=page_size,
        cache_lengths=(context - 1,) * batch,
        new_tokens=(1,) * batch,
        num_layers=1,
        layer_idx=0,
        freqs="rope",
        extra_rows=1,
    )
    kv = case.cache_tensors()
    op_s = time_call(
        lambda: mla_decode_branch_fp8(*case.args(), **case.options), repeat=repeat, min_seconds=0.2
    )
    ref_s = time_call(lambda: run_reference(case), warmup=1, repeat=3)
    plain = {}
    for attention in ("matmul", "sdpa"):
        fn = PlainTorchDecode(
            case.weights["w_uk"],
            case.weights["w_uk_scale"],
            case.weights["w_uv"],
            case.weights["w_uv_scale"],
            dtype=case.q.dtype,
            scale=case.options["scale"],
            attention=attention,
        )
        args = (
            case.q,
            case.input_row_offsets,
            case.freqs_cis,
            case.kv_norm_gamma,
            kv,
            case.layer_idx,
        )
        plain[attention] = time_call(
            lambda fn=fn, args=args: fn(*args), warmup=1, repeat=max(3, repeat // 2)
        )
    torch_kind = min(plain, key=plain.get)
    nbytes = bytes_per_call(case)
    floor_s = nbytes / bandwidth
    work = flops_per_call(case)
    return {
        "heads": heads,
        "batch": batch,
        "context": context,
        "page_size": page_size,
        "op_ms": op_s * 1e3,
        "reference_ms": ref_s * 1e3,
        "plain_torch_ms": plain[torch_kind] * 1e3,
        "plain_torch_attention": torch_kind,
        "floor_ms": floor_s * 1e3,
        "bytes": nbytes,
        "op_bandwidth_fraction": floor_s / op_s,
        "op_gflops": work / op_s / 1e9,
        "speedup_vs_reference": ref_s / op_s,
        "speedup_vs_plain_torch": plain[torch_kind] / op_s,
    }


def print_table(rows: list[dict], bandwidth: float, flops: float) -> None:
    print(
        f"\nmemory bandwidth (torch copy, read + write): {bandwidth / 1e9:.1f} GB/s; "
        f"float32 compute (torch mm 2048^3): {flops / 1e9:.0f} GFLOP/s"
    )
    header = (
        f"{'heads':>5} {'batch':>5} {'ctx':>6} {'page':>4} | {'op ms':>8} {'ref ms':>9} {'torch ms':>9} "
        f"| {'x ref':>6} {'x torch':>7} | {'floor ms':>8} {'%bw':>5} {'GFLOP/s':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['heads']:>5} {r['batch']:>5} {r['context']:>6} {r['page_size']:>4} | {r['op_ms']:>8.2f} "
            f"{r['reference_ms']:>9.1f} {r['plain_torch_ms']:>9.2f} | {r['speedup_vs_reference']:>6.1f} "
            f"{r['speedup_vs_plain_torch']:>7.2f} | {r['floor_ms']:>8.3f} {r['op_bandwidth_fraction']:>5.0%} "
            f"{r['op_gflops']:>7.1f}",
            flush=True,
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for heads, marker in zip(sorted({r["heads"] for r in rows}), "os^", strict=False):
        sel = [
            r
            for r in rows
            if r["heads"] == heads and r["page_size"] == min(x["page_size"] for x in rows)
        ]
        labels = [f"b{r['batch']}/{r['context'] // 1024}k" for r in sel]
        x = range(len(sel))
        axes[0].plot(x, [r["op_ms"] for r in sel], marker=marker, label=f"pymla op, {heads} heads")
        axes[0].plot(
            x,
            [r["plain_torch_ms"] for r in sel],
            marker=marker,
            ls="--",
            label=f"plain torch, {heads} heads",
        )
        axes[0].plot(
            x,
            [r["floor_ms"] for r in sel],
            marker=marker,
            ls=":",
            label=f"bandwidth floor, {heads} heads",
        )
        axes[1].plot(
            x,
            [100 * r["op_bandwidth_fraction"] for r in sel],
            marker=marker,
            label=f"{heads} heads",
        )
        axes[0].set_xticks(list(x), labels, rotation=45)
        axes[1].set_xticks(list(x), labels, rotation=45)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("ms per call")
    axes[0].set_title("time per call (bf16, DeepSeek-V3 shapes)")
    axes[0].legend(fontsize=7)
    axes[1].set_ylabel("% of measured memory bandwidth")
    axes[1].set_title("achieved bandwidth of the op")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pymla bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--page-size", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the JSON and PNG")
    parser.add_argument("--name", default="cpu", help="file name stem of the results")
    args = parser.parse_args(argv)

    print(
        f"pymla bench on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)",
        flush=True,
    )
    bandwidth = measure_bandwidth()
    flops = measure_flops()
    configs = list(itertools.product(args.heads, args.batch, args.context, args.page_size))
    rows = []
    for i, (heads, batch, context, page_size) in enumerate(configs, 1):
        print(
            f"[{i}/{len(configs)}] heads {heads}, batch {batch}, context {context}, page {page_size} ...",
            file=sys.stderr,
            flush=True,
        )
        rows.append(bench_one(heads, batch, context, page_size, bandwidth, args.repeat))
    print_table(rows, bandwidth, flops)

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / args.name
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "bandwidth_bytes_per_s": bandwidth,
        "float32_flops_per_s": flops,
        "dtype": "bfloat16",
        "mask": "causal",
    }
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, stem.with_suffix(".png"))
    print(f"\nsaved {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return 0
