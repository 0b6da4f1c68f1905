"""``python -m pymla demo``: the op on DeepSeek-V3-like shapes against the torch reference.

Builds 16 heads (one GPU's share at 8-way tensor parallelism) with fp8
weights in 128x128 blocks, a paged bf16 cache of requests of different
lengths, runs the fused op once against the reference (output and cache),
then times both. Exits non-zero when parity fails.
"""

from __future__ import annotations

import torch

from ..__main__ import CommandParser, int_at_least, torch_device
from ..op import mla_decode_branch_fp8
from ..parity import compare_cache, compare_output
from .scenario import make_case, run_reference
from .timing import time_call

CACHE_LENGTHS = (37, 250, 1024, 2000, 3071, 4095)
NEW_TOKENS = (1, 1, 2, 1, 1, 3)


def run(argv: list[str], prog: str) -> int:
    parser = CommandParser(
        prog,
        "Run the op on DeepSeek-V3-like shapes against the torch reference "
        "(output and cache), then time both. Exits non-zero when parity fails.",
    )
    parser.add_argument("--heads", type=int_at_least(1), default=16, help="attention heads")
    parser.add_argument(
        "--page-size", type=int_at_least(1), default=64, help="cache page size in tokens"
    )
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="op dtype"
    )
    parser.add_argument(
        "--device", type=torch_device, default="cpu", help="torch device of the inputs"
    )
    parser.add_argument("--repeat", type=int_at_least(1), default=10, help="timed calls")
    args = parser.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    print(
        f"pymla demo: {args.heads} heads, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head_dim 128, "
        f"{args.dtype}, fp8 e4m3 weights in 128x128 blocks"
    )
    print(
        f"  {len(CACHE_LENGTHS)} requests, cached tokens {list(CACHE_LENGTHS)}, new tokens {list(NEW_TOKENS)}, "
        f"page size {args.page_size}, causal mask",
        flush=True,
    )
    case = make_case(
        2026,
        dtype=dtype,
        num_heads=args.heads,
        page_size=args.page_size,
        cache_lengths=CACHE_LENGTHS,
        new_tokens=NEW_TOKENS,
        num_layers=2,
        layer_idx=1,
        freqs="rope",
    )
    case.to(args.device)

    before = case.cache.blocks.clone()
    ref_out, ref_blocks = run_reference(case)
    out = mla_decode_branch_fp8(*case.args(), **case.options)
    output_report = compare_output(out.cpu(), ref_out.cpu())
    cache_report = compare_cache(
        before.cpu(), case.cache.blocks.cpu(), ref_blocks.cpu(), case.new_rows_mask()
    )

    # Timing: each call rotates the same rows again; the cost is the same.
    op_s = time_call(
        lambda: mla_decode_branch_fp8(*case.args(), **case.options, rerun_layers=True),
        repeat=args.repeat,
    )
    ref_s = time_call(lambda: run_reference(case), warmup=1, repeat=max(3, args.repeat // 3))

    rows = [
        ("max abs error (output)", f"{output_report.max_abs_error:.4g}"),
        ("max |reference| (output)", f"{output_report.max_reference:.4g}"),
        ("relative error (max err / max|ref|)", f"{output_report.relative_error:.3g}"),
        ("allowed relative error", f"{output_report.tolerance:.3g}"),
        (
            "cache rows updated / rel. error",
            f"{cache_report.rows_updated} / {cache_report.max_row_error:.3g}",
        ),
        ("other cache bytes", "identical" if cache_report.untouched_identical else "CHANGED"),
        ("time per call: pymla op", f"{op_s * 1e3:.3f} ms"),
        ("time per call: torch reference", f"{ref_s * 1e3:.3f} ms"),
        ("speed-up over reference", f"{ref_s / op_s:.1f}x"),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    passed = output_report.passed and cache_report.passed
    print()
    print(
        "PARITY OK"
        if passed
        else f"PARITY FAILED: output {output_report.describe()}; cache {cache_report.describe()}"
    )
    return 0 if passed else 1
