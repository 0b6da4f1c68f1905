"""python -m pymla bench: the op's time per call against its roofline and against plain torch.

For DeepSeek-V3 shapes (kv_lora_rank 512, rope 64, fp8 128x128 weights,
causal mask, one new token per request, bf16 by default), over heads x batch
x context x page size x CPU path, everything measured in the same run:

- copy bandwidth: a large torch copy_ (read + write bytes per second);
- bf16 matmul rate: a large torch bf16 mm (flops per second);
- roofline = max((cache + weight bytes) / copy bandwidth,
  attention flops / bf16 matmul rate), where attention flops are
  2 x keys x heads x (576 + 512) (scores and P V);
- the op's time per call and its ratio to the roofline;
- plain torch (pymla.plain_torch: the faster of its matmul and SDPA
  attention) and the op's speed-up over it.

The table is printed; JSON and PNG are saved under --output-dir, named after
the CPU model (e.g. cpu-amd-epyc.json). The default folder is a new one,
./pymla-bench-results; an existing result file is never overwritten unless
--force is given.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import re
import sys
from pathlib import Path

import torch

from .cpu_paths import available_cpu_paths, cpu_model
from .op import mla_decode_branch_fp8
from .plain_torch import PlainTorchDecode
from .scenario import Case, make_case
from .timing import time_call

DEFAULT_OUTPUT_DIR = Path("pymla-bench-results")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def measure_copy_bandwidth(nbytes: int = 512 * 2**20) -> float:
    """Bytes per second of a large torch copy_ (counting the read and the write)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), warmup=2, repeat=7)
    return 2 * nbytes / seconds


