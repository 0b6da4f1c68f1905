"""Turns the `bench` lines of `gpu_bench.mojo bench ...` (run on the device) into JSON.

    python -m pymla.tools.gpu_bench_json benchmarks/results/gpu_op_bench.log \
        > benchmarks/results/gpu_op_bench.json

The HBM share is taken against the device-to-device copy rate the same run measured (its
`copy` line); `--copy-bytes-per-s` is for older logs without one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

COPY = re.compile(r"^copy ([\d.]+) GB/s")
LINE = re.compile(
    r"bench (\w+) B (\d+) H (\d+) L (\d+) : ([\d.]+) us per call, ([\d.]+) GB/s of cache\+weights, "
    r"([\d.]+) TFLOP/s attention"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--copy-bytes-per-s", type=float, default=None)
    args = parser.parse_args()
    rows = []
    with open(args.log) as f:
        lines = f.readlines()
    copy = args.copy_bytes_per_s
    for line in lines:
        m = COPY.search(line)
        if m:
            copy = float(m.group(1)) * 1e9
    if copy is None:
        print(f"{args.log}: no copy line; pass --copy-bytes-per-s", file=sys.stderr)
        return 1
    for line in lines:
        m = LINE.search(line)
        if m:
            dtype, b, h, ctx, us, gbps, tflops = m.groups()
            rows.append(
                {
                    "dtype": dtype,
                    "batch": int(b),
                    "heads": int(h),
                    "context": int(ctx),
                    "ms": round(float(us) / 1e3, 4),
                    "bytes_per_s": float(gbps) * 1e9,
                    "hbm_fraction": round(float(gbps) * 1e9 / copy, 4),
                    "attention_tflops": round(float(tflops), 1),
                }
            )
    if not rows:
        print(f"{args.log}: no bench lines", file=sys.stderr)
        return 1
    json.dump(
        {
            "method": "mla_decode_branch_fp8_gpu called from a Mojo host loop (tests/gpu/gpu_bench.mojo "
            "bench), one new token per request, page size 64, mean of N calls after one warm-up",
            "copy_bytes_per_s": copy,
            "bench": rows,
        },
        sys.stdout,
        indent=1,
    )
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
