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
        "us": float(us),
        "gbps": float(gbps),
        "tflops": float(tflops),
    }


def parse_bench_lines(lines: list[str]) -> list[dict]:
    """Every `bench` line of a log (`parse_bench_line`), each with `default_plan`: whether it times the
    op's own plan. Since the plans name where the schedule is built (2026-12-05f), gpu_bench prints
    the op's plan first of a case's plans in every round (`plan_mode` 0; the others have one choice
    turned), so it is the plan of the case's first line, whatever the defaults were (PDL off until
    the eleventh session, on since); in the logs before, it was "PDL off, quantize in merge"."""
    rows = [r for line in lines if (r := parse_bench_line(line))]
    first = {}
    for r in rows:
        key = (r["dtype"], r["cache"], r["batch"], r["heads"], r["context"])
        first.setdefault(key, r["plan"])
        plan = r["plan"]
        if plan is None:
            r["default_plan"] = True
        elif "schedule" in plan:
            r["default_plan"] = plan == first[key]
        else:
            r["default_plan"] = "PDL off" in plan and "quantize in merge" in plan
    return rows


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
    for r in parse_bench_lines(lines):
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
