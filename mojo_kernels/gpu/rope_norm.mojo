"""Steps 1, 2 and the rope part of 4 on the GPU: RMSNorm + RoPE of the new cache rows, RoPE of q.

The work of one token is a device function (`rope_norm_cache_row`, `rope_q_pair`)
so that the fused q kernel (`steps_fused.mojo`) runs it as extra blocks of its
own launch; `rope_norm_cache_kernel` and `rope_q_kernel` launch it alone.
"""

from std.math import sqrt
from std.memory import stack_allocation

from max.gpu import WARP_SIZE, barrier, block_idx, thread_idx
from max.gpu.memory import AddressSpace
from max.gpu.primitives import warp

from .addressing import ELEMENTWISE_THREADS
from ..common import DPtr
from ..spec import rope_pair
from .params import DeviceBatch, DeviceCache, GFPtr, GPtr, KernelParams


@fieldwise_init
struct CacheRowsParams[dtype: DType](KernelParams):
    """Steps 1 and 2 on the new tokens' cache rows: where the rows are and how to normalize them.

    `count` rows (the new tokens; 0 = none); the raw row of token `t` is
    `new_rows[t]` when `has_new_rows`, else the cache row itself.
    """

    var cache: DeviceCache[Self.dtype]
    var batch: DeviceBatch
    var freqs_cis: DPtr[Self.dtype]
    var gamma: DPtr[Self.dtype]
    var epsilon: Float32
    var kv_lora_rank: Int32
    var rope_dim: Int32
    var new_rows: DPtr[Self.dtype]
    var has_new_rows: Int32
    var count: Int32


@fieldwise_init
struct RopeQParams[dtype: DType](KernelParams):
    """Parameters of `rope_q_kernel`: `q_full[t, h, R:] = rnd(rope(q[t, h, Dn:]))`."""

    var q: GPtr[Self.dtype]  # [T, H, Dn + Dr]
    var batch: DeviceBatch
    var freqs_cis: GPtr[Self.dtype]
    var q_full: GFPtr  # [T, H, R + Dr]
    var num_heads: Int32
    var nope_dim: Int32
    var rope_dim: Int32
    var kv_lora_rank: Int32


# ---------------------------------------------------------------------------
# Steps 1 and 2: the new cache rows, in place
# ---------------------------------------------------------------------------


@always_inline
def rope_norm_cache_row[dtype: DType, threads: Int](a: CacheRowsParams[dtype], t: Int):
    """RMSNorm of `row[:R]`, RoPE of `row[R:]` for new token `t`, by a block of `threads` threads.

    Every thread of the block calls it (it has a barrier). With a shard of the
    cache, only a token the shard holds, at its slot (the whole block returns otherwise).
    """
    var sums = stack_allocation[threads // WARP_SIZE, Float32, address_space=AddressSpace.SHARED]()
    var tid = thread_idx.x
    var rank = Int(a.kv_lora_rank)
    var rope = Int(a.rope_dim)
    var b = a.batch.request(t)
    var pos = a.batch.position(b, t)
    var shard = a.batch.shard()
    if not shard.owns(pos):
        return
    var row = a.cache.blocks.unsafe_offset(a.cache.row_offset(b, shard.local_count(pos)))

    var src = a.new_rows.unsafe_offset(t * Int(a.cache.key_dim)) if a.has_new_rows != 0 else row
    var sum_sq = Float32(0)
    for i in range(tid, rank, threads):
        var x = src.unsafe_load(i).cast[DType.float32]()
        sum_sq += x * x
    sum_sq = warp.sum(sum_sq)
    if tid % WARP_SIZE == 0:
        sums.unsafe_store(tid // WARP_SIZE, sum_sq)
    barrier()
    var total = Float32(0)
    comptime for w in range(threads // WARP_SIZE):
        total += sums.unsafe_load(w)
    var inv = Float32(1.0) / sqrt(total / Float32(rank) + a.epsilon)
    for i in range(tid, rank, threads):
        var x = src.unsafe_load(i).cast[DType.float32]()
        var g = a.gamma.unsafe_load(i).cast[DType.float32]()
        row.unsafe_store(i, (x * inv * g).cast[dtype]())

    var rsrc = src.unsafe_offset(rank)
    var rrow = row.unsafe_offset(rank)
    var freqs = a.freqs_cis.unsafe_offset(pos * rope)
    for j in range(tid, rope // 2, threads):
        var x0 = rsrc.unsafe_load(2 * j).cast[DType.float32]()
        var x1 = rsrc.unsafe_load(2 * j + 1).cast[DType.float32]()
        var c = freqs.unsafe_load(2 * j).cast[DType.float32]()
        var s = freqs.unsafe_load(2 * j + 1).cast[DType.float32]()
        var y = rope_pair(x0, x1, c, s)
        rrow.unsafe_store(2 * j, y[0].cast[dtype]())
        rrow.unsafe_store(2 * j + 1, y[1].cast[dtype]())


def rope_norm_cache_kernel[dtype: DType](a: CacheRowsParams[dtype]):
    """One block of ELEMENTWISE_THREADS per new token (grid `a.count`)."""
    rope_norm_cache_row[dtype, ELEMENTWISE_THREADS](a, block_idx.x)


# ---------------------------------------------------------------------------
# Steps 1 and 4 on q: rope part of q_full
# ---------------------------------------------------------------------------


@always_inline
def rope_q_pair[
    dtype: DType
](q_row: GPtr[dtype], freqs_row: GPtr[dtype], q_full_row: GFPtr, nope: Int, rank: Int, j: Int):
    """`q_full_row[R + 2j : R + 2j + 2] = rnd(rope(q_row[Dn + 2j : Dn + 2j + 2]))` (dtype values as float32)."""
    var x0 = q_row.unsafe_load(nope + 2 * j).cast[DType.float32]()
    var x1 = q_row.unsafe_load(nope + 2 * j + 1).cast[DType.float32]()
    var c = freqs_row.unsafe_load(2 * j).cast[DType.float32]()
    var s = freqs_row.unsafe_load(2 * j + 1).cast[DType.float32]()
    var y = rope_pair(x0, x1, c, s)
    q_full_row.unsafe_store(rank + 2 * j, y[0].cast[dtype]().cast[DType.float32]())
    q_full_row.unsafe_store(rank + 2 * j + 1, y[1].cast[dtype]().cast[DType.float32]())


def rope_q_kernel[dtype: DType](p: RopeQParams[dtype]):
    """One block per token: `q_full[t, h, R:] = rope(q[t, h, Dn:])` for every head."""
    var tid = thread_idx.x
    var t = block_idx.x
    var heads = Int(p.num_heads)
    var nope = Int(p.nope_dim)
    var rope = Int(p.rope_dim)
    var rank = Int(p.kv_lora_rank)
    var pos = p.batch.token_position(t)
    var freqs = p.freqs_cis.unsafe_offset(pos * rope)
    var pairs = rope // 2
    for e in range(tid, heads * pairs, ELEMENTWISE_THREADS):
        var h = e // pairs
        rope_q_pair[dtype](
            p.q.unsafe_offset((t * heads + h) * (nope + rope)), freqs,
            p.q_full.unsafe_offset((t * heads + h) * (rank + rope)), nope, rank, e % pairs,
        )
