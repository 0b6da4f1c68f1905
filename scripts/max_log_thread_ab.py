"""The CPU op with MAX's log-polling thread as MAX makes it and under SCHED_IDLE, alternated in one process.

    python scripts/max_log_thread_ab.py --output-dir benchmarks/results/<folder>

Batch 8, 16k context, page 64, bf16, one new token per request; for each head
count, rounds of (thread normal, thread idle), each the mean of the op's calls
over `--seconds`. Prints the table with the CPU model and the thread count,
saves max-log-thread-<cpu>.json and .png (never over existing files).
See pymla/max_threads.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import pymla
from pymla import max_threads
from pymla.cpu_paths import cpu_model
from pymla.tools.bench import file_stem
from pymla.tools.scenario import make_case

POLICIES = {"normal": os.SCHED_OTHER, "idle": os.SCHED_IDLE}


def mean_ms(call, seconds: float) -> float:
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        call()
        n += 1
    return 1e3 * (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--output-dir", type=Path, required=True)
    args = parser.parse_args()
    model = cpu_model()
    stem = args.output_dir / ("max-log-thread-" + file_stem(model))
    outputs = [stem.with_suffix(".json"), stem.with_suffix(".png")]
    if any(p.exists() for p in outputs):
        parser.error(f"{outputs[0]} or its PNG exists: choose another --output-dir")

    rows = []
    for heads in args.heads:
        case = make_case(
            7, num_heads=heads, page_size=64, cache_lengths=(16383,) * 8, new_tokens=(1,) * 8,
            num_layers=1, layer_idx=0, freqs="rope", extra_rows=1,
        )  # fmt: skip
        call_args, options = case.args(), dict(case.options, check_values=False)

        def call(call_args=call_args, options=options) -> None:
            pymla.mla_decode_branch_fp8(*call_args, **options)

        call()  # the first launch: compiles, starts MAX's log thread, sets it idle
        threads = max_threads.log_threads()
        if not threads:
            raise SystemExit("no MAX log-polling thread found (pymla.max_threads.log_threads)")
        times: dict[str, list[float]] = {name: [] for name in POLICIES}
        for _ in range(args.rounds):
            for name, policy in POLICIES.items():
                for tid in threads:
                    os.sched_setscheduler(tid, policy, os.sched_param(0))
                times[name].append(mean_ms(call, args.seconds))
        row = {"heads": heads, "threads": torch.get_num_threads(), "log_threads": len(threads)}
        row.update({f"{name}_ms": times[name] for name in POLICIES})
        row["ratio_of_medians"] = statistics.median(times["normal"]) / statistics.median(
            times["idle"]
        )
        rows.append(row)
        print(
            f"{model}, {os.cpu_count()} CPUs, heads {heads}: MAX's log thread normal "
            f"{' '.join(f'{t:.2f}' for t in times['normal'])} ms, SCHED_IDLE "
            f"{' '.join(f'{t:.2f}' for t in times['idle'])} ms "
            f"(normal / idle {row['ratio_of_medians']:.3f})",
            flush=True,
        )

    args.output_dir.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": model, "cpus": os.cpu_count(), "batch": 8, "context": 16384, "page_size": 64}
    outputs[0].write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.35
    for i, name in enumerate(POLICIES):
        ax.bar(
            [j + i * width for j in range(len(rows))],
            [statistics.median(r[f"{name}_ms"]) for r in rows],
            width,
            label=f"MAX's log thread {name}",
        )
    ax.set_xticks([j + width / 2 for j in range(len(rows))], [f"{r['heads']} heads" for r in rows])
    ax.set_ylabel("ms per call (median of rounds)")
    ax.set_title(f"CPU op, batch 8, 16k, page 64, bf16\n{model}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(outputs[1], dpi=110)
    print("saved", *outputs)


if __name__ == "__main__":
    main()
