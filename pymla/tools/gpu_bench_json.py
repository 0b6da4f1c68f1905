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
# `bench DTYPE [CACHE cache] B b H h L l [( PLAN, SPLIT )] : ...` (SPLIT: "N partitions" or
# "split by work"): the cache label and the plan (PDL, where step 6 quantizes) were added by later
# gpu_bench versions.
LINE = re.compile(
    r"bench (\w+)(?: (\w+) cache)? B (\d+) H (\d+) L (\d+)(?: \((?P<plan>[^)]*)\))? : ([\d.]+) us per call, "
    r"([\d.]+) GB/s of cache\+weights, ([\d.]+) TFLOP/s attention"
)
DEFAULT_PLAN = ("PDL off", "quantize in merge")
NOT_DEFAULT = ("schedule alone",)
"""The op's own plan among the ones `gpu_bench bench` alternates (mojo_kernels/gpu/plan.mojo:
PDL_DEFAULT, QUANTIZE_IN_MERGE_DEFAULT, SCHEDULE_IN_Q_STEP_DEFAULT; logs before 2026-12-05
name only the first two)."""


def parse_bench_line(line: str) -> dict | None:
    """One `bench` line: dtype, cache, batch, heads, context, plan (None in older logs), us, GB/s, TFLOP/s."""
    m = LINE.search(line)
    if not m:
        return None
    dtype, cache, b, h, ctx, plan, us, gbps, tflops = m.groups()
    plan = " ".join(plan.replace(",", " , ").split()) if plan else None
    return {
        "dtype": dtype,
        "cache": cache or "dtype",
        "batch": int(b),
        "heads": int(h),
        "context": int(ctx),
        "plan": plan,
        "default_plan": plan is None
        or (
            all(part in plan for part in DEFAULT_PLAN)
            and not any(part in plan for part in NOT_DEFAULT)
        ),
        "us": float(us),
        "gbps": float(gbps),
        "tflops": float(tflops),
    }


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
        r = parse_bench_line(line)
        if r:
            rows.append(
                {
                    "dtype": r["dtype"],
                    "cache": r["cache"],
                    "batch": r["batch"],
                    "heads": r["heads"],
                    "context": r["context"],
                    "plan": r["plan"],
                    "default_plan": r["default_plan"],
                    "ms": round(r["us"] / 1e3, 4),
                    "bytes_per_s": r["gbps"] * 1e9,
                    "hbm_fraction": round(r["gbps"] * 1e9 / copy, 4),
                    "attention_tflops": round(r["tflops"], 1),
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
