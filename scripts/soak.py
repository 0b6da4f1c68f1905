"""Soak: RSS over many run() calls must stay flat (issue 13; not a CI test).

    python scripts/soak.py [--calls 10000] [--device cpu]

Plans one small decode step and calls run() ``--calls`` times (also the
one-shot public call, alternately), printing the resident set size every
tenth of the way. Exits 1 when RSS grew by more than ``--limit-mib`` between
the first tenth (after warm-up) and the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import pymla
from pymla.tools.scenario import make_case


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--calls", type=int, default=10_000, help="run() calls")
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--limit-mib", type=float, default=8.0, help="allowed RSS growth")
    args = parser.parse_args()

    case = make_case(5, num_heads=2, cache_lengths=(40, 7), new_tokens=(1, 2))
    case.to(args.device)
    w = case.weights
    weights = pymla.LayerWeights(
        w["w_uk"], w["w_uk_scale"], w["w_uv"], w["w_uv_scale"], case.kv_norm_gamma
    )
    options = pymla.DecodeOptions(
        **{k: v for k, v in case.options.items() if k != "scale_granularity"}
    )
    every = max(1, args.calls // 10)
    samples = []
    start = time.perf_counter()
    for i in range(args.calls):
        if i % 2:
            pymla.mla_decode_branch_fp8(*case.args(), **case.options, rerun_layers=True)
        else:
            step = pymla.plan(
                case.cache, case.input_row_offsets, case.freqs_cis, options, rerun_layers=True
            )
            step.run(case.q, case.layer_idx, weights)
        if (i + 1) % every == 0:
            if args.device != "cpu":
                torch.cuda.synchronize()
            samples.append((i + 1, rss_mib()))
            print(f"{i + 1:>8} calls  RSS {samples[-1][1]:8.1f} MiB", flush=True)
    seconds = time.perf_counter() - start
    growth = samples[-1][1] - samples[0][1]
    print(
        f"{args.calls} calls in {seconds:.1f} s ({seconds / args.calls * 1e6:.0f} us per call); "
        f"RSS growth after the first tenth: {growth:+.1f} MiB (limit {args.limit_mib})"
    )
    return 0 if growth <= args.limit_mib else 1


if __name__ == "__main__":
    sys.exit(main())
