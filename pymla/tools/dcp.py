"""``python -m pymla dcp``: context-parallel decode over N CPU processes (gloo), time and bytes per layer.

Spawns ``--ranks`` processes (a gloo group on a file store); each holds its
shard of every request's cache (``--interleave``) and runs one layer again
and again (``rerun_layers``), timing per layer: the local op (steps 1-5 on
its keys, :meth:`pymla.DecodePlan.attend`), the exchange (one ``all_gather``
of the packed partials and LSE), the merge and step 6, and the whole
:meth:`pymla.ContextParallelPlan.run`, with each exchange (``all_gather``;
``all_to_all`` when the heads split over the ranks). The first process also times the
one-process op on the whole cache, alone, for comparison. Prints a table
and the CPU model, and saves JSON (``--json``). The ranks share this
machine's cores (each process's kernel sizes its thread pool to all of
them), so this measures the protocol's costs, not a speed-up.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import CacheShard, ContextParallel, DecodeOptions, LayerWeights, merge_attention_states
from .. import plan as make_plan
from ..__main__ import CommandParser, int_at_least, json_file
from ..cpu_paths import cpu_model
from ..distributed import nccl_environment
from .bench import DTYPES, save_json
from .scenario import make_case
from .timing import time_call


def _case(config: dict, shard: CacheShard | None):
    return make_case(
        config["seed"],
        dtype=DTYPES[config["dtype"]],
        num_heads=config["heads"],
        page_size=config["page_size"],
        cache_lengths=(config["context"],) * config["batch"],
        new_tokens=(config["new_tokens"],) * config["batch"],
        num_layers=1,
        layer_idx=0,
        shard=shard,
    )


def _weights(case) -> LayerWeights:
    w = case.weights
    return LayerWeights(
        *(w[k] for k in ("w_uk", "w_uk_scale", "w_uv", "w_uv_scale")),
        case.kv_norm_gamma,
        case.options["scale_granularity"],
    )


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def _rank(rank: int, world: int, store: str, config: dict, out: str) -> None:
    """One rank: its shard of the step, timed per phase; rank 0 also times the one-process op."""
    nccl_environment()  # NVLink multicast off (were this NCCL)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    context = ContextParallel(interleave=config["interleave"])
    case = _case(config, context.shard)
    weights = _weights(case)
    options = DecodeOptions(scale=case.options["scale"], shard=context.shard)
    step = context.plan(
        case.cache, case.input_row_offsets, case.freqs_cis, options, rerun_layers=True
    )
    q, layer = case.q, case.layer_idx
    # The other exchange, over the same shard (H must split over the ranks for all_to_all).
    a2a = None
    if config["heads"] % world == 0:
        a2a = ContextParallel(interleave=config["interleave"], exchange="all_to_all").plan(
            case.cache, case.input_row_offsets, case.freqs_cis, options, rerun_layers=True
        )
    phases = {"local op": [], "exchange": [], "merge + step 6": [], "run": [], "run a2a": []}
    for i in range(config["warmup"] + config["repeat"]):
        dist.barrier()
        t0 = time.perf_counter()
        partial, lse = step.step.attend(q, layer, weights)
        t1 = time.perf_counter()
        outputs, lses = step._all_gather(partial, lse)
        t2 = time.perf_counter()
        merged, _ = merge_attention_states(outputs, lses)
        step.step.project(merged.to(partial.dtype), q, layer, weights)
        t3 = time.perf_counter()
        dist.barrier()
        t4 = time.perf_counter()
        step.run(q, layer, weights)
        t5 = time.perf_counter()
        dist.barrier()
        t6 = time.perf_counter()
        if a2a is not None:
            a2a.run(q, layer, weights)
        t7 = time.perf_counter()
        if i >= config["warmup"]:
            times = (t1 - t0, t2 - t1, t3 - t2, t5 - t4, t7 - t6)
            for name, seconds in zip(phases, times, strict=True):
                phases[name].append(seconds)
    result = {name: _median_ms(s) for name, s in phases.items()}
    if a2a is None:
        result["run a2a"] = None
    result["bytes received"] = step.bytes_received(config["heads"])
    result["bytes received a2a"] = a2a.bytes_received(config["heads"]) if a2a else None
    result["cache rows held"] = sum(
        case.cache.shard.local_count(config["context"] + config["new_tokens"])
        for _ in range(config["batch"])
    )
    dist.barrier()
    if rank == 0:  # the one-process op on the whole cache, while the other ranks wait
        whole = _case(config, None)
        one = make_plan(
            whole.cache,
            whole.input_row_offsets,
            whole.freqs_cis,
            DecodeOptions(scale=whole.options["scale"]),
            rerun_layers=True,
        )
        whole_weights = _weights(whole)
        seconds = time_call(
            lambda: one.run(whole.q, 0, whole_weights),
            warmup=config["warmup"],
            repeat=config["repeat"],
        )
        result["one-process op"] = 1e3 * seconds
    dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(argv: list[str], prog: str) -> int:
    parser = CommandParser(
        prog,
        "Context-parallel decode over N CPU processes (gloo): milliseconds per layer per phase "
        "and bytes each rank receives, beside the one-process op on the whole cache.",
    )
    count = int_at_least(1)
    parser.add_argument("--ranks", type=int_at_least(2), default=2, help="processes (ranks)")
    parser.add_argument("--heads", type=count, default=16, help="heads (16: DeepSeek-V3 at TP8)")
    parser.add_argument("--batch", type=count, default=4, help="requests")
    parser.add_argument("--context", type=count, default=8192, help="cached tokens per request")
    parser.add_argument("--new-tokens", type=count, default=1, help="new tokens per request")
    parser.add_argument("--page-size", type=count, default=64, help="cache page size")
    parser.add_argument(
        "--interleave", type=count, default=1, help="positions per run dealt to a rank"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="dtype")
    parser.add_argument("--repeat", type=count, default=10, help="timed layers (median)")
    parser.add_argument("--warmup", type=int_at_least(0), default=2, help="untimed layers")
    parser.add_argument("--json", type=json_file, default=Path("dcp-cpu.json"), help="JSON output")
    args = parser.parse_args(argv)
    config = {
        "seed": 1,
        "ranks": args.ranks,
        "heads": args.heads,
        "batch": args.batch,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "page_size": args.page_size,
        "interleave": args.interleave,
        "dtype": args.dtype,
        "repeat": args.repeat,
        "warmup": args.warmup,
    }
    model = cpu_model()
    print(f"CPU: {model} ({os.cpu_count()} logical cores), {args.ranks} gloo ranks")
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.spawn(
            _rank,
            args=(args.ranks, str(Path(folder, "store")), config, folder),
            nprocs=args.ranks,
        )
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    tokens = args.batch * args.new_tokens
    phases = ["local op", "exchange", "merge + step 6", "run", "run a2a"]
    print(
        f"\n{args.heads} heads, {args.batch} requests x {args.context} cached + "
        f"{args.new_tokens} new tokens, {args.dtype}, interleave {args.interleave}; ms per layer "
        "(the first three: the all_gather run's phases; run a2a: the all_to_all exchange)"
    )
    header = " ".join(f"{p:>15}" for p in phases)
    print(f"{'rank':>4} {header} {'bytes in':>10} {'bytes in a2a':>12}")
    for r, res in enumerate(ranks):
        cells = " ".join("n/a".rjust(15) if res[p] is None else f"{res[p]:>15.2f}" for p in phases)
        a2a_bytes = res["bytes received a2a"]
        a2a_text = "n/a" if a2a_bytes is None else f"{a2a_bytes:,}"
        print(f"{r:>4} {cells} {res['bytes received']:>10,} {a2a_text:>12}")
    print(f"one-process op on the whole cache: {ranks[0]['one-process op']:.2f} ms per layer")
    print(
        f"bytes each rank receives per token per layer: all_gather "
        f"{ranks[0]['bytes received'] / tokens:,.0f} = (N - 1) H (R b + 4)"
        + (
            ""
            if ranks[0]["bytes received a2a"] is None
            else f"; all_to_all {ranks[0]['bytes received a2a'] / tokens:,.0f} "
            "= (N - 1) (H / N) (R b + 4 + Dv b)"
        )
    )
    save_json(
        args.json,
        {"meta": {**config, "cpu_model": model, "cpu_count": os.cpu_count()}, "ranks": ranks},
    )
    print(f"saved {args.json}")
    return 0
