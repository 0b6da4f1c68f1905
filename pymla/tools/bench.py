"""python -m pymla bench: the op's time per call against its roofline and against plain torch.

For DeepSeek-V3 shapes (kv_lora_rank 512, rope 64, fp8 128x128 weights,
causal mask, one new token per request, bf16 by default), over heads x batch
x context x page size x CPU path, everything measured in the same run:

- copy bandwidth: a large torch copy_ (read + write bytes per second);
- matmul rate: the faster of a large torch bf16 and float32 mm (flops per second; float32 where the
  CPU has no bf16 units, `timing.matmul_ceiling`);
  both measured again right before each case, so a busy spell of a shared
  machine slows a case and its ceilings together;
- roofline = max((cache + weight bytes) / copy bandwidth,
  attention flops / matmul rate), where attention flops are
  2 x keys x heads x (576 + 512) (scores and P V);
- ``--layers``: the timed calls cycle through this many layers of the
  cache, back to back, as a serving loop calls the op once per layer, each
  layer's rows its own. By default as many as make their rows exceed twice
  the CPU's last-level cache (``timing.last_level_cache_bytes``), so every
  call reads its rows from memory, as in a model of 61 layers and as the
  roofline's bytes assume; ``--layers 1`` times repeated calls on the same
  rows, which a large L3 (300 MiB on the H200 machine's host) can hold whole
  for the default case. The layers share one set of weights (2-16 MB);
- the op's time per call and its ratio to the roofline: the one-shot call
  (``pymla.mla_decode_branch_fp8``, every input checked and wrapped per
  call) and a serving loop's ``run()`` on a plan made once;
- ``--requests``: ``equal`` (every request has the context) or
  ``one-long`` (the first request has it, the others 1/16 of it: a long
  request beside short ones, as a serving batch mixes them);
- plain torch (pymla.tools.plain_torch: the faster of its matmul and SDPA
  attention) and the op's speed-up over it; not run on an ``fp8_ds_mla``
  cache (``--cache-format``: plain torch has no such cache), where the
  roofline counts the stored 656-byte rows.

``--rounds N`` times every case N times, the cases alternated round by
round; a row then gives the medians over its rounds (the ratios are the
medians of each round's ratio to its own roofline), each round's numbers
under ``rounds`` in the JSON, and the table the spread of ``run()``'s time
(slowest / fastest round).

Each row names the CPU path that ran (``auto`` resolved for the dtype); a
requested path the compiled kernel lacks is skipped with the reason. The JSON
is saved under --output-dir after every case (a crash keeps the rows
measured; ``meta.cases`` is the number planned), the table and a PNG at the
end, named after the CPU model (e.g. cpu-amd-epyc.json). The default folder
is a new one, ./pymla-bench-results; an existing result file is never
overwritten unless --force is given.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ..__main__ import CommandParser, int_at_least
from ..cache_format import CACHE_FORMATS, DTYPE_FORMAT, FP8_DS_MLA, FP8_VALUE_DTYPE, row_width
from ..cpu_paths import REQUESTS, cpu_model, cpu_signature, kernel_cpu_paths, resolve_cpu_path
from ..op import mla_decode_branch_fp8
from ..plan import plan
from .plain_torch import PlainTorchDecode
from .scenario import Case, make_case
from .timing import last_level_cache_bytes, matmul_ceiling, measure_copy_bandwidth, time_call

DEFAULT_OUTPUT_DIR = Path("pymla-bench-results")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
REQUEST_MIXES = ("equal", "one-long")
SHORT_FRACTION = 16  # one-long: the other requests' context is the context / this
KV_LORA_RANK, ROPE_DIM = 512, 64  # DeepSeek-V3 (make_case's defaults)
MODEL_LAYERS = 61  # DeepSeek-V3's layers: the most --layers' default cycles through


def cache_lengths(batch: int, context: int, requests: str) -> tuple[int, ...]:
    """Each request's cached keys (one new token each makes ``context`` visible for a full request)."""
    if requests == "equal":
        return (context - 1,) * batch
    short = max(context // SHORT_FRACTION, 1)
    return (context - 1,) + (short - 1,) * (batch - 1)


def layers_past_cache(
    lengths: tuple[int, ...], dtype: torch.dtype, cache_format: str, llc_bytes: int
) -> int:
    """The fewest cache layers whose rows (each request's keys plus its new one) exceed twice
    ``llc_bytes``, so calls cycling through them find none of their rows cached; at most
    DeepSeek-V3's 61 (a case that small is cached in a model's serving loop too)."""
    width = row_width(cache_format, KV_LORA_RANK, ROPE_DIM)
    row = width if cache_format == FP8_DS_MLA else width * dtype.itemsize
    per_layer = sum(n + 1 for n in lengths) * row
    return min(MODEL_LAYERS, max(1, -(-2 * llc_bytes // per_layer)))


def cycling_layers(call: Callable[[int], object], layers: int) -> Callable[[], object]:
    """``call`` on layers 0, 1, .. ``layers`` - 1, 0, .. (one layer per call, as a serving loop)."""
    order = itertools.cycle(range(layers))
    return lambda: call(next(order))


def visible_keys(case: Case) -> int:
    offsets = case.input_row_offsets.tolist()
    return sum(case.cache.length(b) + offsets[b + 1] - offsets[b] for b in range(len(offsets) - 1))


def cache_and_weight_bytes(case: Case) -> int:
    """Bytes a call must read at least: every visible cache row as stored and both fp8 weights with scales."""
    row = case.cache.blocks.shape[-1] * case.cache.blocks.element_size()
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


def paths_to_run(requested: list[str], dtype: torch.dtype) -> list[str]:
    """The paths the requested ``PYMLA_CPU_PATH`` values run for ``dtype``, in order.

    A path the compiled kernel lacks, or one that runs the same path as an
    earlier one, is left out with a printed reason.
    """
    runs: list[str] = []
    for path in requested:
        try:
            resolved = resolve_cpu_path(path, dtype)
        except ValueError as e:
            print(f"skipping --path {path}: {e}", file=sys.stderr)
            continue
        if resolved in runs:
            print(f"skipping --path {path}: it runs {resolved}, already listed", file=sys.stderr)
            continue
        runs.append(resolved)
    return runs


def output_dir(text: str) -> Path:
    """The --output-dir type: a folder, or a path where one can be made."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a folder, got the file {text!r}")
    return path


def bench_one(
    heads: int,
    batch: int,
    context: int,
    page_size: int,
    path: str,
    cache_format: str,
    dtype: torch.dtype,
    copy_bw: float,
    mm: tuple[float, str],
    repeat: int,
    requests: str = "equal",
    layers: int = 1,
) -> dict:
    """One case with ``PYMLA_CPU_PATH=path``, a path of :func:`paths_to_run` (so ``path`` runs),
    its timed calls cycling through ``layers`` layers of the cache."""
    lengths = cache_lengths(batch, context, requests)
    case = make_case(
        7,
        dtype=dtype,
        num_heads=heads,
        page_size=page_size,
        cache_lengths=lengths,
        new_tokens=(1,) * batch,
        num_layers=layers,
        layer_idx=0,
        freqs="rope",
        extra_rows=1,
        cache_format=cache_format,
    )
    options = dict(case.options, check_values=False)
    # The serving path beside the one-shot call: a plan made once, its run() per call (both
    # rotate the layer's new rows again each time: the same work).
    step = plan(
        case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options(),
        check_values=False, rerun_layers=True,
    )  # fmt: skip
    weights = case.layer_weights()
    previous = os.environ.get("PYMLA_CPU_PATH")
    os.environ["PYMLA_CPU_PATH"] = path
    try:
        op_s = time_call(
            cycling_layers(
                lambda layer: mla_decode_branch_fp8(*case.args(layer_idx=layer), **options), layers
            ),
            warmup=1,
            repeat=repeat,
            min_seconds=0.2,
        )
        run_s = time_call(
            cycling_layers(lambda layer: step.run(case.q, layer, weights), layers),
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
    for attention in ("matmul", "sdpa") if cache_format == DTYPE_FORMAT else ():
        fn = PlainTorchDecode(
            case.weights["w_uk"],
            case.weights["w_uk_scale"],
            case.weights["w_uv"],
            case.weights["w_uv_scale"],
            dtype=dtype,
            scale=case.options["scale"],
            attention=attention,
        )
        args = (case.q, case.input_row_offsets, case.freqs_cis, case.kv_norm_gamma, kv)
        plain[attention] = time_call(
            cycling_layers(lambda layer, fn=fn, args=args: fn(*args, layer), layers),
            warmup=1,
            repeat=max(3, repeat // 2),
        )
    torch_kind = min(plain, key=plain.get) if plain else None
    nbytes = cache_and_weight_bytes(case)
    flops = attention_flops(case)
    memory_s = nbytes / copy_bw
    compute_s = flops / mm[0]
    roofline_s = max(memory_s, compute_s)
    return {
        "heads": heads,
        "batch": batch,
        "context": context,
        "requests": requests,
        "cache_lengths": list(lengths),
        "layers": layers,
        "page_size": page_size,
        "path": path,
        "cache_format": cache_format,
        "op_ms": op_s * 1e3,
        "run_ms": run_s * 1e3,
        "roofline_ms": roofline_s * 1e3,
        "roofline_bound": "memory" if memory_s >= compute_s else "compute",
        "op_over_roofline": op_s / roofline_s,
        "run_over_roofline": run_s / roofline_s,
        "plain_torch_ms": plain[torch_kind] * 1e3 if plain else None,
        "plain_torch_attention": torch_kind,
        "speedup_vs_plain_torch": plain[torch_kind] / op_s if plain else None,
        "cache_and_weight_bytes": nbytes,
        "attention_flops": flops,
        "memory_floor_ms": memory_s * 1e3,
        "compute_floor_ms": compute_s * 1e3,
        "copy_bandwidth_bytes_per_s": copy_bw,
        "matmul_flops_per_s": mm[0],
        "matmul_dtype": mm[1],
    }


ROUND_KEYS = (
    "op_ms",
    "run_ms",
    "roofline_ms",
    "roofline_bound",
    "op_over_roofline",
    "run_over_roofline",
    "plain_torch_ms",
    "speedup_vs_plain_torch",
    "copy_bandwidth_bytes_per_s",
    "matmul_flops_per_s",
    "matmul_dtype",
    "memory_floor_ms",
    "compute_floor_ms",
)
LABEL_KEYS = ("roofline_bound", "matmul_dtype")  # a round's label: the row takes the most frequent
MEDIAN_KEYS = tuple(k for k in ROUND_KEYS if k not in LABEL_KEYS)


def combine_rounds(rounds: list[dict]) -> dict:
    """One case's row from its rounds (rows of :func:`bench_one`, the same case): the sizes of the
    first, the median of each measured number over the rounds (a ratio: the median of each round's
    ratio to its own roofline), ``run_spread`` (slowest / fastest ``run()``) and every round's
    numbers under ``rounds``."""
    row = dict(rounds[0])
    for key in MEDIAN_KEYS:
        values = [r[key] for r in rounds if r[key] is not None]
        row[key] = statistics.median(values) if values else None
    for key in LABEL_KEYS:
        labels = [r[key] for r in rounds]
        row[key] = max(set(labels), key=labels.count)
    runs = [r["run_ms"] for r in rounds]
    row["run_spread"] = max(runs) / min(runs)
    row["rounds"] = [{k: r[k] for k in ROUND_KEYS} for r in rounds]
    return row


def measure_ceilings() -> tuple[float, tuple[float, str]]:
    """The copy bandwidth and the matmul rate with its dtype, measured now."""
    return measure_copy_bandwidth(), matmul_ceiling()


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'heads':>5} {'batch':>5} {'ctx':>6} {'reqs':>8} {'page':>4} {'path':>10} {'cache':>10} | {'op ms':>8} "
        f"{'run ms':>8} {'roof ms':>8} {'bound':>7} {'x roof':>6} {'run x':>6} | "
        f"{'torch ms':>9} {'x faster':>8} | {'spread':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        torch_ms, faster = r["plain_torch_ms"], r["speedup_vs_plain_torch"]
        print(
            f"{r['heads']:>5} {r['batch']:>5} {r['context']:>6} {r['requests']:>8} {r['page_size']:>4} {r['path']:>10} "
            f"{r['cache_format']:>10} | {r['op_ms']:>8.2f} {r['run_ms']:>8.2f} {r['roofline_ms']:>8.2f} "
            f"{r['roofline_bound']:>7} {r['op_over_roofline']:>6.2f} {r['run_over_roofline']:>6.2f} | "
            + (f"{torch_ms:>9.2f} {faster:>8.2f}" if torch_ms is not None else f"{'-':>9} {'-':>8}")
            + f" | {r['run_spread']:>6.2f}",
            flush=True,
        )


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{r['heads']}h b{r['batch']} {r['context'] // 1024}k"
        + (" one-long" if r["requests"] == "one-long" else "")
        + f" p{r['page_size']}\n{r['path']}"
        + ("" if r["cache_format"] == DTYPE_FORMAT else f" {r['cache_format']}")
        for r in rows
    ]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) + 4), 5))
    width = 0.2
    bars = (
        ("op_ms", "pymla one-shot call"),
        ("run_ms", "pymla plan().run()"),
        ("roofline_ms", "roofline"),
        ("plain_torch_ms", "plain torch"),
    )
    for i, (key, name) in enumerate(bars):
        heights = [r[key] if r[key] is not None else 0 for r in rows]  # no plain torch: no bar
        axes[0].bar([v + (i - 1.5) * width for v in x], heights, width, label=name)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("ms per call")
    axes[0].legend(fontsize=8)
    for i, (key, name) in enumerate(
        (("op_over_roofline", "one-shot call"), ("run_over_roofline", "plan().run()"))
    ):
        axes[1].bar([v + (i - 0.5) * 0.35 for v in x], [r[key] for r in rows], 0.35, label=name)
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set_ylabel("time / roofline")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(x), labels, fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_json(path: Path, payload: dict) -> None:
    """Writes ``payload`` to ``path`` whole or not at all (through a temporary file)."""
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(payload, indent=1) + "\n")
    partial.replace(path)


def file_stem(model: str) -> str:
    """``cpu-<model>``, lower case, runs of other characters as one dash."""
    return "cpu-" + (re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-") or "unknown")


def run(argv: list[str], prog: str) -> int:
    parser = CommandParser(
        prog,
        "Time per call of the op against its roofline and against plain torch "
        "(DeepSeek-V3 shapes, causal mask, one new token per request).",
    )
    count = int_at_least(1)
    parser.add_argument("--heads", type=count, nargs="+", default=[16, 128], help="head counts")
    parser.add_argument("--batch", type=count, nargs="+", default=[8], help="requests per call")
    parser.add_argument(
        "--context", type=count, nargs="+", default=[16384], help="keys per request"
    )
    parser.add_argument(
        "--requests",
        nargs="+",
        default=["equal"],
        choices=REQUEST_MIXES,
        help="equal: every request has the context; one-long: the first has it, the others "
        f"1/{SHORT_FRACTION} of it",
    )
    parser.add_argument("--page-size", type=count, nargs="+", default=[64], help="cache page sizes")
    parser.add_argument(
        "--path",
        nargs="+",
        default=["auto"],
        choices=REQUESTS,
        help="CPU paths of step 5 (PYMLA_CPU_PATH); auto is the kernel's default for "
        "the dtype; paths the kernel lacks are skipped",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=list(DTYPES), help="activation dtype"
    )
    parser.add_argument(
        "--cache-format",
        nargs="+",
        default=[DTYPE_FORMAT],
        choices=CACHE_FORMATS,
        help=f"cache row formats (pymla.cache_format; {FP8_DS_MLA} with bfloat16 only)",
    )
    parser.add_argument("--repeat", type=count, default=5, help="timed calls per case (median)")
    parser.add_argument(
        "--layers",
        type=count,
        default=None,
        help="cache layers the timed calls cycle through, back to back (a serving loop's call per "
        "layer); default: enough that their rows exceed twice the CPU's last-level cache, so "
        "each call reads its rows from memory; 1: every call reads the same, cached rows",
    )
    parser.add_argument(
        "--rounds",
        type=count,
        default=1,
        help="times every case is timed, the cases alternated (medians over the rounds)",
    )
    parser.add_argument(
        "--output-dir",
        type=output_dir,
        default=DEFAULT_OUTPUT_DIR,
        help="folder for the JSON and PNG",
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
        parser.error(
            f"argument --output-dir: {existing[0]} exists: pass --force to overwrite it "
            "or choose another folder"
        )

    dtype = DTYPES[args.dtype]
    if FP8_DS_MLA in args.cache_format and dtype != FP8_VALUE_DTYPE:
        parser.error(
            f"argument --cache-format: {FP8_DS_MLA} needs --dtype bfloat16, got {args.dtype}"
        )
    kernel_paths = kernel_cpu_paths()
    paths = paths_to_run(args.path, dtype)
    if not paths:
        parser.error(
            f"argument --path: the kernel has none of {' '.join(args.path)} "
            f"(it has {' '.join(kernel_paths)})"
        )
    signature = cpu_signature()
    print(
        f"pymla bench on {model} ({signature}; {os.cpu_count()} cores; kernel CPU paths "
        f"{', '.join(kernel_paths)}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), {args.dtype}",
        flush=True,
    )
    configs = list(
        itertools.product(
            args.heads,
            args.batch,
            args.context,
            args.requests,
            args.page_size,
            paths,
            args.cache_format,
        )
    )
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": model,
        "cpu_signature": signature,
        "cpu_paths": list(kernel_paths),
        "machine": platform.platform(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "ceilings": "copy bandwidth and matmul rate (the faster of bf16 and float32) measured before each case (rows)",
        "dtype": args.dtype,
        "mask": "causal",
        "cases": len(configs),
        "rounds": args.rounds,
        "last_level_cache_bytes": last_level_cache_bytes(),
        "layers": "given" if args.layers else "past twice the last-level cache (rows)",
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    measured: list[list[dict]] = [[] for _ in configs]
    rows: list[dict] = []
    for round_ in range(1, args.rounds + 1):
        for i, (heads, batch, context, requests, page_size, path, cache_format) in enumerate(
            configs
        ):
            lengths = cache_lengths(batch, context, requests)
            layers = args.layers or layers_past_cache(
                lengths, dtype, cache_format, meta["last_level_cache_bytes"]
            )
            copy_bw, mm = measure_ceilings()
            print(
                f"[round {round_}/{args.rounds}, {i + 1}/{len(configs)}] heads {heads}, batch "
                f"{batch}, context {context} ({requests}), page {page_size}, path {path}, cache "
                f"{cache_format}, {layers} layer(s); copy {copy_bw / 1e9:.1f} GB/s, {mm[1]} mm {mm[0] / 1e9:.0f} "
                "GFLOP/s ...",
                file=sys.stderr,
                flush=True,
            )
            measured[i].append(
                bench_one(
                    heads,
                    batch,
                    context,
                    page_size,
                    path,
                    cache_format,
                    dtype,
                    copy_bw,
                    mm,
                    args.repeat,
                    requests,
                    layers,
                )
            )
            rows = [combine_rounds(m) for m in measured if m]
            save_json(outputs[0], {"meta": meta, "rows": rows})  # a later crash keeps these rows
    print()
    print(
        f"ceilings measured before each case (torch copy_ read + write, the faster of torch bf16 and float32 mm 2048^3); "
        f"medians of {args.rounds} round(s); spread: slowest / fastest run(); calls cycle through "
        + (
            f"{args.layers} cache layer(s)"
            if args.layers
            else f"enough cache layers to exceed twice the {meta['last_level_cache_bytes'] >> 20} MiB "
            "last-level cache (JSON: layers)"
        )
    )
    print_table(rows)
    print(f"\nsaved {outputs[0]}")
    try:
        plot(rows, f"pymla op on {model}, {args.dtype}, {meta['date']}", outputs[1])
    except ImportError as e:
        print(f"no PNG: {e} (pip install matplotlib)", file=sys.stderr)
    else:
        print(f"saved {outputs[1]}")
    return 0
