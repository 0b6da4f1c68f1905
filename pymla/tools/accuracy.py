"""``python -m pymla accuracy``: what the fp8_ds_mla cache costs in accuracy, per shape.

For each shape (heads x context) it draws one decode step whose cached rows
look like a model's (latent part RMSNormed with a random ``gamma``, rope part
standard normal), stores the same rows in a bfloat16 cache and, quantized
(:mod:`pymla.cache_format`), in an ``fp8_ds_mla`` cache, and passes the same
raw new rows (``new_rows``) to the op on each. It prints the relative L2
error ``||x - ref|| / ||ref||`` of the attention output (step 5) and of the
final output (step 6) of:

* the op with the fp8 cache against the float32 reference (the same math
  without any rounding: float32 q, cache rows and steps; the weights stay fp8);
* the op with the bfloat16 cache against the same reference (what bf16 costs);
* the op with the fp8 cache against the op with the bfloat16 cache;

and the relative L2 error of the fp8 cache's latent values against the
bfloat16 rows (e4m3's unit roundoff is ``2^-4``: uniformly spread rounding
errors give about ``2^-4 / sqrt(3) = 0.036`` of each value's magnitude
within a binade, less for values near the top of one). Saves JSON with the
CPU model in its name.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .. import mla_decode_branch_fp8
from ..__main__ import CommandParser, int_at_least, json_file
from ..cache_format import dequantize_rows, quantize_rows
from ..cpu_paths import cpu_model, cpu_signature, resolve_cpu_path
from ..reference import KVCacheTensors, mla_decode_branch_fp8_stages, rms_norm
from .bench import file_stem, save_json
from .scenario import make_case

RESULTS = Path("benchmarks/results")


def relative_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((x.float() - ref).norm() / ref.norm())


def _model_like_rows(case, seed: int) -> None:
    """Replaces every cache row by an RMSNormed latent part (the case's gamma) and a normal rope part."""
    cache = case.cache
    g = torch.Generator().manual_seed(seed)
    shape = (*cache.blocks.shape[:-1], cache.head_dim)
    rows = torch.randn(shape, generator=g)
    # a few strong channels, as trained latents have, then the norm
    rows[..., : cache.kv_lora_rank] *= 1 + 3 * torch.rand(cache.kv_lora_rank, generator=g) ** 8
    rank = cache.kv_lora_rank
    rows[..., :rank] = rms_norm(rows[..., :rank], case.kv_norm_gamma, 1e-6)
    cache.blocks.copy_(rows.to(torch.bfloat16))


def measure(heads: int, context: int, batch: int, new_tokens: int, seed: int) -> dict:
    """One shape: the errors of the module docstring."""
    shape = dict(
        num_heads=heads,
        page_size=64,
        cache_lengths=(context,) * batch,
        new_tokens=(new_tokens,) * batch,
        num_layers=1,
        layer_idx=0,
        freqs="rope",
    )
    bf16 = make_case(seed, **shape)
    fp8 = make_case(seed, cache_format="fp8_ds_mla", **shape)  # same pages, weights and q
    _model_like_rows(bf16, seed + 1)
    rank = bf16.cache.kv_lora_rank
    fp8.cache.blocks.copy_(quantize_rows(bf16.cache.blocks, rank))
    new_rows = bf16.take_new_rows(seed + 2)  # raw rows; the op normalizes them
    fp8.take_new_rows(seed + 2)
    # The float32 reference: the bf16 cache's rows (unquantized) and every input in float32.
    exact_cache = KVCacheTensors(
        bf16.cache.blocks.float(), bf16.cache.cache_lengths, bf16.cache.lookup_table
    )
    ref = mla_decode_branch_fp8_stages(
        bf16.q.float(),
        bf16.input_row_offsets,
        bf16.freqs_cis.float(),
        bf16.kv_norm_gamma.float(),
        exact_cache,
        0,
        *(bf16.weights[k] for k in ("w_uk", "w_uk_scale", "w_uv", "w_uv_scale")),
        **bf16.options,
        new_rows=new_rows.float(),
    )
    results = {}
    for name, case in (("bf16", bf16), ("fp8", fp8)):
        att = torch.empty(bf16.q.shape[0], heads, rank, dtype=torch.bfloat16)
        out = mla_decode_branch_fp8(
            *case.args(), **case.options, attention_out=att, new_rows=new_rows
        )
        results[name] = (att, out)
    latent_bf16 = bf16.cache.blocks[..., :rank].float()
    latent_fp8 = dequantize_rows(fp8.cache.blocks, rank)[..., :rank]
    (att8, out8), (att16, out16) = results["fp8"], results["bf16"]
    return {
        "heads": heads,
        "context": context,
        "batch": batch,
        "new_tokens": new_tokens,
        "attention": {
            "fp8_vs_f32_reference": relative_l2(att8, ref.attention),
            "bf16_vs_f32_reference": relative_l2(att16, ref.attention),
            "fp8_vs_bf16_op": relative_l2(att8, att16),
        },
        "output": {
            "fp8_vs_f32_reference": relative_l2(out8, ref.out),
            "bf16_vs_f32_reference": relative_l2(out16, ref.out),
            "fp8_vs_bf16_op": relative_l2(out8, out16),
        },
        "cache_latent_fp8_vs_bf16": relative_l2(latent_fp8, latent_bf16),
    }


def run(argv: list[str], prog: str) -> int:
    parser = CommandParser(
        prog,
        "Relative L2 error of the op's attention output and output with the fp8_ds_mla cache, "
        "against the float32 reference and the op with a bfloat16 cache, per shape.",
    )
    parser.add_argument(
        "--heads", type=int_at_least(1), nargs="+", default=[16, 128], help="head counts"
    )
    parser.add_argument(
        "--contexts",
        type=int_at_least(1),
        nargs="+",
        default=[256, 2048, 8192],
        help="cached tokens per request",
    )
    parser.add_argument("--batch", type=int_at_least(1), default=2, help="requests")
    parser.add_argument(
        "--new-tokens", type=int_at_least(1), default=1, help="new tokens per request"
    )
    parser.add_argument("--seed", type=int, default=7, help="seed of every input")
    parser.add_argument(
        "--json",
        type=json_file,
        default=None,
        help="where to save the results; None: benchmarks/results/"
        "accuracy-fp8-cache-cpu-<model>.json",
    )
    args = parser.parse_args(argv)
    model = cpu_model()
    signature = cpu_signature()
    cpu_path = resolve_cpu_path(os.environ.get("PYMLA_CPU_PATH"), torch.bfloat16)
    if cpu_path == "amx":  # the AMX tiles read bf16 rows in place: fp8 rows take the other unit
        cpu_path = "avx512bf16 (fp8 cache; amx for steps 3 and 6)"
    path = args.json or RESULTS / f"accuracy-fp8-cache-{file_stem(model)}.json"
    print(f"CPU: {model} ({signature}; {os.cpu_count()} logical cores), step 5 path {cpu_path}")
    print(
        f"batch {args.batch} x {args.new_tokens} new token(s), bfloat16 op; relative L2 error "
        "||x - ref|| / ||ref||"
    )
    header = (
        f"{'heads':>5} {'context':>7} | {'att fp8/f32':>11} {'att bf16/f32':>12} "
        f"{'att fp8/bf16':>12} | {'out fp8/f32':>11} {'out bf16/f32':>12} {'out fp8/bf16':>12} "
        f"| {'cache fp8/bf16':>14}"
    )
    print(header)
    rows = []
    for heads in args.heads:
        for context in args.contexts:
            r = measure(heads, context, args.batch, args.new_tokens, args.seed)
            rows.append(r)
            a, o = r["attention"], r["output"]
            print(
                f"{heads:>5} {context:>7} | {a['fp8_vs_f32_reference']:>11.4f} "
                f"{a['bf16_vs_f32_reference']:>12.4f} {a['fp8_vs_bf16_op']:>12.4f} | "
                f"{o['fp8_vs_f32_reference']:>11.4f} {o['bf16_vs_f32_reference']:>12.4f} "
                f"{o['fp8_vs_bf16_op']:>12.4f} | {r['cache_latent_fp8_vs_bf16']:>14.4f}"
            )
    meta = {
        "cpu_model": model,
        "cpu_signature": signature,
        "cpu_count": os.cpu_count(),
        "cpu_path": cpu_path,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "seed": args.seed,
        "dtype": "bfloat16",
        "cache_format": "fp8_ds_mla",
    }
    save_json(path, {"meta": meta, "shapes": rows})
    print(f"saved {path}")
    return 0
