"""Steps 1, 2 and the rope part of 4 on the GPU: RMSNorm + RoPE of the new cache rows, RoPE of q."""

from std.math import exp, sqrt
from std.memory import bitcast, stack_allocation
from std.sys import size_of
from std.utils.numerics import neg_inf

from max.gpu import WARP_SIZE, barrier, block_idx, thread_idx
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.memory import AddressSpace, async_copy, async_copy_wait_all, external_memory
from max.gpu.primitives import warp

from ..attention import MaskSpec
from .addressing import (
    row_attention_meta,
    attention_slots,
    cache_row_offset,
    find_request,
    find_slot_request,
    slot_start,
    ELEMENTWISE_THREADS,
)
from ..common import DPtr, FPtr, U32Ptr, U8Ptr, ceil_div
from ..fp8 import FP8_MAX
from ..fp8_matmul import Granularity
from ..paged_cache import PagedLatentRows




# ---------------------------------------------------------------------------
# Steps 1 and 2: the new cache rows, in place
# ---------------------------------------------------------------------------


def rope_norm_cache_kernel[
    dtype: DType
](
    blocks: DPtr[dtype],
    lookup: U32Ptr,
    pages_per_request: Int32,
    page_size: Int32,
    page_stride: Int64,
    layer_offset: Int64,
    key_dim: Int32,
    offsets: U32Ptr,
    cache_lengths: U32Ptr,
    num_requests: Int32,
    freqs_cis: DPtr[dtype],
    gamma: DPtr[dtype],
    epsilon: Float32,
    kv_lora_rank: Int32,
    rope_dim: Int32,
    new_rows: DPtr[dtype],
    has_new_rows: Int32,
):
    """One block per new token: RMSNorm of `row[:R]`, RoPE of `row[R:]`.

    The raw row is `new_rows[t]` when `has_new_rows`, else the cache row itself.
    """
    var sums = stack_allocation[ELEMENTWISE_THREADS // WARP_SIZE, Float32, address_space=AddressSpace.SHARED]()
    var tid = thread_idx.x
    var t = block_idx.x
    var rank = Int(kv_lora_rank)
    var rope = Int(rope_dim)
    var b = find_request(offsets, Int(num_requests), t)
    var pos = Int(cache_lengths.unsafe_load(b)) + t - Int(offsets.unsafe_load(b))
    var row = blocks.unsafe_offset(
        cache_row_offset(
            lookup, Int(pages_per_request), Int(page_size), Int(page_stride), Int(layer_offset), Int(key_dim), b, pos
        )
    )

    var src = new_rows.unsafe_offset(t * Int(key_dim)) if has_new_rows != 0 else row
    var sum_sq = Float32(0)
    for i in range(tid, rank, ELEMENTWISE_THREADS):
        var x = src.unsafe_load(i).cast[DType.float32]()
        sum_sq += x * x
    sum_sq = warp.sum(sum_sq)
    if tid % WARP_SIZE == 0:
        sums.unsafe_store(tid // WARP_SIZE, sum_sq)
    barrier()
    var total = Float32(0)
    comptime for w in range(ELEMENTWISE_THREADS // WARP_SIZE):
        total += sums.unsafe_load(w)
    var inv = Float32(1.0) / sqrt(total / Float32(rank) + epsilon)
    for i in range(tid, rank, ELEMENTWISE_THREADS):
        var x = src.unsafe_load(i).cast[DType.float32]()
        var g = gamma.unsafe_load(i).cast[DType.float32]()
        row.unsafe_store(i, (x * inv * g).cast[dtype]())

    var rsrc = src.unsafe_offset(rank)
    var rrow = row.unsafe_offset(rank)
    var freqs = freqs_cis.unsafe_offset(pos * rope)
    for j in range(tid, rope // 2, ELEMENTWISE_THREADS):
        var x0 = rsrc.unsafe_load(2 * j).cast[DType.float32]()
        var x1 = rsrc.unsafe_load(2 * j + 1).cast[DType.float32]()
        var c = freqs.unsafe_load(2 * j).cast[DType.float32]()
        var s = freqs.unsafe_load(2 * j + 1).cast[DType.float32]()
        rrow.unsafe_store(2 * j, (x0 * c - x1 * s).cast[dtype]())
        rrow.unsafe_store(2 * j + 1, (x0 * s + x1 * c).cast[dtype]())


# ---------------------------------------------------------------------------
# Steps 1 and 4 on q: rope part of q_full
# ---------------------------------------------------------------------------


def rope_q_kernel[
    dtype: DType
](
    q: DPtr[dtype],
    offsets: U32Ptr,
    cache_lengths: U32Ptr,
    num_requests: Int32,
    freqs_cis: DPtr[dtype],
    q_full: FPtr,
    num_heads: Int32,
    nope_dim: Int32,
    rope_dim: Int32,
    kv_lora_rank: Int32,
):
    """One block per token: `q_full[t, h, R:] = rope(q[t, h, Dn:])` for every head."""
    var tid = thread_idx.x
    var t = block_idx.x
    var heads = Int(num_heads)
    var nope = Int(nope_dim)
    var rope = Int(rope_dim)
    var rank = Int(kv_lora_rank)
    var q_stride = nope + rope
    var full_stride = rank + rope
    var b = find_request(offsets, Int(num_requests), t)
    var pos = Int(cache_lengths.unsafe_load(b)) + t - Int(offsets.unsafe_load(b))
    var freqs = freqs_cis.unsafe_offset(pos * rope)
    var pairs = rope // 2
    for e in range(tid, heads * pairs, ELEMENTWISE_THREADS):
        var h = e // pairs
        var j = e % pairs
        var src = q.unsafe_offset((t * heads + h) * q_stride + nope + 2 * j)
        var dst = q_full.unsafe_offset((t * heads + h) * full_stride + rank + 2 * j)
        var x0 = src.unsafe_load(0).cast[DType.float32]()
        var x1 = src.unsafe_load(1).cast[DType.float32]()
        var c = freqs.unsafe_load(2 * j).cast[DType.float32]()
        var s = freqs.unsafe_load(2 * j + 1).cast[DType.float32]()
        dst.unsafe_store(0, (x0 * c - x1 * s).cast[dtype]().cast[DType.float32]())
        dst.unsafe_store(1, (x0 * s + x1 * c).cast[dtype]().cast[DType.float32]())
