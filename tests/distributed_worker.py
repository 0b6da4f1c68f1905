"""One rank of the multi-process tests (``test_distributed.py``); run as a script, not collected.

    python distributed_worker.py RANK WORLD STORE_FILE OUT_DIR CASES_JSON [BACKEND]

Joins a process group (the file store ``STORE_FILE``; ``BACKEND`` gloo, the
default, with CPU tensors, or nccl with GPU ``RANK``'s), runs every case of
``CASES_JSON`` (see ``test_distributed.CASES``) as this rank, and saves what
the parent process checks to ``OUT_DIR/<case>-<rank>.pt`` (CPU tensors).
Inputs are drawn and the reference's cache computed on the CPU, then moved.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import pymla
from pymla.parity import compare_cache
from pymla.tools.scenario import make_case, reference_stages

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def case_options(spec: dict) -> dict:
    """make_case's keywords of a case (``spec``: one entry of test_distributed.CASES)."""
    return dict(
        dtype=DTYPES[spec["dtype"]],
        num_heads=spec["heads"],
        page_size=spec["page_size"],
        cache_lengths=tuple(spec["cache_lengths"]),
        new_tokens=tuple(spec["new_tokens"]),
        mask=spec["mask"],
        score_mod=spec["score_mod"],
        local_window_size=spec["window"],
        num_layers=2,
        layer_idx=1,
    )


def second_step(case, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After ``advance``: reserves the next step's tokens; ``(q, offsets, new_rows)`` from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    new = [2, 1, 3, 1][: case.cache.num_requests]
    for b, n in enumerate(new):
        case.cache.reserve(b, n)
    heads, width = case.q.shape[1], case.q.shape[2]
    q = torch.randn(sum(new), heads, width, generator=g).to(case.q.dtype)
    rows = torch.randn(sum(new), case.cache.head_dim, generator=g).to(case.q.dtype)
    offsets = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()]).to(torch.uint32)
    return q, offsets, rows


def run_dcp(spec: dict, context: pymla.ContextParallel, device: torch.device) -> dict:
    case = make_case(spec["seed"], shard=context.shard, **case_options(spec))
    _, ref_blocks = reference_stages(case)
    case.to(device)
    before = case.cache.blocks.clone()
    weights = case.layer_weights()
    o = {k: v for k, v in case.options.items() if k not in ("scale_granularity", "shard")}
    step = context.plan(
        case.cache, case.input_row_offsets, case.freqs_cis, pymla.DecodeOptions(**o)
    )
    tokens, heads = case.q.shape[:2]
    gathered = None
    if context.exchange == "all_to_all":  # each rank merges only its heads: no attention_out
        att = lse = None
        # The same layer with "all_gather" first, then the rows as they were: the two exchanges
        # merge and project each head alike, so their outputs must agree bit for bit.
        other = pymla.ContextParallel(interleave=spec["interleave"], exchange="all_gather")
        again = dict(rerun_layers=True)
        plans = [
            c.plan(case.cache, case.input_row_offsets, case.freqs_cis, pymla.DecodeOptions(**o),
                   **again)
            for c in (other, context)
        ]  # fmt: skip
        gathered = plans[0].run(case.q, case.layer_idx, weights)
        case.cache.blocks.copy_(before)
        step = plans[1]
        out = step.run(case.q, case.layer_idx, weights)
    else:
        att = torch.full((tokens, heads, 512), float("nan"), dtype=case.q.dtype, device=device)
        lse = torch.full((tokens, heads), float("nan"), device=device)
        out = step.run(case.q, case.layer_idx, weights, attention_out=att, lse=lse)
    cache = compare_cache(before.cpu(), case.cache.blocks.cpu(), ref_blocks, case.new_rows_mask())
    result = dict(
        out=out,
        gathered=gathered,
        attention=att,
        lse=lse,
        cache_passed=cache.passed,
        cache_report=cache.describe(),
        held_rows=int(case.new_rows_mask().sum()),
        bytes_received=step.bytes_received(heads),
    )
    if spec.get("steps", 1) > 1:  # a second step, its rows given as new_rows
        case.cache.advance()
        q, offsets, rows = (t.to(device) for t in second_step(case, spec["seed"] + 1))
        step = context.plan(
            case.cache, offsets, case.freqs_cis, pymla.DecodeOptions(**o), new_rows=True
        )
        att = torch.full((q.shape[0], heads, 512), float("nan"), dtype=q.dtype, device=device)
        lse = torch.full((q.shape[0], heads), float("nan"), device=device)
        result["out2"] = step.run(
            q, case.layer_idx, weights, new_rows=rows, attention_out=att, lse=lse
        )
        result["attention2"], result["lse2"] = att, lse
        case.cache.advance()
        result["rows"] = [
            case.cache.rows(b, case.layer_idx) for b in range(case.cache.num_requests)
        ]
    return {k: _to_cpu(v) for k, v in result.items()}


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def run_tp(spec: dict, device: torch.device) -> dict:
    case = make_case(spec["seed"], **case_options(spec)).to(device)
    tp = pymla.TensorParallelHeads(spec["heads"])
    options = pymla.DecodeOptions(
        **{k: v for k, v in case.options.items() if k != "scale_granularity"}
    )
    tp.check_options(options)
    weights = tp.weights(case.layer_weights())
    step = pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, options)
    local = step.run(tp.q(case.q), case.layer_idx, weights)
    return dict(
        out=tp.gather(local).cpu(),
        local_heads=local.shape[1],
        bytes_received=tp.bytes_received(local.shape[0], local.shape[2], local.dtype),
    )


def main() -> None:
    rank, world, store, out_dir, cases = sys.argv[1:6]
    backend = sys.argv[6] if len(sys.argv) > 6 else "gloo"
    rank, world = int(rank), int(world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        pymla.distributed.nccl_environment()  # NVLink multicast off, before NCCL starts
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    for spec in json.loads(cases):
        if spec["kind"] == "dcp":
            context = pymla.ContextParallel(
                interleave=spec["interleave"], exchange=spec.get("exchange", "all_gather")
            )
            result = run_dcp(spec, context, device)
        else:
            result = run_tp(spec, device)
        torch.save(result, os.path.join(out_dir, f"{spec['name']}-{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
