"""Decode over several ranks: context parallel (DCP) and tensor-parallel heads, over torch.distributed.

Spawns ``--ranks`` processes (gloo on the CPU; NCCL with ``--device cuda``,
one GPU per rank, NVLink multicast off). Each rank runs ``--steps`` decode
steps of ``--layers`` layers the way a serving loop does (reserve the new
tokens, run every layer with its new rows, advance):

* ``--mode dcp``: each rank's cache holds its shard of every request
  (``pymla.ContextParallel``: positions dealt in runs of ``--interleave``);
  every layer runs steps 1-5 on the rank's keys, exchanges the partial
  outputs and LSEs, merges them and projects (step 6) once; every rank ends
  with the whole output.
* ``--mode tp``: each rank takes ``H / N`` heads (``pymla.TensorParallelHeads``:
  its slice of q, w_uk, w_uv and their scales) over a whole cache of its own;
  the outputs are gathered along the heads, as an engine does.

Rank 0 also keeps a whole cache and runs the one-process op on it, and
prints each layer's output error relative to it (``pymla.parity`` bounds).

    python examples/multi_rank_decode.py --mode dcp --ranks 2
    python examples/multi_rank_decode.py --mode tp --ranks 2 --heads 128
    python examples/multi_rank_decode.py --mode dcp --ranks 4 --device cuda   # NCCL, 4 GPUs
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

import pymla
from pymla.parity import compare_output
from pymla.reference import default_scale


def _caches(args, shard, device):
    """This rank's cache (its shard, or whole) and rank 0's whole one, filled alike."""
    made = []
    for s in (shard, None):
        g = torch.Generator().manual_seed(7)  # the same rows on every rank
        cache = pymla.PagedLatentCache(
            num_blocks=args.batch * (args.context // 64 + 4), page_size=64,
            num_layers=args.layers, shard=s,
        )  # fmt: skip
        for _ in range(args.batch):
            cache.fill(cache.add_request(), args.context, generator=g)
        made.append(cache.to(device))
    return made


def rank_main(rank: int, args) -> None:
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        pymla.distributed.nccl_environment()
        torch.cuda.set_device(device)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{args.store}", rank=rank,
                            world_size=args.ranks)  # fmt: skip
    dcp = pymla.ContextParallel(interleave=args.interleave) if args.mode == "dcp" else None
    tp = pymla.TensorParallelHeads(args.heads) if args.mode == "tp" else None
    cache, whole = _caches(args, dcp.shard if dcp else None, device)
    g = torch.Generator().manual_seed(11)
    weights = []
    for _ in range(args.layers):
        w = pymla.make_mla_weights(args.heads, generator=g)
        gamma = torch.ones(512, dtype=torch.bfloat16)
        layer = pymla.LayerWeights(
            *(t.to(device) for t in (w["w_uk"], w["w_uk_scale"], w["w_uv"], w["w_uv_scale"])),
            gamma.to(device),
        )
        weights.append((layer, tp.weights(layer) if tp else layer))
    freqs = pymla.rope_freqs_cis(args.context + args.steps + 1).to(torch.bfloat16).to(device)
    offsets = torch.arange(args.batch + 1, dtype=torch.int64).to(torch.uint32).to(device)
    options = pymla.DecodeOptions(scale=default_scale())
    for step in range(args.steps):
        for c in (cache, whole):
            for b in range(args.batch):
                c.reserve(b, 1)
        plan = (dcp.plan if dcp else pymla.plan)(cache, offsets, freqs, options, new_rows=True)
        one = pymla.plan(whole, offsets, freqs, options, new_rows=True)
        for layer, (full_w, my_w) in enumerate(weights):
            q = torch.randn(args.batch, args.heads, 192, generator=g).to(torch.bfloat16).to(device)
            rows = torch.randn(args.batch, 576, generator=g).to(torch.bfloat16).to(device)
            if tp:
                out = tp.gather(plan.run(tp.q(q), layer, my_w, new_rows=rows))
            else:
                out = plan.run(q, layer, my_w, new_rows=rows)
            ref = one.run(q, layer, full_w, new_rows=rows)
            if rank == 0:
                pieces = args.ranks if dcp else 1
                report = compare_output(out.cpu(), ref.cpu(), pieces, other_op=True)
                print(f"step {step} layer {layer}: vs one process: {report.describe()}")
                assert report.passed
        cache.advance()
        whole.advance()
    if rank == 0 and dcp:
        print(f"bytes each rank received per layer: {plan.bytes_received(args.heads):,}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("dcp", "tp"), default="dcp")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--interleave", type=int, default=1)
    args = parser.parse_args()
    pymla.distributed.nccl_environment()  # NVLink multicast off, inherited by the spawned ranks
    with tempfile.TemporaryDirectory() as folder:
        args.store = os.path.join(folder, "store")
        torch.multiprocessing.spawn(rank_main, args=(args,), nprocs=args.ranks)


if __name__ == "__main__":
    main()
