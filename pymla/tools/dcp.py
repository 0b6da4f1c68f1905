"""``python -m pymla dcp``: decode over N processes, context parallel and heads split, per layer.

Spawns ``--ranks`` processes: gloo with CPU tensors (``--device cpu``), or
NCCL with rank ``r`` on ``cuda:r`` (``--device cuda``; NVLink multicast off,
:func:`pymla.distributed.nccl_environment`, inherited by the ranks). Each
rank runs one layer again and again (``rerun_layers``) and times, per layer
(medians):

* context parallel (DCP, :class:`pymla.ContextParallel`), the rank's shard
  of every request's cache (``--interleave``): the phases of an
  ``all_gather`` layer, the local op (steps 1-5 on its keys,
  :meth:`pymla.DecodePlan.attend`), the exchange (one ``all_gather`` of the
  packed partials and LSE), the merge (float32, rounded to the dtype) and
  step 6; then the whole :meth:`pymla.ContextParallelPlan.run` with each
  exchange (``all_gather``; ``all_to_all`` when the heads split over the
  ranks);
* heads split (:class:`pymla.TensorParallelHeads`, when the heads split over
  the ranks): a whole cache on every rank and ``H / N`` heads, the op then
  :meth:`~pymla.TensorParallelHeads.gather`;
* rank 0 alone, the others waiting: the one-process op on the whole cache,
  all heads.

Each with the bytes each rank receives per layer, and the merge's share of
the phased ``all_gather`` layer. An exchange's (and the gather's) time
includes waiting for the slower rank. Every rank holds its shard's case and a
whole cache's case (the same pool size). With ``--device cuda`` every
timing point follows ``torch.cuda.synchronize``, so a phase is the GPU's
time (written for issue 26; not yet run on GPUs). On the CPU the ranks
share the machine's cores (each process's kernel sizes its thread pool to
all of them), so this measures the protocol's costs, not a speed-up.
Prints a table, the device (GPU name, or the CPU model) and saves JSON
(``--json``) with the device and the NVLink multicast variables.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from .. import (
    CacheShard,
    ContextParallel,
    DecodeOptions,
    TensorParallelHeads,
    merge_attention_states,
)
from .. import plan as make_plan
from ..__main__ import CommandParser, int_at_least, json_file
from ..cpu_paths import cpu_model
from ..distributed import NVLINK_MULTICAST_OFF, nccl_environment
from .bench import DTYPES, save_json
from .scenario import make_case

PHASES = ("local op", "exchange", "merge", "step 6")
"""The phases of an all_gather layer, in order."""
RUNS = ("run", "run a2a", "run tp", "tp gather")
"""Whole layers: DCP with all_gather, with all_to_all, heads split; heads split's gather alone."""
WHOLE_LAYERS = {"DCP all_gather": "run", "DCP all_to_all": "run a2a", "heads split": "run tp"}


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


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def _clock(device: torch.device) -> Callable[[], float]:
    """Seconds now; on a GPU after ``torch.cuda.synchronize``, so intervals are GPU time."""
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def _rank(rank: int, world: int, store: str, config: dict, out: str) -> None:
    """One rank: DCP by phase and whole, heads split; rank 0 also times the one-process op."""
    device = torch.device("cpu")
    backend, extra = "gloo", {}
    if config["device"] == "cuda":
        nccl_environment()  # NVLink multicast off before NCCL starts (inherited already)
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend, extra = "nccl", {"device_id": device}
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, **extra
    )
    now = _clock(device)
    heads, layer = config["heads"], 0
    splits = heads % world == 0  # all_to_all and heads split need H a multiple of N
    context = ContextParallel(interleave=config["interleave"])
    case = _case(config, context.shard).to(device)
    weights = case.layer_weights()
    options = DecodeOptions(scale=case.options["scale"], shard=context.shard)
    step = context.plan(
        case.cache, case.input_row_offsets, case.freqs_cis, options, rerun_layers=True
    )
    q = case.q
    a2a = None
    if splits:  # the other exchange, over the same shard
        a2a = ContextParallel(interleave=config["interleave"], exchange="all_to_all").plan(
            case.cache, case.input_row_offsets, case.freqs_cis, options, rerun_layers=True
        )
    # The whole cache (the same on every rank): heads split, and rank 0's one-process op.
    whole = _case(config, None).to(device)
    whole_weights = whole.layer_weights()
    whole_step = make_plan(
        whole.cache,
        whole.input_row_offsets,
        whole.freqs_cis,
        DecodeOptions(scale=whole.options["scale"]),
        rerun_layers=True,
    )
    tp = TensorParallelHeads(heads) if splits else None
    tp_q = tp.q(whole.q) if tp else None
    tp_weights = tp.weights(whole_weights) if tp else None

    samples: dict[str, list[float]] = {name: [] for name in PHASES + RUNS}
    for i in range(config["warmup"] + config["repeat"]):
        dist.barrier()
        t0 = now()
        partial, lse = step.step.attend(q, layer, weights)
        t1 = now()
        outputs, lses = step._all_gather(partial, lse)
        t2 = now()
        merged, _ = merge_attention_states(outputs, lses)
        raw = merged.to(partial.dtype)
        t3 = now()
        step.step.project(raw, q, layer, weights)
        t4 = now()
        times = {"local op": t1 - t0, "exchange": t2 - t1, "merge": t3 - t2, "step 6": t4 - t3}
        dist.barrier()
        t0 = now()
        step.run(q, layer, weights)
        times["run"] = now() - t0
        if splits:
            dist.barrier()
            t0 = now()
            a2a.run(q, layer, weights)
            times["run a2a"] = now() - t0
            dist.barrier()
            t0 = now()
            local = whole_step.run(tp_q, layer, tp_weights)
            t1 = now()
            tp.gather(local)
            t2 = now()
            times["run tp"], times["tp gather"] = t2 - t0, t2 - t1
        if i >= config["warmup"]:
            for name, seconds in times.items():
                samples[name].append(seconds)
    result: dict = {name: _median_ms(s) if s else None for name, s in samples.items()}
    result["merge + step 6"] = result["merge"] + result["step 6"]
    phased = sum(result[p] for p in PHASES)
    result["merge share"] = result["merge"] / phased
    result["merge + step 6 share"] = result["merge + step 6"] / phased
    result["bytes received"] = step.bytes_received(heads)
    result["bytes received a2a"] = a2a.bytes_received(heads) if a2a else None
    tokens, dv = q.shape[0], whole_weights.v_head_dim
    result["bytes received tp"] = tp.bytes_received(tokens, dv, q.dtype) if tp else None
    result["cache rows held"] = sum(
        case.cache.shard.local_count(config["context"] + config["new_tokens"])
        for _ in range(config["batch"])
    )
    result["device"] = _device_name(device)
    dist.barrier()
    if rank == 0:  # the one-process op on the whole cache, while the other ranks wait
        one = []
        for i in range(config["warmup"] + config["repeat"]):
            t0 = now()
            whole_step.run(whole.q, layer, whole_weights)
            if i >= config["warmup"]:
                one.append(now() - t0)
        result["one-process op"] = _median_ms(one)
    dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _print_table(ranks: list[dict], args) -> None:
    tokens = args.batch * args.new_tokens
    columns = [*PHASES, *RUNS]
    print(
        f"\n{args.heads} heads, {args.batch} requests x {args.context} cached + "
        f"{args.new_tokens} new tokens, {args.dtype}, interleave {args.interleave}, "
        f"{args.ranks} ranks on {args.device}; ms per layer (the first four: the phases of an "
        "all_gather layer; run: DCP, all_gather; run a2a: DCP, all_to_all; run tp: heads split, "
        "the op on H / N heads and the gather; tp gather: the gather alone)"
    )
    header = " ".join(f"{c:>9}" for c in columns)
    print(f"{'rank':>4} {header} {'bytes in':>10} {'bytes in a2a':>12} {'bytes in tp':>11}")
    for r, res in enumerate(ranks):
        cells = " ".join("n/a".rjust(9) if res[c] is None else f"{res[c]:>9.2f}" for c in columns)
        counts = [
            "n/a" if res[k] is None else f"{res[k]:,}"
            for k in ("bytes received a2a", "bytes received tp")
        ]
        print(f"{r:>4} {cells} {res['bytes received']:>10,} {counts[0]:>12} {counts[1]:>11}")
    one = ranks[0]["one-process op"]
    print(f"one-process op on the whole cache (rank 0 alone): {one:.2f} ms per layer")
    for name, key in WHOLE_LAYERS.items():
        if ranks[0][key] is not None:
            slowest = max(res[key] for res in ranks)
            print(
                f"{name}: {slowest:.2f} ms per layer (the slowest rank); "
                f"the one-process op's time / this: {one / slowest:.2f}x"
            )
    for r, res in enumerate(ranks):
        print(
            f"rank {r}: merge {res['merge']:.2f} ms = {100 * res['merge share']:.1f}% of the phased "
            f"all_gather layer; merge + step 6 {100 * res['merge + step 6 share']:.1f}%"
        )
    first = ranks[0]
    line = (
        f"bytes each rank receives per token per layer: all_gather "
        f"{first['bytes received'] / tokens:,.0f} = (N - 1) H (R b + 4)"
    )
    if first["bytes received a2a"] is not None:
        line += (
            f"; all_to_all {first['bytes received a2a'] / tokens:,.0f} "
            "= (N - 1) (H / N) (R b + 4 + Dv b)"
            f"; heads split {first['bytes received tp'] / tokens:,.0f} = (N - 1) (H / N) Dv b"
        )
    print(line)


