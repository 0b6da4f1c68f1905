"""pymla beside FlashMLA and vLLM's Triton MLA, from logs of ONE device call (H200).

Inputs, all written by the same `run` on the device (scripts/README.md):
  * `gpu_both.log`      - `gpu_bench both CFG...` (scripts/device_gpu_vs_peers.sh): per shape,
    step 5 (attention) alone, the op's own plan being the `attention op's plan` line, then the
    whole op (all six steps) per call, from a Mojo host loop of back-to-back calls (GPU-bound:
    the launches queue ahead), after a device-to-device copy; or, in results before
    2026-12-05g, the same lines in two files from two runs: `gpu_op_bench.log` (`bench`, the
    whole op) and `gpu_variants.log` (`variants`; `attention groups 0 kt 0` before 2026-12-04);
  * `peers.json`        - `.peers/peers.py` (`../shared/peers`): FlashMLA and Triton
    attention alone, `triton.testing.do_bench` medians (CUDA events, L2 flushed);
  * `flashinfer.json`   - optional, `scripts/flashinfer_peer.py`: FlashInfer's MLA decode
    (fa3) at the same shapes and with the same timing, bf16 and fp8 caches.

The bar is the faster peer per shape: FlashMLA, or FlashInfer where it is faster.

    python -m pymla.tools.peers benchmarks/results/h200-2026-12-03

prints the table (ratios to FlashMLA) and writes `gpu_vs_peers.json` and `.png` there.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from pymla.tools.gpu_bench_json import parse_bench_lines

# `variants [CACHE cache ][one-long ]B b H h L l` (the cache label since 2026-12-05g)
VARIANTS = re.compile(r"^variants (.*)B (\d+) H (\d+) L (\d+)")
OWN = re.compile(r"attention (?:groups 0 kt 0 .*|op's plan \(.*\)) : ([\d.]+) us")
COPY = re.compile(r"^copy ([\d.]+) GB/s")


def own_attention_us(line: str) -> float | None:
    """The op's own step 5 time (us) in a `gpu_variants.log` line, if it is that line."""
    m = OWN.search(line)
    return float(m[1]) if m else None


def triton_ms(peer: dict) -> float | None:
    """Triton's best split count, or None where the call left Triton out (PEERS_WHICH)."""
    times = [peer[k] for k in ("triton_s4_bench_ms", "triton_s32_bench_ms") if k in peer]
    return min(times) if times else None


def pymla_lines(folder: Path) -> list[str]:
    """pymla's log lines: `gpu_both.log`, else the older pair of logs."""
    names = (
        ["gpu_both.log"]
        if (folder / "gpu_both.log").exists()
        else ["gpu_op_bench.log", "gpu_variants.log"]
    )
    return [line for name in names for line in (folder / name).read_text().splitlines()]


CACHES = {"": "dtype", "dtype cache ": "dtype", "fp8_ds_mla cache ": "fp8_ds_mla"}
"""A `variants` header's cache label -> the cache format (others, e.g. `one-long` batches: not tabled)."""


def parse(folder: Path) -> dict:
    # (cache format, (heads, batch, context)) -> ms: the whole op and step 5 alone, the op's own plan
    op, attention, copy = {}, {}, None
    lines = pymla_lines(folder)
    for line in lines:
        if m := COPY.match(line):
            copy = float(m[1])
    for r in parse_bench_lines(lines):
        if r["default_plan"]:  # the op's own plan, best of its rounds
            key = (r["cache"], (r["heads"], r["batch"], r["context"]))
            op[key] = min(op.get(key, float("inf")), r["us"] / 1e3)
    shape = None
    for line in lines:
        if m := VARIANTS.match(line):
            cache = CACHES.get(m[1])
            shape = (cache, (int(m[3]), int(m[2]), int(m[4]))) if cache else None
        elif (us := own_attention_us(line)) is not None and shape:
            attention[shape] = us / 1e3
    peers = json.loads((folder / "peers.json").read_text())
    flashinfer = {}
    if (folder / "flashinfer.json").exists():
        for p in json.loads((folder / "flashinfer.json").read_text())["bench"]:
            flashinfer[(p["h"], p["b"], p["ctx"])] = p
    rows = []
    for p in peers["bench"]:
        # peers count the new token; the bench's L is the cache
        key = (p["h"], p["b"], p["keys"] - 1)
        if ("dtype", key) not in op and ("dtype", key) not in attention:
            key = (p["h"], p["b"], p["keys"])
        row = {
            "heads": p["h"],
            "batch": p["b"],
            "context": p["ctx"],
            "cache_bytes": p["cache_bytes"],
            "flops": p["flops"],
            "flashmla_ms": p["flashmla_bench_ms"],
            "triton_ms": triton_ms(p),
            "pymla_attention_ms": attention.get(("dtype", key)),
            "pymla_op_ms": op.get(("dtype", key)),
            "pymla_fp8_attention_ms": attention.get(("fp8_ds_mla", key)),
            "pymla_fp8_op_ms": op.get(("fp8_ds_mla", key)),
        }
        fi = flashinfer.get((p["h"], p["b"], p["ctx"]), {})
        row["flashinfer_ms"] = fi.get("flashinfer_bf16_bench_ms")
        row["flashinfer_fp8_ms"] = fi.get("flashinfer_fp8_bench_ms")
        row["bar_ms"] = min(x for x in (row["flashmla_ms"], row["flashinfer_ms"]) if x is not None)
        rows.append(row)
    return {"copy_gb_per_s": copy, "gpu": peers["env"].get("gpu"), "rows": rows}


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def _ratio(x, ceiling):
    return "-" if x is None or not ceiling else f"{x / ceiling:.2f}x"