def measure_matmul_rate(dtype: torch.dtype = torch.bfloat16, n: int = 2048) -> float:
    """Flops per second of a large torch matmul in ``dtype`` (the machine's practical peak)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    seconds = time_call(lambda: a @ b, warmup=2, repeat=5)
    return 2 * n**3 / seconds


def visible_keys(case: Case) -> int:
    offsets = case.input_row_offsets.tolist()
    return sum(case.cache.length(b) + offsets[b + 1] - offsets[b] for b in range(len(offsets) - 1))


def cache_and_weight_bytes(case: Case) -> int:
    """Bytes a call must read at least: every visible cache row and both fp8 weights with scales."""
    row = case.cache.head_dim * case.cache.blocks.element_size()
    weights = sum(
        case.weights[k].numel() * case.weights[k].element_size()
        for k in ("w_uk", "w_uk_scale", "w_uv", "w_uv_scale")
    )
    return visible_keys(case) * row + weights


def attention_flops(case: Case) -> int:
    """2 x multiply-adds of step 5: scores over key_dim and P V over kv_lora_rank, per key and head."""
    heads = case.q.shape[1]
    rank = case.weights["w_uk"].shape[1]
    return 2 * visible_keys(case) * heads * (case.cache.head_dim + rank)


def resolve_path(path: str, dtype: torch.dtype) -> str:
    """The path the kernel takes for ``PYMLA_CPU_PATH=path`` and ``dtype`` (see pymla.cpu_paths)."""
    if path != "auto":
        return path if dtype == torch.bfloat16 else "f32"
    best = available_cpu_paths()[-1]
    return best if dtype == torch.bfloat16 else "f32"


def bench_one(
    heads: int,
    batch: int,
    context: int,
    page_size: int,
    path: str,
    dtype: torch.dtype,
    copy_bw: float,
    mm_rate: float,
    repeat: int,
) -> dict:
    case = make_case(
        7,
        dtype=dtype,
        num_heads=heads,
        page_size=page_size,
        cache_lengths=(context - 1,) * batch,
        new_tokens=(1,) * batch,
        num_layers=1,
        layer_idx=0,
        freqs="rope",
        extra_rows=1,
    )
    options = dict(case.options, check_values=False)
    previous = os.environ.get("PYMLA_CPU_PATH")
    os.environ["PYMLA_CPU_PATH"] = path
    try:
        op_s = time_call(
            lambda: mla_decode_branch_fp8(*case.args(), **options),
            warmup=1,
            repeat=repeat,
            min_seconds=0.2,
        )
    finally:
        if previous is None:
            os.environ.pop("PYMLA_CPU_PATH", None)
        else:
            os.environ["PYMLA_CPU_PATH"] = previous
    plain = {}
    kv = case.cache_tensors()
    for attention in ("matmul", "sdpa"):
        fn = PlainTorchDecode(
            case.weights["w_uk"],
            case.weights["w_uk_scale"],
            case.weights["w_uv"],
            case.weights["w_uv_scale"],
            dtype=dtype,
            scale=case.options["scale"],
            attention=attention,
        )
        args = (case.q, case.input_row_offsets, case.freqs_cis, case.kv_norm_gamma, kv, 0)
        plain[attention] = time_call(
            lambda fn=fn, args=args: fn(*args), warmup=1, repeat=max(3, repeat // 2)
        )
    torch_kind = min(plain, key=plain.get)
    nbytes = cache_and_weight_bytes(case)
    flops = attention_flops(case)
    memory_s = nbytes / copy_bw
    compute_s = flops / mm_rate
    roofline_s = max(memory_s, compute_s)
    return {
        "heads": heads,
        "batch": batch,
        "context": context,
        "page_size": page_size,
        "path": resolve_path(path, dtype),
        "op_ms": op_s * 1e3,
        "roofline_ms": roofline_s * 1e3,
        "roofline_bound": "memory" if memory_s >= compute_s else "compute",
        "op_over_roofline": op_s / roofline_s,
        "plain_torch_ms": plain[torch_kind] * 1e3,
        "plain_torch_attention": torch_kind,
        "speedup_vs_plain_torch": plain[torch_kind] / op_s,
        "cache_and_weight_bytes": nbytes,
        "attention_flops": flops,
        "memory_floor_ms": memory_s * 1e3,
        "compute_floor_ms": compute_s * 1e3,
    }


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'heads':>5} {'batch':>5} {'ctx':>6} {'page':>4} {'path':>10} | {'op ms':>8} "
        f"{'roof ms':>8} {'bound':>7} {'x roof':>6} | {'torch ms':>9} {'x faster':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['heads']:>5} {r['batch']:>5} {r['context']:>6} {r['page_size']:>4} {r['path']:>10} | "
            f"{r['op_ms']:>8.2f} {r['roofline_ms']:>8.2f} {r['roofline_bound']:>7} "
            f"{r['op_over_roofline']:>6.2f} | {r['plain_torch_ms']:>9.2f} "
            f"{r['speedup_vs_plain_torch']:>8.2f}",
            flush=True,
        )


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{r['heads']}h b{r['batch']} {r['context'] // 1024}k p{r['page_size']}\n{r['path']}"
        for r in rows
    ]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) + 4), 5))
    width = 0.27
    for i, (key, name) in enumerate(
        (("op_ms", "pymla op"), ("roofline_ms", "roofline"), ("plain_torch_ms", "plain torch"))
    ):
        axes[0].bar([v + (i - 1) * width for v in x], [r[key] for r in rows], width, label=name)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("ms per call")
    axes[0].legend(fontsize=8)
    axes[1].bar(list(x), [r["op_over_roofline"] for r in rows])
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_ylabel("op time / roofline")
    for ax in axes:
        ax.set_xticks(list(x), labels, fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def file_stem(model: str) -> str:
    """``cpu-<model>``, lower case, runs of other characters as one dash."""
    return "cpu-" + (re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-") or "unknown")


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pymla bench",
        description="Time per call of the op against its roofline and against plain torch "
        "(DeepSeek-V3 shapes, causal mask, one new token per request).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    paths = available_cpu_paths()
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128], help="head counts")
    parser.add_argument("--batch", type=int, nargs="+", default=[8], help="requests per call")
    parser.add_argument("--context", type=int, nargs="+", default=[16384], help="keys per request")
    parser.add_argument("--page-size", type=int, nargs="+", default=[64], help="cache page sizes")
    parser.add_argument(
        "--path",
        nargs="+",
        default=["auto"],
        choices=["auto", *paths],
        help="CPU paths of step 5 (PYMLA_CPU_PATH); auto is the fastest this CPU has",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=list(DTYPES), help="activation dtype"
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per case (median)")
    parser.add_argument(
        "--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR, help="folder for the JSON and PNG"
    )
    parser.add_argument(
        "--force", action="store_true", help="overwrite result files that already exist"
    )
    args = parser.parse_args(argv)

    model = cpu_model()
    stem = args.output_dir / file_stem(model)
    outputs = [stem.with_suffix(".json"), stem.with_suffix(".png")]
    existing = [p for p in outputs if p.exists()]
    if existing and not args.force:
        print(
            f"{existing[0]} exists: pass --force to overwrite it or choose another --output-dir",
            file=sys.stderr,
        )
        return 2

    dtype = DTYPES[args.dtype]
    print(
        f"pymla bench on {model} ({os.cpu_count()} cores; CPU paths {', '.join(paths)}), "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), {args.dtype}",
        flush=True,
    )
    copy_bw = measure_copy_bandwidth()
    mm_rate = measure_matmul_rate()
    print(
        f"copy bandwidth (torch copy_, read + write): {copy_bw / 1e9:.1f} GB/s; "
        f"bf16 matmul (torch mm 2048^3): {mm_rate / 1e9:.0f} GFLOP/s",
        flush=True,
    )
    configs = list(
        itertools.product(args.heads, args.batch, args.context, args.page_size, args.path)
    )
    rows = []
    for i, (heads, batch, context, page_size, path) in enumerate(configs, 1):
        print(
            f"[{i}/{len(configs)}] heads {heads}, batch {batch}, context {context}, "
            f"page {page_size}, path {path} ...",
            file=sys.stderr,
            flush=True,
        )
        rows.append(
            bench_one(heads, batch, context, page_size, path, dtype, copy_bw, mm_rate, args.repeat)
        )
    print()
    print_table(rows)

    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": model,
        "cpu_paths": list(paths),
        "machine": platform.platform(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "copy_bandwidth_bytes_per_s": copy_bw,
        "bf16_matmul_flops_per_s": mm_rate,
        "dtype": args.dtype,
        "mask": "causal",
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    outputs[0].write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"\nsaved {outputs[0]}")
    try:
        plot(rows, f"pymla op on {model}, {args.dtype}, {meta['date']}", outputs[1])
    except ImportError as e:
        print(f"no PNG: {e} (pip install matplotlib)", file=sys.stderr)
    else:
        print(f"saved {outputs[1]}")
    return 0
