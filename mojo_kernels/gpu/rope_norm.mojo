"""Steps 1, 2 and the rope part of 4 on the GPU: RMSNorm + RoPE of the new cache rows, RoPE of q.

The work of one token is a device function (`rope_norm_cache_row`, `rope_q_pairs`)
so that the fused q kernel (`steps_fused.mojo`) runs it as extra blocks of its
own launch; `rope_norm_cache_kernel` and `rope_q_kernel` launch it alone.
An `fp8_ds_mla` cache's new rows are quantized as they are stored (`rope_norm_fp8_row`).
"""

from std.math import sqrt
from std.memory import stack_allocation
from std.sys import size_of

from max.gpu import WARP_SIZE, barrier, block_idx, thread_idx
from max.gpu.memory import AddressSpace
from max.gpu.primitives import warp

from .addressing import ELEMENTWISE_THREADS
from ..common import DPtr, FPtr, U8Ptr
from ..fp8 import cache_block_scale, e4m3_bytes, round_to_e4m3, widen_e4m3
from ..paged_cache import FP8_SCALE_BLOCK
from ..spec import rope_pair
from .params import DeviceBatch, DeviceCache, DeviceFp8Rows, GFPtr, GPtr, KernelParams

comptime SPtr[T: AnyType] = Pointer[T, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


@fieldwise_init
struct CacheRowsParams[dtype: DType](KernelParams):
    """Steps 1 and 2 on the new tokens' cache rows: where the rows are and how to normalize them.

    `count` rows (the new tokens; 0 = none); the raw row of token `t` is
    `new_rows[t]` when `has_new_rows`, else the cache row itself. With an
    `fp8_ds_mla` cache (`fp8.active`) the rows are `fp8`'s, quantized on store.
    """

    var cache: DeviceCache[Self.dtype]  # key_dim: values per row (R + Dr)
    var fp8: DeviceFp8Rows
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
def block_sum[threads: Int](x: Float32, sums: SPtr[Float32]) -> Float32:
    """The sum of `x` over the block's `threads` threads (every thread calls it; it has a barrier)."""
    var tid = thread_idx.x
    var s = warp.sum(x)
    if tid % WARP_SIZE == 0:
        sums.unsafe_store(tid // WARP_SIZE, s)
    barrier()
    var total = Float32(0)
    comptime for w in range(threads // WARP_SIZE):
        total += sums.unsafe_load(w)
    return total


comptime KEPT = 4
"""Latent values a thread keeps in registers between the RMSNorm's two passes: `KEPT` values `tid + k
threads` of a row of dtype values (fp8 rows: one vector of 4, `rope_norm_fp8_row`, whose second pass (quantization,
with its divisions and warp reductions) is then one copy of the code, not four: the q step's kernel is
large (about 7,200 SASS instructions) and four copies made it 19% larger and slower (H100, 2026-12-07c,
16 h b8 8k on fp8 rows: the q step 11.5 -> 12.5 us)). The second pass reads the row again past them."""


@always_inline
def load_rope_pair[
    src_dtype: DType, freq_dtype: DType
](src: DPtr[src_dtype], freqs: DPtr[freq_dtype], j: Int) -> SIMD[DType.float32, 4]:
    """Rope pair `j` of `src` and its `(cos, sin)`: `(x0, x1, c, s)` as float32."""
    return SIMD[DType.float32, 4](
        src.unsafe_load(2 * j).cast[DType.float32](),
        src.unsafe_load(2 * j + 1).cast[DType.float32](),
        freqs.unsafe_load(2 * j).cast[DType.float32](),
        freqs.unsafe_load(2 * j + 1).cast[DType.float32](),
    )


@always_inline
def store_rope_pair[dst_dtype: DType](dst: DPtr[dst_dtype], j: Int, v: SIMD[DType.float32, 4]):
    """`dst[2j : 2j + 2] = rope(x0, x1)` of `v = (x0, x1, c, s)` (`load_rope_pair`)."""
    var y = rope_pair(v[0], v[1], v[2], v[3])
    dst.unsafe_store(2 * j, y[0].cast[dst_dtype]())
    dst.unsafe_store(2 * j + 1, y[1].cast[dst_dtype]())


@always_inline
def rotate_rope_part[
    src_dtype: DType, dst_dtype: DType, freq_dtype: DType, threads: Int
](src: DPtr[src_dtype], dst: DPtr[dst_dtype], freqs: DPtr[freq_dtype], rope: Int, first: SIMD[DType.float32, 4]):
    """`dst[:rope] = rope(src[:rope])` in pairs, by the block's threads (`dst` may be `src`). `first`: this
    thread's pair `tid` (`load_rope_pair`), loaded at the start of the row's work so that its latency
    overlaps the RMSNorm's loads instead of following its stores."""
    var tid = thread_idx.x
    if tid < rope // 2:
        store_rope_pair(dst, tid, first)
    for j in range(tid + threads, rope // 2, threads):
        store_rope_pair(dst, j, load_rope_pair(src, freqs, j))


@always_inline
def first_rope_pair[
    src_dtype: DType, freq_dtype: DType
](src: DPtr[src_dtype], freqs: DPtr[freq_dtype], rope: Int) -> SIMD[DType.float32, 4]:
    """This thread's pair `tid` of the rope part (`load_rope_pair`; zeros past the part)."""
    var tid = thread_idx.x
    if tid < rope // 2:
        return load_rope_pair(src, freqs, tid)
    return SIMD[DType.float32, 4](0)


@always_inline
def rope_norm_cache_row[dtype: DType, threads: Int](a: CacheRowsParams[dtype], t: Int):
    """RMSNorm of `row[:R]`, RoPE of `row[R:]` for new token `t`, by a block of `threads` threads.

    Every thread of the block calls it (it has a barrier). With a shard of the
    cache, only a token the shard holds, at its slot (the whole block returns otherwise).
    An `fp8_ds_mla` cache (`a.fp8.active`, bfloat16 ops) takes `rope_norm_fp8_row`.
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
    comptime if dtype == DType.bfloat16:
        if a.fp8.active != 0:
            rope_norm_fp8_row[dtype, threads](a, t, a.fp8.row(b, shard.local_count(pos)), pos, sums)
            return
    var row = a.cache.blocks.unsafe_offset(a.cache.row_offset(b, shard.local_count(pos)))

    var src = a.new_rows.unsafe_offset(t * Int(a.cache.key_dim)) if a.has_new_rows != 0 else row
    var freqs = a.freqs_cis.unsafe_offset(pos * rope)
    var first = first_rope_pair(src.unsafe_offset(rank), freqs, rope)
    # Values `tid + k threads`, k < KEPT, stay in registers for the second pass.
    var kept = SIMD[DType.float32, KEPT](0)
    var kept_gamma = SIMD[DType.float32, KEPT](0)  # loaded beside the values, not after the reduction
    var sum_sq = Float32(0)
    comptime for k in range(KEPT):
        var i = tid + k * threads
        if i < rank:
            kept[k] = src.unsafe_load(i).cast[DType.float32]()
            kept_gamma[k] = a.gamma.unsafe_load(i).cast[DType.float32]()
            sum_sq += kept[k] * kept[k]
    for i in range(tid + KEPT * threads, rank, threads):
        var x = src.unsafe_load(i).cast[DType.float32]()
        sum_sq += x * x
    var total = block_sum[threads](sum_sq, sums)  # its barrier: every read of the first pass is done
    var inv = Float32(1.0) / sqrt(total / Float32(rank) + a.epsilon)
    comptime for k in range(KEPT):
        var i = tid + k * threads
        if i < rank:
            row.unsafe_store(i, (kept[k] * inv * kept_gamma[k]).cast[dtype]())
    for i in range(tid + KEPT * threads, rank, threads):
        var x = src.unsafe_load(i).cast[DType.float32]()
        var g = a.gamma.unsafe_load(i).cast[DType.float32]()
        row.unsafe_store(i, (x * inv * g).cast[dtype]())
    rotate_rope_part[dtype, dtype, dtype, threads](src.unsafe_offset(rank), row.unsafe_offset(rank), freqs, rope, first)


@always_inline
def rope_norm_fp8_row[
    dtype: DType, threads: Int
](a: CacheRowsParams[dtype], t: Int, row: U8Ptr, pos: Int, sums: SPtr[Float32]):
    """Steps 1 and 2 of new token `t` into its `fp8_ds_mla` row `row`, as the CPU's `Fp8LatentRows.store_row`.

    The source is `new_rows[t]` when given, else the row's own values (e4m3 x
    scale, exact). RMSNorm rounded to `dtype` (bfloat16) as the bf16 cache
    stores it; then warp `w` quantizes the 128-value blocks `w, w + warps, ..`
    (4 values per lane): scale `cache_block_scale(amax)`, bytes
    `e4m3_rne(x / scale)`; the rope part rotated into the row as bfloat16.
    The loads of the rope pair and of the first pass are the row's only trip to memory (but past
    one vector a thread, read again in the second pass).
    """
    var tid = thread_idx.x
    var rank = Int(a.kv_lora_rank)
    var rope = Int(a.rope_dim)
    var has_new = a.has_new_rows != 0
    var src = a.new_rows.unsafe_offset(t * (rank + rope))
    var scales = a.fp8.scales(row)
    var rope_row = a.fp8.rope(row)

    var freqs = a.freqs_cis.unsafe_offset(pos * rope)
    var first = first_rope_pair(src.unsafe_offset(rank), freqs, rope) if has_new else first_rope_pair(rope_row, freqs, rope)

    # Values `4 tid ..` lie in 128-value block `warp`, the block the thread's warp quantizes first in the
    # second pass (block `warp + k warps` holds `4 (tid + k threads) ..`): they stay in registers for it.
    var i0 = 4 * tid
    var kept = SIMD[DType.float32, 4](0)
    var kept_gamma = SIMD[DType.float32, 4](0)  # loaded beside the values, not after the reduction
    if i0 < rank:
        kept = fp8_row_source(src, row, scales, has_new, i0)
        kept_gamma = a.gamma.unsafe_load[width=4](i0).cast[DType.float32]()
    var sum_sq = kept * kept
    for i in range(i0 + 4 * threads, rank, 4 * threads):
        var x = fp8_row_source(src, row, scales, has_new, i)
        sum_sq += x * x
    var total = block_sum[threads](sum_sq.reduce_add(), sums)  # its barrier: every read of pass 1 is done
    var inv = Float32(1.0) / sqrt(total / Float32(rank) + a.epsilon)
    # The warp's lanes agree on `i < rank`: a 128-value block is whole (rank % 128 == 0). Past the kept
    # vector the warp reads its block again before writing it (in place, the warp's reduction orders
    # the reads of the old scale before lane 0 writes the new one).
    for i in range(i0, rank, 4 * threads):
        var x = kept
        var g = kept_gamma
        if i != i0:
            x = fp8_row_source(src, row, scales, has_new, i)
            g = a.gamma.unsafe_load[width=4](i).cast[DType.float32]()
        store_fp8_values[dtype](row, scales, x, g, inv, i)
    if has_new:
        rotate_rope_part[dtype, DType.bfloat16, dtype, threads](src.unsafe_offset(rank), rope_row, freqs, rope, first)
    else:
        rotate_rope_part[DType.bfloat16, DType.bfloat16, dtype, threads](rope_row, rope_row, freqs, rope, first)


@always_inline
def store_fp8_values[
    dtype: DType
](row: U8Ptr, scales: FPtr, x: SIMD[DType.float32, 4], g: SIMD[DType.float32, 4], inv: Float32, i: Int):
    """One warp, lane `l` holding latent values `x` = `i .. i + 3` of a 128-value block (`i = 128 blk + 4 l`)
    and their RMSNorm weights `g`: RMSNorm rounded to `dtype`, the block's scale `cache_block_scale(amax)`
    (lane 0 stores it), the bytes `e4m3_rne(y / scale)`."""
    var y = (x * inv * g).cast[dtype]().cast[DType.float32]()
    var s = cache_block_scale(warp.max(abs(y).reduce_max()))
    row.unsafe_offset(i).unsafe_store[alignment=4](0, e4m3_bytes[4](round_to_e4m3[4](y / s)))
    if thread_idx.x % WARP_SIZE == 0:
        scales.unsafe_store(i // FP8_SCALE_BLOCK, s)


@always_inline
def fp8_row_source[
    dtype: DType
](src: DPtr[dtype], row: U8Ptr, scales: FPtr, has_new: Bool, i: Int) -> SIMD[DType.float32, 4]:
    """Latent values `i .. i + 3` of a new fp8 row's source: `new_rows` (`has_new`), else the row's own (e4m3 x scale)."""
    if has_new:
        return src.unsafe_load[width=4](i).cast[DType.float32]()
    return widen_e4m3[4](row.unsafe_offset(i).unsafe_load[width=4, alignment=4](0)) * scales.unsafe_load(
        i // FP8_SCALE_BLOCK
    )


def rope_norm_cache_kernel[dtype: DType](a: CacheRowsParams[dtype]):
    """One block of ELEMENTWISE_THREADS per new token (grid `a.count`)."""
    rope_norm_cache_row[dtype, ELEMENTWISE_THREADS](a, block_idx.x)


# ---------------------------------------------------------------------------
# Steps 1 and 4 on q: rope part of q_full
# ---------------------------------------------------------------------------


@always_inline
def rope_q_pairs[
    dtype: DType, w: Int
](q_row: GPtr[dtype], freqs_row: GPtr[dtype], q_full_row: GFPtr, nope: Int, rank: Int, j: Int):
    """`q_full_row[R + 2wj : R + 2w(j + 1)] = rnd(rope(q_row[Dn + 2wj : Dn + 2w(j + 1)]))`: pairs `wj .. wj + w - 1`
    (dtype values as float32). `w` > 1: one vector load or store each, the offsets a multiple of `2w`
    elements (16-byte aligned for `w` 8 of bf16 / f16)."""
    comptime N = 2 * w
    comptime A_IN = size_of[dtype]() if w == 1 else min(16, N * size_of[dtype]())
    comptime A_OUT = 4 if w == 1 else 16
    var x = q_row.unsafe_offset(nope + N * j).unsafe_load[width=N, alignment=A_IN](0).cast[DType.float32]().deinterleave()
    var f = freqs_row.unsafe_offset(N * j).unsafe_load[width=N, alignment=A_IN](0).cast[DType.float32]().deinterleave()
    comptime V = SIMD[DType.float32, w]
    var y = rope_pair(rebind[V](x[0]), rebind[V](x[1]), rebind[V](f[0]), rebind[V](f[1]))
    q_full_row.unsafe_offset(rank + N * j).unsafe_store[alignment=A_OUT](
        0, y[0].interleave(y[1]).cast[dtype]().cast[DType.float32]()
    )


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
        rope_q_pairs[dtype, 1](
            p.q.unsafe_offset((t * heads + h) * (nope + rope)), freqs,
            p.q_full.unsafe_offset((t * heads + h) * (rank + rope)), nope, rank, e % pairs,
        )