def table(data: dict) -> str:
    head = (
        "| heads | batch | context | FlashMLA ms | FlashInfer ms | Triton ms | pymla attention ms "
        "| x faster peer | pymla whole op ms | x faster peer | pymla attention TFLOP/s | TB/s of cache |\n"
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = []
    for r in data["rows"]:
        att, op, f = r["pymla_attention_ms"], r["pymla_op_ms"], r["bar_ms"]
        if att is None and op is None:
            continue
        lines.append(
            f"| {r['heads']} | {r['batch']} | {r['context'] // 1024}k | {r['flashmla_ms']:.3f} "
            f"| {_fmt(r['flashinfer_ms'])} | {_fmt(r['triton_ms'])} "
            f"| {_fmt(att)} | {_ratio(att, f)} | {_fmt(op)} | {_ratio(op, f)} "
            f"| {_fmt(att and r['flops'] / att / 1e9, '.0f')} "
            f"| {_fmt(att and r['cache_bytes'] / att / 1e9, '.2f')} |"
        )
    return head + "\n".join(lines)


def fp8_table(data: dict) -> str:
    """Issue 24's table: pymla with an fp8_ds_mla cache beside FlashMLA's bf16 attention and FlashInfer's
    fp8 attention (per-tensor scale), where the call timed pymla's fp8 cache."""
    head = (
        "| heads | batch | context | FlashMLA bf16 ms | FlashInfer fp8 ms | pymla bf16 whole op ms "
        "| pymla fp8 attention ms | pymla fp8 whole op ms | x FlashMLA bf16 | x FlashInfer fp8 |\n"
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = []
    for r in data["rows"]:
        fp8 = r["pymla_fp8_op_ms"]
        if fp8 is None and r["pymla_fp8_attention_ms"] is None:
            continue
        lines.append(
            f"| {r['heads']} | {r['batch']} | {r['context'] // 1024}k | {r['flashmla_ms']:.3f} "
            f"| {_fmt(r['flashinfer_fp8_ms'])} | {_fmt(r['pymla_op_ms'])} "
            f"| {_fmt(r['pymla_fp8_attention_ms'])} | {_fmt(fp8)} | {_ratio(fp8, r['flashmla_ms'])} "
            f"| {_ratio(fp8, r['flashinfer_fp8_ms'])} |"
        )
    return head + "\n".join(lines) if lines else ""


def plot(data: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    rows = [r for r in data["rows"] if r["pymla_attention_ms"] or r["pymla_op_ms"]]
    labels = [f"{r['heads']}h b{r['batch']} {r['context'] // 1024}k" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    w = 0.16
    for i, (key, name) in enumerate(
        [
            ("flashmla_ms", "FlashMLA (attention)"),
            ("flashinfer_ms", "FlashInfer fa3 (attention)"),
            ("triton_ms", "vLLM Triton (attention)"),
            ("pymla_attention_ms", "pymla attention"),
            ("pymla_op_ms", "pymla whole op"),
        ]
    ):
        ax.bar([v + (i - 2) * w for v in x], [r[key] or 0 for r in rows], w, label=name)
    ax.set_xticks(list(x), labels, rotation=20)
    ax.set_ylabel("ms per call (lower is better)")
    ax.set_yscale("log")
    ax.set_title(f"MLA decode on {data['gpu']}, one device call (bf16, page 64, 1 new token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    data = parse(args.folder)
    print(f"{data['gpu']}, device-to-device copy {data['copy_gb_per_s']:.0f} GB/s in the same call")
    print(table(data))
    if fp8 := fp8_table(data):
        print("\nWith the fp8_ds_mla cache (issue 24):")
        print(fp8)
    (args.folder / "gpu_vs_peers.json").write_text(json.dumps(data, indent=1) + "\n")
    plot(data, args.folder / "gpu_vs_peers.png")


if __name__ == "__main__":
    main()
