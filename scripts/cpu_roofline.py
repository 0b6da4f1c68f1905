"""The CPU benchmark's roofline without MAX: for machines where MAX is not staged (the device's host).

    python scripts/cpu_roofline.py [--threads N] [--heads 16 128] [--batch 8] [--context 16384]

Measures torch's copy bandwidth and matmul rate (the faster of bf16 and float32) with `--threads`
torch threads: the ceilings of `python -m pymla bench`, by the same functions (`pymla` itself needs
MAX to import, so this file loads `pymla/tools/timing.py`, where both live, and
`pymla/cache_format.py` (the fp8_ds_mla row's bytes) alone, and repeats only
the bench's formula for its default case). Prints, per head count, the roofline of the bench's
case (bf16 rows and fp8_ds_mla rows, page 64, one new token per request): max(cache + weight bytes / copy bandwidth,
attention flops / matmul rate). Run it under the same `taskset` as the op it is compared with (e.g.
`tests/cpu/amx_check.mojo`'s `loop HEADS ITERS cold`, the whole op with its inputs from memory).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform

import torch

_PYMLA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pymla")


def _load(name: str, *parts: str):
    """One pymla file as a module of its own (it needs torch only; `pymla` itself needs MAX)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(_PYMLA, *parts))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


timing = _load("pymla_timing", "tools", "timing.py")
cache_format = _load("pymla_cache_format", "cache_format.py")

KEY_DIM = 576  # kv_lora_rank 512 + rope 64 (DeepSeek-V3)
RANK = 512
NOPE = 128
V_HEAD = 128
BLOCK = 128  # fp8 weight scale blocks


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def roofline_ms(
    heads: int, batch: int, context: int, copy_bps: float, flops_per_s: float, row_bytes: int
) -> tuple[float, str]:
    keys = batch * (context + 1)
    cache_bytes = keys * row_bytes
    weight_bytes = 2 * heads * RANK * NOPE + 2 * 4 * heads * (RANK // BLOCK) * max(1, NOPE // BLOCK)
    memory = (cache_bytes + weight_bytes) / copy_bps
    compute = 2 * keys * heads * (KEY_DIM + RANK) / flops_per_s
    return 1e3 * max(memory, compute), "memory" if memory >= compute else "compute"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=16384)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    copy_bps = timing.measure_copy_bandwidth()
    flops, mm_dtype = timing.matmul_ceiling()
    print(
        f"{cpu_name()}: {torch.get_num_threads()} torch threads, {len(os.sched_getaffinity(0))} CPUs allowed; "
        f"copy {copy_bps / 1e9:.1f} GB/s, {mm_dtype} mm {flops / 1e9:.0f} GFLOP/s"
    )
    for heads in args.heads:
        for rows, row_bytes in (
            ("bf16", KEY_DIM * 2),
            ("fp8_ds_mla", cache_format.fp8_row_bytes(RANK, KEY_DIM - RANK)),
        ):
            ms, bound = roofline_ms(heads, args.batch, args.context, copy_bps, flops, row_bytes)
            print(
                f"heads {heads}, batch {args.batch}, context {args.context}, {rows} rows: "
                f"roofline {ms:.2f} ms ({bound})"
            )


if __name__ == "__main__":
    main()