def run(argv: list[str], prog: str) -> int:
    parser = CommandParser(
        prog,
        "Decode over N processes (gloo on the CPU, NCCL with one GPU per rank): context parallel "
        "(DCP) by phase and with both exchanges, and heads split; milliseconds per layer and "
        "bytes each rank receives, beside the one-process op on the whole cache.",
    )
    count = int_at_least(1)
    parser.add_argument("--ranks", type=int_at_least(2), default=2, help="processes (ranks)")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu: gloo ranks; cuda: NCCL, rank r on cuda:r",
    )
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
    parser.add_argument(
        "--json", type=json_file, default=None, help="JSON output (none: dcp-DEVICE.json)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < args.ranks:
            parser.error(
                f"argument --device: cuda with --ranks {args.ranks} needs {args.ranks} GPUs, "
                f"this torch ({torch.__version__}) sees {gpus}"
            )
    path = args.json or Path(f"dcp-{args.device}.json")
    config = {
        "seed": 1,
        "ranks": args.ranks,
        "device": args.device,
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
    nccl_environment()  # the ranks inherit it
    model = cpu_model()
    backend = "NCCL, one GPU each" if args.device == "cuda" else "gloo"
    print(f"CPU: {model} ({os.cpu_count()} logical cores), {args.ranks} ranks ({backend})")
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.spawn(
            _rank,
            args=(args.ranks, str(Path(folder, "store")), config, folder),
            nprocs=args.ranks,
        )
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    _print_table(ranks, args)
    print(f"device: {ranks[0]['device']}")
    meta = {
        **config,
        "device_name": ranks[0]["device"],
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "environment": {name: os.environ.get(name) for name in NVLINK_MULTICAST_OFF},
    }
    save_json(path, {"meta": meta, "ranks": ranks})
    print(f"saved {path}")
    return 0
