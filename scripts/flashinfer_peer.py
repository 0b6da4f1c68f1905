"""FlashInfer's MLA decode (fa3 backend) timed at pymla's benchmark shapes, on the H200.

Runs ON the device, beside `.peers/peers.py` (FlashMLA, vLLM's Triton MLA) in the same
call, with FlashInfer and its missing dependencies installed from wheels
(`WITH_FLASHINFER=1 scripts/fetch_device_wheels.sh`, scripts/README.md). Needs torch,
triton (for `do_bench`) and the machine's nvcc: the first plan of each (dtype, head dim)
JIT-compiles FlashInfer's Hopper MLA kernel (cached under ~/.cache/flashinfer).

Same cases and timing as peers.py: q [b, h, 576] bf16, a paged latent cache
[pages, 64, 576] (random pages, random values), V = cache[..., :512], ctx + 1 keys per
request, scale 1/sqrt(192); `bench_ms` = triton.testing.do_bench median (CUDA events,
L2 flushed). `--kv fp8` also times an e4m3 cache with one per-tensor scale
(`scale_mode="kv-per-tensor"`), FlashInfer's fp8 dense decode (issue 24's peer). Its 0.7.2
MLA wrapper has no per-token scales (`scale_mode`: default, kv-per-tensor, bmm-scalar,
bmm-tensor; `flashinfer/mla/_batch_mla/_planning.py`), so per-tensor is the peer.

    python3 scripts/flashinfer_peer.py --json $OUT/flashinfer.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

import torch

T0 = time.perf_counter()
D, DV, DR, PAGE = 576, 512, 64, 64
SCALE = 1.0 / math.sqrt(192)
KEY_SHAPES = [(128, 64, 8192), (16, 128, 32768), (16, 8, 8192), (128, 1, 8192)]


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def time_bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def reference(q, pool, block_tables, lens) -> torch.Tensor:
    """float32 attention per request: q [b, h, 576] -> [b, h, 512] (pool already dequantized)."""
    outs = []
    for i, length in enumerate(lens):
        n = -(-length // PAGE)
        k = pool[block_tables[i, :n].long()].reshape(-1, D)[:length].float()
        s = (q[i].float() @ k.T) * SCALE
        outs.append(torch.softmax(s, -1) @ k[:, :DV])
    return torch.stack(outs)


def rel_l2(out, ref) -> float:
    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm())


class FlashInferMLA:
    """One planned `BatchMLAPagedAttentionWrapper` (fa3) per case."""

    def __init__(self, backend: str) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        self.wrapper_type = BatchMLAPagedAttentionWrapper
        self.metadata_type = MLAPlanMetadata
        self.backend = backend
        self.workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def make(self, q, pool, block_tables, lens, kv_scale=None):
        """A callable running one decode step; `pool` bf16 or e4m3 [pages, PAGE, D]."""
        b, h, _ = q.shape
        wrapper = self.wrapper_type(self.workspace, backend=self.backend)
        metadata = self.metadata_type.dense(
            cum_seq_lens_q=torch.arange(b + 1, dtype=torch.int32, device="cuda"),
            block_tables=block_tables,
            seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
            max_q_len=1,
        )
        fp8 = pool.dtype == torch.float8_e4m3fn
        wrapper.plan(
            metadata=metadata,
            num_heads=h,
            head_dim_ckv=DV,
            head_dim_kpe=DR,
            page_size=PAGE,
            causal=False,
            sm_scale=SCALE,
            q_data_type=q.dtype,
            kv_data_type=pool.dtype,
            query_layout="split",
            kv_cache_layout="split",
            scale_mode="kv-per-tensor" if fp8 else "default",
        )
        q_nope, q_pe = q[..., :DV], q[..., DV:]
        ckv, kpe = pool[..., :DV], pool[..., DV:]
        out = torch.full((b, h, DV), float("nan"), dtype=q.dtype, device="cuda")
        extra = {"ckv_scale": kv_scale, "kpe_scale": kv_scale} if fp8 else {}

        def fn():
            return wrapper.run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), out=out, **extra)

        return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batches", default="1,8,64,128")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument(
        "--kv", default="bf16,fp8", help="cache dtypes to time: bf16, fp8 (e4m3, per-tensor scale)"
    )
    ap.add_argument("--backend", default="fa3")
    ap.add_argument("--budget", type=float, default=400)
    ap.add_argument(
        "--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "flashinfer.json")
    )
    a = ap.parse_args()
    heads = [int(x) for x in a.heads.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    ctxs = [int(x) for x in a.contexts.split(",")]
    kvs = a.kv.split(",")
    import flashinfer

    res = {
        "env": {
            "torch": torch.__version__,
            "flashinfer": flashinfer.__version__,
            "gpu": torch.cuda.get_device_name(0),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        },
        "args": vars(a),
        "check": [],
        "bench": [],
    }

    def save():
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)

    impl = FlashInferMLA(a.backend)
    need = max(b * -(-(c + 1) // PAGE) for b in batches for c in ctxs)
    torch.manual_seed(0)
    pool = torch.empty(need, PAGE, D, dtype=torch.bfloat16, device="cuda").normal_()
    # fp8 cache: one per-tensor scale, values quantized from the bf16 pool (never zeros)
    kv_scale = float(pool.abs().amax()) / 448.0
    pools = {"bf16": pool}
    if "fp8" in kvs:
        pools["fp8"] = (pool.float() / kv_scale).to(torch.float8_e4m3fn)
    log(f"pool {need} pages of {PAGE}: {pool.numel() * 2 / 1e9:.2f} GB; cache dtypes {list(pools)}")

    for h in heads:  # correctness: ragged lengths, random pages, float32 reference
        lens = [1000, 517, 65]
        bt = torch.randperm(need, device="cuda")[: 3 * 16].view(3, 16).int()
        q = torch.randn(3, h, D, device="cuda").to(torch.bfloat16)
        row = {"h": h, "lens": lens}
        for kv, p in pools.items():
            scale = kv_scale if kv == "fp8" else None
            deq = p if kv == "bf16" else p.float() * kv_scale
            try:
                t = time.perf_counter()
                out = impl.make(q, p, bt, lens, scale)()
                torch.cuda.synchronize()
                row[f"{kv}_first_call_s"] = round(time.perf_counter() - t, 1)  # includes the JIT
                row[f"{kv}_rel_l2"] = rel_l2(out, reference(q, deq, bt, lens))
            except Exception as exc:  # noqa: BLE001
                row[f"{kv}_error"] = repr(exc)[:800]
                traceback.print_exc()
        res["check"].append(row)
        log(f"check h{h}: {row}")
        save()

    grid = KEY_SHAPES + [
        (h, b, c) for h in heads for b in batches for c in ctxs if (h, b, c) not in KEY_SHAPES
    ]
    for h, b, c in grid:
        if time.perf_counter() - T0 > a.budget:
            log("budget reached")
            res["truncated"] = True
            break
        length = c + 1
        ppr = -(-length // PAGE)
        bt = torch.randperm(need, device="cuda")[: b * ppr].view(b, ppr).int()
        q = torch.randn(b, h, D, device="cuda").to(torch.bfloat16)
        row = {"h": h, "b": b, "ctx": c, "keys": length, "flops": 2 * h * length * (D + DV) * b}
        for kv, p in pools.items():
            row[f"{kv}_cache_bytes"] = b * length * D * p.element_size()
            try:
                fn = impl.make(q, p, bt, [length] * b, kv_scale if kv == "fp8" else None)
                fn()
                torch.cuda.synchronize()
                row[f"flashinfer_{kv}_bench_ms"] = round(time_bench(fn) * 1e3, 4)
            except Exception as exc:  # noqa: BLE001
                row[f"flashinfer_{kv}_error"] = repr(exc)[:300]
                log(f"  {kv} h{h} b{b} ctx{c} FAILED {exc!r}")
        res["bench"].append(row)
        log(
            f"h{h:3d} b{b:3d} ctx{c:6d}: "
            + " ".join(f"{k}={v}" for k, v in row.items() if k.endswith("_ms"))
        )
        save()
    log("done")


if __name__ == "__main__":
    main()
