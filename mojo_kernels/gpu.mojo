"""GPU (NVIDIA sm_90) implementation of `pymla.mla_decode_branch_fp8`.

Same math as the CPU stages and `pymla/reference.py`, as a chain of small
kernels on the stream of the op's `DeviceContext` (entry:
`mla_decode_branch_fp8_gpu`, given the `DecodeProblem` that `execute` unpacked):

1+2. `rope_norm_cache_kernel`   RMSNorm + RoPE of each new token's cache row, in place
1+4. `rope_q_kernel`            RoPE of q's rope part into `q_full[:, :, R:]`
3.   `quantize_kernel`          dynamic fp8 quantization of q_nope (the scale rule of
                                `pymla/quant.py`, bit for bit), kept dequantized in float32
     `fp8_matmul_kernel`        `q_full[:, :, :R] = a_dq @ dq(w_uk).T` per head, fp8 widened
                                in registers
5.   `attention_wgmma_kernel`   (gpu_attention_wgmma.mojo) Hopper warpgroup tensor cores,
                                64 packed rows per block (many heads), or
     `attention_mma_kernel`     (gpu_attention_mma.mojo) tensor cores, bf16 / f16 caches, or
     `attention_fma_kernel`     float32 FMA (float32 caches, other sizes): one block per
                                (request, tile of rows, key partition); all (token, head) rows
                                of the block share each key tile read from the paged cache
     `merge_kernel`             log-sum-exp merge of the key partitions
6.   `quantize_kernel` + `fp8_matmul_kernel` again for the output projection.

Rounding points are the reference's: `q_full` and the attention output
hold dtype values (in float32 buffers), the probabilities enter P V rounded
to dtype.

Nothing is read back to the host: a block finds its request on the device
from `input_row_offsets`; sizes the host cannot know (tokens per request,
cache lengths) only bound grids whose spare blocks exit at once.
Kernel arguments are raw pointers and fixed-width scalars (`Int` is not
`DevicePassable` in this version). Workspaces come from
`ctx.enqueue_create_buffer` and are released in stream order.
"""

from std.math import exp, sqrt
from std.memory import bitcast, stack_allocation
from std.sys import size_of
from std.utils.numerics import neg_inf

from max.gpu import WARP_SIZE, barrier, block_idx, thread_idx
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.memory import AddressSpace, async_copy, async_copy_wait_all, external_memory
from max.gpu.primitives import warp

from .attention import MaskSpec
from .gpu_common import (
    row_attention_meta,
    attention_slots,
    cache_row_offset,
    find_request,
    find_slot_request,
    slot_start,
)
from .common import DPtr, FPtr, U32Ptr, U8Ptr, ceil_div
from .gpu_attention_mma import MMA_ROWS, attention_mma_kernel, attention_mma_smem_bytes, mma_supported
from .gpu_attention_wgmma import (
    WG_BLOCK_THREADS,
    WG_ROWS,
    attention_wgmma_kernel,
    attention_wgmma_smem_bytes,
    wgmma_supported,
)
from .fp8 import FP8_MAX
from .fp8_matmul import Granularity
from .paged_cache import PagedLatentRows
from .problem import DecodeProblem


# Elementwise kernels: one block of ELEMENTWISE_THREADS per token.
comptime ELEMENTWISE_THREADS = 128

# Quantization: one warp per scale block.
comptime QUANT_WARPS = 4

# fp8 matmul: one thread per weight row, MATMUL_M_TILE activation rows per block
# staged in MATMUL_SMEM_FLOATS floats of shared memory.
comptime MATMUL_THREADS = 128
comptime MATMUL_M_TILE = 16
comptime MATMUL_SMEM_FLOATS = 8192

# Attention: ATT_ROWS (token, head) rows of one request per block, ATT_KT keys
# per tile, ATT_THREADS threads; each thread owns `cols_per_thread` value columns.
comptime ATT_ROWS = 16
comptime ATT_KT = 32
comptime ATT_WARPS = 8
comptime ATT_THREADS = ATT_WARPS * WARP_SIZE
comptime ATT_ROWS_PER_WARP = ATT_ROWS // ATT_WARPS
comptime ATT_KEY_PAD = 4  # elements of padding per key row in shared memory (bank spread)

# Partition planning.
comptime NUM_SMS = 132  # H200 (SXM)
comptime MIN_KEYS_PER_PARTITION = 256
comptime MAX_PARTITIONS = 64

comptime MERGE_THREADS = 128

# Tensor-core attention (gpu_attention_mma.mojo) for bf16 / f16 caches; False forces the FMA kernel.
comptime USE_TENSOR_CORES = True
# Its shapes, (16-row groups per block, keys per tile, warps per group), the fastest of the
# variants timed on the H200 (benchmarks/results/gpu_variants.log; `gpu_smoke.mojo variants`):
comptime MMA_MANY_HEADS = (2, 64, 4)  # 32 heads or more: two groups share every key tile
comptime MMA_FEW_HEADS = (1, 64, 8)  # fewer heads; needs kv_lora_rank % 128 == 0
comptime MMA_FEW_HEADS_SMALL_RANK = (1, 32, 4)  # fewer heads, kv_lora_rank % 64 == 0
# The warpgroup kernel (gpu_attention_wgmma.mojo) in the same tuple: 4 groups = its 64 rows,
# keys per tile, 0 warps per group marks it (two warpgroups of 4 warps).
comptime WGMMA_SHAPE = (WG_ROWS // MMA_ROWS, 64, 0)
comptime WGMMA_MIN_HEADS = 64  # heads (rows per token) from which it fills its 64-row tiles
comptime USE_WGMMA = False  # the op's default for many heads once verified on the H200 (pinned shapes test it)
comptime MMA_REGISTERS = 256  # registers per thread the tensor-core kernels use (ptxas: 208-255)
comptime SM_REGISTERS = 65536
comptime SM_SHARED_MEMORY = 228 * 1024
comptime ATT_MAX_SMEM = 227 * 1024  # opt-in shared memory per block on sm_90



# ---------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Steps 3 and 6: fp8 batched matmul with dynamic activation quantization
# ---------------------------------------------------------------------------


def quantize_kernel[
    dtype: DType
](
    a: DPtr[dtype],
    g_stride: Int64,
    m_stride: Int64,
    num_groups: Int32,
    num_rows: Int32,
    depth: Int32,
    block_m: Int32,
    block_k: Int32,
    a_dq: FPtr,
):
    """Quantizes `a[g, m, k]` (at `a + g g_stride + m m_stride + k`) blockwise to fp8.

    One warp per `block_m x block_k` block: `s = amax / 448` (1 when amax is 0),
    `q = fp8(clamp(x / s, -448, 448))`; writes the dequantized `q * s` to
    `out [G, M, K]` (float32, contiguous).
    """
    var tid = thread_idx.x
    var lane = tid % WARP_SIZE
    var groups = Int(num_groups)
    var rows = Int(num_rows)
    var k_total = Int(depth)
    var bm = Int(block_m)
    var bk = Int(block_k)
    var m_blocks = ceil_div(rows, bm)
    var k_blocks = ceil_div(k_total, bk)
    var qb = block_idx.x * QUANT_WARPS + tid // WARP_SIZE
    if qb >= groups * m_blocks * k_blocks:
        return
    var g = qb // (m_blocks * k_blocks)
    var mb = (qb // k_blocks) % m_blocks
    var kb = qb % k_blocks
    var m0 = mb * bm
    var m1 = min(m0 + bm, rows)
    var k0 = kb * bk
    var k1 = min(k0 + bk, k_total)
    var width = k1 - k0
    var count = (m1 - m0) * width
    var src = a.unsafe_offset(g * Int(g_stride))
    var ms = Int(m_stride)

    var amax = Float32(0)
    for e in range(lane, count, WARP_SIZE):
        var m = m0 + e // width
        var k = k0 + e % width
        amax = max(amax, abs(src.unsafe_load(m * ms + k).cast[DType.float32]()))
    amax = warp.max(amax)
    var s = amax / FP8_MAX if amax > 0 else Float32(1)
    var dst = a_dq.unsafe_offset(g * rows * k_total)
    for e in range(lane, count, WARP_SIZE):
        var m = m0 + e // width
        var k = k0 + e % width
        var x = src.unsafe_load(m * ms + k).cast[DType.float32]() / s
        x = min(max(x, -FP8_MAX), FP8_MAX)
        dst.unsafe_store(m * k_total + k, x.cast[DType.float8_e4m3fn]().cast[DType.float32]() * s)


@always_inline
def fp8_chunk_fma(
    mut acc: Array[SIMD[DType.float32, 4], MATMUL_M_TILE],
    bits: SIMD[DType.uint32, 4],
    a_s: Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    s_row: FPtr,
    k0: Int,
    k_total: Int,
    bk: Int,
    mt: Int,
):
    """`acc[m] += a_s[m, k0 : k0 + 16] * dq(w[k0 : k0 + 16])` for the block's `mt` rows."""
    var wv = bitcast[DType.float8_e4m3fn, 16](bits).cast[DType.float32]()
    var kb0 = k0 // bk
    if kb0 == (k0 + 15) // bk:
        wv = wv * s_row.unsafe_load(kb0)
    else:
        comptime for e in range(16):
            wv[e] = wv[e] * s_row.unsafe_load((k0 + e) // bk)
    comptime for m in range(MATMUL_M_TILE):
        if m < mt:
            var a_row = a_s.unsafe_offset(m * k_total + k0)
            comptime for part in range(4):
                acc[m] += a_row.unsafe_load[width=4, alignment=16](4 * part) * wv.slice[4, offset=4 * part]()


def fp8_matmul_kernel[
    out_dtype: DType, value_dtype: DType
](
    a: FPtr,
    w: U8Ptr,
    w_scale: FPtr,
    block_n: Int32,
    block_k: Int32,
    c: DPtr[out_dtype],
    c_g_stride: Int64,
    c_m_stride: Int64,
    num_groups: Int32,
    num_rows: Int32,
    n_out: Int32,
    depth: Int32,
    m_tile: Int32,
):
    """`c[g, m, n] = sum_k a[g, m, k] * w[g, n, k] * s_w[g, n / bn, k / bk]`.

    `a [G, M, K]` is the dequantized fp8 activation (float32), `w [G, N, K]`
    fp8 e4m3 bytes, `s_w [G, ceil(N / bn), ceil(K / bk)]`; results are rounded
    to `value_dtype` and stored as `out_dtype`. Grid
    `(ceil(N / MATMUL_THREADS), G, ceil(M / m_tile))`: each thread widens its
    weight row 16 bytes at a time and applies it to the block's `m_tile`
    activation rows, staged in shared memory.
    """
    var a_s = stack_allocation[
        MATMUL_SMEM_FLOATS, Float32, address_space=AddressSpace.SHARED, alignment=16
    ]()
    var tid = thread_idx.x
    var n = block_idx.x * MATMUL_THREADS + tid
    var g = block_idx.y
    var rows = Int(num_rows)
    var n_total = Int(n_out)
    var k_total = Int(depth)
    var bn = Int(block_n)
    var bk = Int(block_k)
    var n_blocks = ceil_div(n_total, bn)
    var k_blocks = ceil_div(k_total, bk)
    var m0 = block_idx.z * Int(m_tile)
    var mt = min(Int(m_tile), rows - m0)

    var a_src = a.unsafe_offset((g * rows + m0) * k_total)
    if k_total % 4 == 0:
        for i in range(4 * tid, mt * k_total, 4 * MATMUL_THREADS):
            a_s.unsafe_offset(i).unsafe_store[alignment=16](0, a_src.unsafe_offset(i).unsafe_load[width=4, alignment=16](0))
    else:
        for i in range(tid, mt * k_total, MATMUL_THREADS):
            a_s.unsafe_store(i, a_src.unsafe_load(i))
    barrier()
    if n >= n_total:
        return

    var w_row = w.unsafe_offset((g * n_total + n) * k_total)
    var s_row = w_scale.unsafe_offset((g * n_blocks + n // bn) * k_blocks)
    var acc = Array[SIMD[DType.float32, 4], MATMUL_M_TILE](fill=0)
    if k_total % 64 == 0:
        # Four 16-byte weight loads in flight per step.
        for k0 in range(0, k_total, 64):
            var bits = Array[SIMD[DType.uint32, 4], 4](fill=0)
            comptime for u in range(4):
                bits[u] = w_row.unsafe_offset(k0 + 16 * u).unsafe_bitcast[UInt32]().unsafe_load[width=4, alignment=16](0)
            comptime for u in range(4):
                fp8_chunk_fma(acc, bits[u], a_s, s_row, k0 + 16 * u, k_total, bk, mt)
    elif k_total % 16 == 0:
        for k0 in range(0, k_total, 16):
            var bits = w_row.unsafe_offset(k0).unsafe_bitcast[UInt32]().unsafe_load[width=4, alignment=16](0)
            fp8_chunk_fma(acc, bits, a_s, s_row, k0, k_total, bk, mt)
    else:
        for k in range(k_total):
            var wk = bitcast[DType.float8_e4m3fn, 1](w_row.unsafe_load(k)).cast[DType.float32]()
            wk = wk * s_row.unsafe_load(k // bk)
            comptime for m in range(MATMUL_M_TILE):
                if m < mt:
                    acc[m][0] += a_s.unsafe_load(m * k_total + k) * wk[0]

    var dst = c.unsafe_offset(g * Int(c_g_stride) + m0 * Int(c_m_stride) + n)
    comptime for m in range(MATMUL_M_TILE):
        if m < mt:
            dst.unsafe_store(m * Int(c_m_stride), acc[m].reduce_add().cast[value_dtype]().cast[out_dtype]())


# ---------------------------------------------------------------------------
# Step 5: attention over the paged cache
# ---------------------------------------------------------------------------


def attention_smem_bytes[dtype: DType](key_dim: Int) -> Int:
    """Dynamic shared memory of `attention_fma_kernel` (each region 16-byte aligned)."""
    var q_bytes = ATT_ROWS * key_dim * 4
    var k_bytes = ceil_div(ATT_KT * (key_dim + ATT_KEY_PAD) * size_of[dtype](), 16) * 16
    var red_bytes = ATT_WARPS * ATT_ROWS * ATT_KT * 4
    var p_bytes = ATT_KT * ATT_ROWS * 4
    var row_bytes = 7 * ATT_ROWS * 4  # m, l, corr, slope (f32); lo, hi, pos (i32)
    var off_bytes = ATT_KT * 8
    return q_bytes + k_bytes + red_bytes + p_bytes + row_bytes + off_bytes



def attention_fma_kernel[
    dtype: DType, cols_per_thread: Int
](
    q_full: FPtr,
    blocks: DPtr[dtype],
    lookup: U32Ptr,
    pages_per_request: Int32,
    page_size: Int32,
    page_stride: Int64,
    layer_offset: Int64,
    offsets: U32Ptr,
    cache_lengths: U32Ptr,
    num_requests: Int32,
    num_heads: Int32,
    kv_lora_rank: Int32,
    key_dim: Int32,
    num_partitions: Int32,
    scale: Float32,
    mask_kind: Int32,
    window: Int32,
    score_mod: Int32,
    raw: FPtr,
    part_out: FPtr,
    part_max: FPtr,
    part_sum: FPtr,
):
    """One block per (request, tile of ATT_ROWS rows, key partition).

    Rows are the request's (token, head) pairs in q_full order; keys are whole
    cache rows (`key_dim` values), values their first `kv_lora_rank`. Each key
    tile is read from the paged cache once into shared memory and used by
    every row of the block; each row keeps an online softmax. With one
    partition the normalized result goes straight to `raw [T, H, R]`; with
    several, each writes its unnormalized output, running max and sum to
    `part_* [P, T, H, ...]` for `merge_kernel`.
    """
    comptime CPT = cols_per_thread
    var tid = thread_idx.x
    var warp_id = tid // WARP_SIZE
    var lane = tid % WARP_SIZE
    var heads = Int(num_heads)
    var rank = Int(kv_lora_rank)
    var dim = Int(key_dim)
    var parts = Int(num_partitions)
    var nreq = Int(num_requests)
    var ppr = Int(pages_per_request)
    var psize = Int(page_size)
    var pstride = Int(page_stride)
    var loff = Int(layer_offset)
    var kind = Int(mask_kind)
    var win = Int(window)

    var slot = block_idx.x
    var part = block_idx.y
    var b = find_slot_request(offsets, nreq, heads, ATT_ROWS, slot)
    var o0 = Int(offsets.unsafe_load(b))
    var o1 = Int(offsets.unsafe_load(b + 1))
    var tile = slot - slot_start(offsets, b, heads, ATT_ROWS)
    var row0 = o0 * heads + tile * ATT_ROWS
    var row_end = o1 * heads
    if row0 >= row_end:
        return
    var total_rows = Int(offsets.unsafe_load(nreq)) * heads
    var cache_len = Int(cache_lengths.unsafe_load(b))
    var visible = cache_len + o1 - o0
    var part_len = ceil_div(visible, parts)
    var k0 = part * part_len
    var k1 = min(k0 + part_len, visible)

    # Shared memory regions (byte offsets are multiples of 16).
    var base = external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=16]()
    var off = 0
    var qT_s = base.unsafe_offset(off).unsafe_bitcast[Float32]()  # [dim][ATT_ROWS]
    off += ATT_ROWS * dim * 4
    var k_s = base.unsafe_offset(off).unsafe_bitcast[Scalar[dtype]]()  # [ATT_KT][dim + pad]
    off += ceil_div(ATT_KT * (dim + ATT_KEY_PAD) * size_of[dtype](), 16) * 16
    var red_s = base.unsafe_offset(off).unsafe_bitcast[Float32]()  # [WARPS][ROWS][KT]
    off += ATT_WARPS * ATT_ROWS * ATT_KT * 4
    var pT_s = base.unsafe_offset(off).unsafe_bitcast[Float32]()  # [KT][ROWS]
    off += ATT_KT * ATT_ROWS * 4
    var m_s = base.unsafe_offset(off).unsafe_bitcast[Float32]()
    off += ATT_ROWS * 4
    var l_s = base.unsafe_offset(off).unsafe_bitcast[Float32]()
    off += ATT_ROWS * 4
    var corr_s = base.unsafe_offset(off).unsafe_bitcast[Float32]()
    off += ATT_ROWS * 4
    var slope_s = base.unsafe_offset(off).unsafe_bitcast[Float32]()
    off += ATT_ROWS * 4
    var lo_s = base.unsafe_offset(off).unsafe_bitcast[Int32]()
    off += ATT_ROWS * 4
    var hi_s = base.unsafe_offset(off).unsafe_bitcast[Int32]()
    off += ATT_ROWS * 4
    var pos_s = base.unsafe_offset(off).unsafe_bitcast[Int32]()
    off += ATT_ROWS * 4
    var rowoff_s = base.unsafe_offset(off).unsafe_bitcast[Int64]()

    # Per-row metadata: key range, position, ALiBi slope, empty softmax state.
    if tid < ATT_ROWS:
        var gr = row0 + tid
        var lo = 0
        var hi = 0
        var pos = 0
        var slope = Float32(0)
        if gr < row_end:
            var meta = row_attention_meta(gr, heads, cache_len, o0, visible, MaskSpec(kind, win), Int(score_mod))
            lo = meta[0]
            hi = meta[1]
            pos = meta[2]
            slope = meta[3]
        lo_s.unsafe_store(tid, Int32(lo))
        hi_s.unsafe_store(tid, Int32(hi))
        pos_s.unsafe_store(tid, Int32(pos))
        slope_s.unsafe_store(tid, slope)
        m_s.unsafe_store(tid, neg_inf[DType.float32]())
        l_s.unsafe_store(tid, Float32(0))
        corr_s.unsafe_store(tid, Float32(1))

    # q rows, transposed: qT_s[k * ATT_ROWS + r] (rows of one k contiguous).
    for e in range(tid, ATT_ROWS * dim, ATT_THREADS):
        var r = e % ATT_ROWS
        var k = e // ATT_ROWS
        var v = Float32(0)
        if row0 + r < row_end:
            v = q_full.unsafe_load((row0 + r) * dim + k)
        qT_s.unsafe_store(e, v)
    barrier()

    # Keys any row of the block needs in this partition.
    var kb_lo = k1
    var kb_hi = k0
    for r in range(ATT_ROWS):
        var lo = Int(lo_s.unsafe_load(r))
        var hi = Int(hi_s.unsafe_load(r))
        if lo < hi:
            kb_lo = min(kb_lo, max(lo, k0))
            kb_hi = max(kb_hi, min(hi, k1))

    var acc = Array[SIMD[DType.float32, ATT_ROWS], CPT](fill=0)
    var blocks_global = blocks.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var c0 = tid * CPT
    var stride = dim + ATT_KEY_PAD
    var vec_per_row = dim // 4
    var j0 = kb_lo
    while j0 < kb_hi:
        var nkeys = min(ATT_KT, kb_hi - j0)
        if tid < ATT_KT:
            var ro = -1
            if tid < nkeys:
                ro = cache_row_offset(lookup, ppr, psize, pstride, loff, dim, b, j0 + tid)
            rowoff_s.unsafe_store(tid, Int64(ro))
        barrier()

        # Key tile: ATT_KT rows of `dim` values, zeros past the last key (cp.async, all in flight).
        for v in range(tid, ATT_KT * vec_per_row, ATT_THREADS):
            var r = v // vec_per_row
            var c = (v % vec_per_row) * 4
            var ro = Int(rowoff_s.unsafe_load(r))
            async_copy[4 * size_of[dtype](), fill=Scalar[dtype](0)](
                blocks_global.unsafe_offset(max(ro, 0) + c),
                k_s.unsafe_offset(r * stride + c),
                src_size=Int32(4 * size_of[dtype]()) if ro >= 0 else Int32(0),
            )
        async_copy_wait_all()
        barrier()

        # Partial scores: warp w sums key `lane` over k chunks w, w + WARPS, ...
        var partial = SIMD[DType.float32, ATT_ROWS](0)
        var k_row = k_s.unsafe_offset(lane * stride)
        for c in range(warp_id, vec_per_row, ATT_WARPS):
            var kv = k_row.unsafe_offset(4 * c).unsafe_load[width=4, alignment=4 * size_of[dtype]()](0).cast[DType.float32]()
            comptime for e in range(4):
                var qv = qT_s.unsafe_offset((4 * c + e) * ATT_ROWS).unsafe_load[width=ATT_ROWS, alignment=16](0)
                partial += qv * kv[e]
        comptime for r in range(ATT_ROWS):
            red_s.unsafe_store((warp_id * ATT_ROWS + r) * ATT_KT + lane, partial[r])
        barrier()

        # Scores, mask, bias and the online softmax update; ATT_ROWS_PER_WARP rows per warp.
        comptime for i in range(ATT_ROWS_PER_WARP):
            var r = warp_id * ATT_ROWS_PER_WARP + i
            var s = Float32(0)
            comptime for w in range(ATT_WARPS):
                s += red_s.unsafe_load((w * ATT_ROWS + r) * ATT_KT + lane)
            var key = j0 + lane
            if key < kb_hi and key >= Int(lo_s.unsafe_load(r)) and key < Int(hi_s.unsafe_load(r)):
                s = s * scale - slope_s.unsafe_load(r) * Float32(Int(pos_s.unsafe_load(r)) - key)
            else:
                s = neg_inf[DType.float32]()
            var m_old = m_s.unsafe_load(r)
            var m_new = max(m_old, warp.max(s))
            var p = Float32(0)
            var corr = Float32(1)
            if m_new != neg_inf[DType.float32]():
                p = exp(s - m_new)
                corr = exp(m_old - m_new)
            var p_sum = warp.sum(p)
            pT_s.unsafe_store(lane * ATT_ROWS + r, p.cast[dtype]().cast[DType.float32]())
            if lane == 0:
                m_s.unsafe_store(r, m_new)
                l_s.unsafe_store(r, l_s.unsafe_load(r) * corr + p_sum)
                corr_s.unsafe_store(r, corr)
        barrier()

        # acc = acc * corr + P V for this thread's value columns.
        if c0 < rank:
            var corr_v = corr_s.unsafe_load[width=ATT_ROWS, alignment=16](0)
            comptime for i in range(CPT):
                acc[i] *= corr_v
            for j in range(nkeys):
                var pj = pT_s.unsafe_offset(j * ATT_ROWS).unsafe_load[width=ATT_ROWS, alignment=16](0)
                var vv = k_s.unsafe_offset(j * stride + c0).unsafe_load[
                    width=CPT, alignment=CPT * size_of[dtype]()
                ](0).cast[DType.float32]()
                comptime for i in range(CPT):
                    acc[i] += pj * vv[i]
        barrier()
        j0 += ATT_KT

    # Results of the block's valid rows.
    if c0 < rank:
        comptime for r in range(ATT_ROWS):
            var gr = row0 + r
            if gr < row_end:
                var v = SIMD[DType.float32, CPT](0)
                comptime for i in range(CPT):
                    v[i] = acc[i][r]
                if parts == 1:
                    var l = l_s.unsafe_load(r)
                    var inv = Float32(1) / l if l > 0 else Float32(0)
                    raw.unsafe_offset(gr * rank + c0).unsafe_store(0, (v * inv).cast[dtype]().cast[DType.float32]())
                else:
                    part_out.unsafe_offset((part * total_rows + gr) * rank + c0).unsafe_store(0, v)
    if parts > 1 and tid < ATT_ROWS and row0 + tid < row_end:
        part_max.unsafe_store(part * total_rows + row0 + tid, m_s.unsafe_load(tid))
        part_sum.unsafe_store(part * total_rows + row0 + tid, l_s.unsafe_load(tid))


def merge_kernel[
    dtype: DType
](
    part_out: FPtr,
    part_max: FPtr,
    part_sum: FPtr,
    raw: FPtr,
    total_rows: Int32,
    num_partitions: Int32,
    kv_lora_rank: Int32,
):
    """One block per row: `raw = rnd(sum_p exp(m_p - M) o_p / sum_p exp(m_p - M) l_p)`."""
    var tid = thread_idx.x
    var row = block_idx.x
    var rows = Int(total_rows)
    var parts = Int(num_partitions)
    var rank = Int(kv_lora_rank)
    var top = neg_inf[DType.float32]()
    for p in range(parts):
        top = max(top, part_max.unsafe_load(p * rows + row))
    var total = Float32(0)
    for p in range(parts):
        var m = part_max.unsafe_load(p * rows + row)
        if m != neg_inf[DType.float32]():
            total += exp(m - top) * part_sum.unsafe_load(p * rows + row)
    for c in range(tid, rank, MERGE_THREADS):
        var acc = Float32(0)
        for p in range(parts):
            var m = part_max.unsafe_load(p * rows + row)
            if m != neg_inf[DType.float32]():
                var w = exp(m - top) / total
                acc += w * part_out.unsafe_load((p * rows + row) * rank + c)
        raw.unsafe_store(row * rank + c, acc.cast[dtype]().cast[DType.float32]())


# ---------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------


def plan_partitions(
    num_tokens: Int, num_heads: Int, rows_per_block: Int, blocks_per_sm: Int, max_cache_length_hint: Int
) -> Int:
    """Key partitions per request: enough blocks for one full wave, none past it.

    Row tiles are estimated as `T H / rows_per_block`; a partition keeps at
    least MIN_KEYS_PER_PARTITION keys of `max_cache_length_hint` (at most 16
    partitions when the hint is unknown, i.e. not positive).
    """
    var wave = NUM_SMS * blocks_per_sm
    var tiles = max(1, ceil_div(num_tokens * num_heads, rows_per_block))
    var parts = max(1, wave // tiles)
    if max_cache_length_hint > 0:
        parts = min(parts, ceil_div(max_cache_length_hint, MIN_KEYS_PER_PARTITION))
    else:
        parts = min(parts, 16)
    return max(1, min(parts, MAX_PARTITIONS))


def check_gpu_shapes[
    dtype: DType
](cache: PagedLatentRows[dtype], nope_dim: Int, rope_dim: Int, kv_lora_rank: Int) raises:
    """Raises for sizes the GPU kernels do not handle."""
    var key_dim = kv_lora_rank + rope_dim
    if cache.head_dim != key_dim:
        raise Error("pymla gpu: cache head_dim ", cache.head_dim, " != kv_lora_rank + rope_dim = ", key_dim)
    if kv_lora_rank % 4 != 0 or rope_dim % 4 != 0:
        raise Error("pymla gpu: kv_lora_rank and rope_dim must be multiples of 4")
    if nope_dim > MATMUL_SMEM_FLOATS or kv_lora_rank > MATMUL_SMEM_FLOATS:
        raise Error("pymla gpu: nope_dim and kv_lora_rank must be at most ", MATMUL_SMEM_FLOATS)
    if kv_lora_rank > 4 * ATT_THREADS:
        raise Error("pymla gpu: kv_lora_rank must be at most ", 4 * ATT_THREADS)
    var smem = attention_smem_bytes[dtype](key_dim)
    if smem > ATT_MAX_SMEM:
        raise Error("pymla gpu: key dim ", key_dim, " needs ", smem, " bytes of shared memory")


def gpu_rotate_and_normalize_new_rows[
    dtype: DType
](
    ctx: DeviceContext,
    cache: PagedLatentRows[dtype],
    input_row_offsets: U32Ptr,
    cache_lengths: U32Ptr,
    num_requests: Int,
    num_tokens: Int,
    freqs_cis: DPtr[dtype],
    kv_norm_gamma: DPtr[dtype],
    epsilon: Float32,
    kv_lora_rank: Int,
    rope_dim: Int,
    new_rows: DPtr[dtype],
    has_new_rows: Bool,
) raises:
    """Steps 1 and 2 on the new tokens' cache rows (raw rows from `new_rows` when given)."""
    if num_tokens == 0:
        return
    ctx.enqueue_function[rope_norm_cache_kernel[dtype]](
        cache.blocks,
        cache.lookup_table,
        Int32(cache.pages_per_request),
        Int32(cache.page_size),
        Int64(cache.page_stride),
        Int64(cache.layer_offset),
        Int32(cache.head_dim),
        input_row_offsets,
        cache_lengths,
        Int32(num_requests),
        freqs_cis,
        kv_norm_gamma,
        epsilon,
        Int32(kv_lora_rank),
        Int32(rope_dim),
        new_rows,
        Int32(1 if has_new_rows else 0),
        grid_dim=num_tokens,
        block_dim=ELEMENTWISE_THREADS,
    )


def store_kernel[dtype: DType](src: FPtr, dst: DPtr[dtype], count: Int64):
    """`dst[i] = src[i]` as dtype (the attention output, whose values are already dtype values)."""
    var i = block_idx.x * ELEMENTWISE_THREADS + thread_idx.x
    if i < Int(count):
        dst.unsafe_store(i, src.unsafe_load(i).cast[dtype]())


def gpu_fp8_batched_matmul[
    in_dtype: DType, out_dtype: DType, value_dtype: DType = out_dtype
](
    ctx: DeviceContext,
    a: DPtr[in_dtype],
    a_g_stride: Int,
    a_m_stride: Int,
    a_dq: FPtr,
    w: U8Ptr,
    w_scale: FPtr,
    c: DPtr[out_dtype],
    c_g_stride: Int,
    c_m_stride: Int,
    num_groups: Int,
    num_rows: Int,
    n_out: Int,
    depth: Int,
    granularity: Granularity,
) raises:
    """Steps 3 and 6: `c[g, m, :] = fp8mm(a[g, m, :], w[g])` for every group `g`.

    `a[g, m, k]` sits at `a + g a_g_stride + m a_m_stride + k`, `c[g, m, n]` at
    `c + g c_g_stride + m c_m_stride + n`; `a_dq` is a workspace of at least
    `G M K` floats for the quantized activations.
    """
    if num_groups == 0 or num_rows == 0 or n_out == 0:
        return
    var blocks = granularity.resolve(num_rows, n_out, depth)
    var quant_blocks = num_groups * ceil_div(num_rows, blocks.m) * ceil_div(depth, blocks.k)
    ctx.enqueue_function[quantize_kernel[in_dtype]](
        a,
        Int64(a_g_stride),
        Int64(a_m_stride),
        Int32(num_groups),
        Int32(num_rows),
        Int32(depth),
        Int32(blocks.m),
        Int32(blocks.k),
        a_dq,
        grid_dim=ceil_div(quant_blocks, QUANT_WARPS),
        block_dim=QUANT_WARPS * WARP_SIZE,
    )
    var m_tile = max(1, min(MATMUL_M_TILE, MATMUL_SMEM_FLOATS // max(depth, 1)))
    ctx.enqueue_function[fp8_matmul_kernel[out_dtype, value_dtype]](
        a_dq,
        w,
        w_scale,
        Int32(blocks.n),
        Int32(blocks.k),
        c,
        Int64(c_g_stride),
        Int64(c_m_stride),
        Int32(num_groups),
        Int32(num_rows),
        Int32(n_out),
        Int32(depth),
        Int32(m_tile),
        grid_dim=(ceil_div(n_out, MATMUL_THREADS), num_groups, ceil_div(num_rows, m_tile)),
        block_dim=MATMUL_THREADS,
    )


def gpu_build_q_full[
    dtype: DType
](
    ctx: DeviceContext,
    q: DPtr[dtype],
    input_row_offsets: U32Ptr,
    cache_lengths: U32Ptr,
    num_requests: Int,
    num_tokens: Int,
    num_heads: Int,
    nope_dim: Int,
    rope_dim: Int,
    kv_lora_rank: Int,
    freqs_cis: DPtr[dtype],
    w_uk: U8Ptr,
    w_uk_scale: FPtr,
    granularity: Granularity,
    q_full: FPtr,
    a_dq: FPtr,
) raises:
    """Steps 1, 3 and 4 on q: `q_full [T, H, R + Dr] = rnd(concat(fp8mm(q_nope, w_uk), rope(q_rope)))`.

    `a_dq` is a workspace of at least `H T nope_dim` floats.
    """
    if num_tokens == 0 or num_heads == 0:
        return
    var key_dim = kv_lora_rank + rope_dim
    ctx.enqueue_function[rope_q_kernel[dtype]](
        q,
        input_row_offsets,
        cache_lengths,
        Int32(num_requests),
        freqs_cis,
        q_full,
        Int32(num_heads),
        Int32(nope_dim),
        Int32(rope_dim),
        Int32(kv_lora_rank),
        grid_dim=num_tokens,
        block_dim=ELEMENTWISE_THREADS,
    )
    gpu_fp8_batched_matmul[dtype, DType.float32, dtype](
        ctx,
        q,
        nope_dim + rope_dim,
        num_heads * (nope_dim + rope_dim),
        a_dq,
        w_uk,
        w_uk_scale,
        q_full,
        key_dim,
        num_heads * key_dim,
        num_heads,
        num_tokens,
        kv_lora_rank,
        nope_dim,
        granularity,
    )


def gpu_attention[
    dtype: DType, mma_groups: Int = 0, mma_kt: Int = 32, mma_gw: Int = 4
](
    ctx: DeviceContext,
    q_full: FPtr,
    cache: PagedLatentRows[dtype],
    input_row_offsets: U32Ptr,
    cache_lengths: U32Ptr,
    num_requests: Int,
    num_tokens: Int,
    num_heads: Int,
    kv_lora_rank: Int,
    num_partitions: Int,
    max_cache_length_hint: Int,
    scale: Float32,
    mask: MaskSpec,
    score_mod: Int,
    raw: FPtr,
    force_fma: Bool = False,
) raises:
    """Step 5: `raw [T, H, R]` from `q_full [T, H, R + Dr]` and the paged cache.

    Splits every request's keys into `num_partitions` parts (merged by
    log-sum-exp when more than one); `num_partitions <= 0` plans them from
    the grid size and `max_cache_length_hint` (see `plan_partitions`).
    `force_fma` skips the tensor-core kernel (for tests). `mma_groups > 0`
    pins the tensor-core kernel's shape to (`mma_groups` 16-row groups per
    block, `mma_kt` keys per tile, `mma_gw` warps per group; for timing the
    variants; `mma_gw = 0` pins the warpgroup kernel with `mma_kt` keys per
    tile); by default the shape is `WGMMA_SHAPE` or one of the `MMA_*` constants.
    """
    if num_tokens == 0 or num_heads == 0:
        return
    var key_dim = cache.head_dim
    var rows = num_tokens * num_heads

    # Kernel choice: tensor cores for bf16 / f16 caches of supported sizes, shape by head count.
    comptime PINNED = (mma_groups, mma_kt, mma_gw)
    var shape = (0, 0, 0)  # (groups, kt, gw); groups 0 = the FMA kernel
    comptime if USE_TENSOR_CORES and (dtype == DType.bfloat16 or dtype == DType.float16):
        if not force_fma:
            comptime if mma_groups > 0 and mma_gw == 0:
                if wgmma_supported[dtype](key_dim, kv_lora_rank):
                    shape = PINNED
            elif mma_groups > 0:
                if mma_supported[dtype, mma_gw](key_dim, kv_lora_rank):
                    shape = PINNED
            else:
                if USE_WGMMA and num_heads >= WGMMA_MIN_HEADS and wgmma_supported[dtype](key_dim, kv_lora_rank):
                    shape = WGMMA_SHAPE
                elif num_heads >= 2 * MMA_ROWS and mma_supported[dtype, MMA_MANY_HEADS[2]](key_dim, kv_lora_rank):
                    shape = MMA_MANY_HEADS
                elif mma_supported[dtype, MMA_FEW_HEADS[2]](key_dim, kv_lora_rank):
                    shape = MMA_FEW_HEADS
                elif mma_supported[dtype, MMA_FEW_HEADS_SMALL_RANK[2]](key_dim, kv_lora_rank):
                    shape = MMA_FEW_HEADS_SMALL_RANK
    var rows_per_block = ATT_ROWS
    var blocks_per_sm = 1  # FMA kernel: 256 threads at up to 255 registers
    if shape[0] > 0 and shape[2] == 0:
        rows_per_block = WG_ROWS
    elif shape[0] > 0:
        rows_per_block = shape[0] * MMA_ROWS
        var threads = shape[0] * shape[2] * WARP_SIZE
        var smem = attention_mma_smem_bytes[dtype](shape[0], shape[1], shape[2], key_dim)
        blocks_per_sm = max(1, min(SM_REGISTERS // (MMA_REGISTERS * threads), SM_SHARED_MEMORY // (smem + 1024)))
    var parts = num_partitions
    if parts <= 0:
        parts = plan_partitions(num_tokens, num_heads, rows_per_block, blocks_per_sm, max_cache_length_hint)
    var part_rows = rows * parts if parts > 1 else 1
    var part_out_buf = ctx.enqueue_create_buffer[DType.float32](part_rows * kv_lora_rank if parts > 1 else 1)
    var part_max_buf = ctx.enqueue_create_buffer[DType.float32](part_rows)
    var part_sum_buf = ctx.enqueue_create_buffer[DType.float32](part_rows)
    var part_out = part_out_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var part_max = part_max_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var part_sum = part_sum_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

    @always_inline
    def launch_fma[cols_per_thread: Int]() raises {var ctx, var q_full, var cache, var input_row_offsets, var cache_lengths, var num_requests, var num_tokens, var num_heads, var kv_lora_rank, var key_dim, var parts, var scale, var mask, var score_mod, var raw, var part_out, var part_max, var part_sum}:
        var smem = attention_smem_bytes[dtype](key_dim)
        ctx.enqueue_function[attention_fma_kernel[dtype, cols_per_thread]](
            q_full,
            cache.blocks,
            cache.lookup_table,
            Int32(cache.pages_per_request),
            Int32(cache.page_size),
            Int64(cache.page_stride),
            Int64(cache.layer_offset),
            input_row_offsets,
            cache_lengths,
            Int32(num_requests),
            Int32(num_heads),
            Int32(kv_lora_rank),
            Int32(key_dim),
            Int32(parts),
            scale,
            Int32(mask.kind),
            Int32(mask.window),
            Int32(score_mod),
            raw,
            part_out,
            part_max,
            part_sum,
            grid_dim=(attention_slots(num_tokens, num_heads, num_requests, ATT_ROWS), parts),
            block_dim=ATT_THREADS,
            shared_mem_bytes=smem,
            func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem)),
        )

    @always_inline
    def launch_mma[s: Tuple[Int, Int, Int]]() raises {var ctx, var q_full, var cache, var input_row_offsets, var cache_lengths, var num_requests, var num_tokens, var num_heads, var kv_lora_rank, var key_dim, var parts, var scale, var mask, var score_mod, var raw, var part_out, var part_max, var part_sum}:
        comptime groups, kt, gw = s[0], s[1], s[2]
        var smem = attention_mma_smem_bytes[dtype](groups, kt, gw, key_dim)
        ctx.enqueue_function[attention_mma_kernel[dtype, groups, kt, gw]](
            q_full,
            cache.blocks,
            cache.lookup_table,
            Int32(cache.pages_per_request),
            Int32(cache.page_size),
            Int64(cache.page_stride),
            Int64(cache.layer_offset),
            input_row_offsets,
            cache_lengths,
            Int32(num_requests),
            Int32(num_heads),
            Int32(kv_lora_rank),
            Int32(key_dim),
            Int32(parts),
            scale,
            Int32(mask.kind),
            Int32(mask.window),
            Int32(score_mod),
            raw,
            part_out,
            part_max,
            part_sum,
            grid_dim=(attention_slots(num_tokens, num_heads, num_requests, MMA_ROWS * groups), parts),
            block_dim=WARP_SIZE * gw * groups,
            shared_mem_bytes=smem,
            func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem)),
        )

    @always_inline
    def launch_wgmma[kt: Int]() raises {var ctx, var q_full, var cache, var input_row_offsets, var cache_lengths, var num_requests, var num_tokens, var num_heads, var kv_lora_rank, var key_dim, var parts, var scale, var mask, var score_mod, var raw, var part_out, var part_max, var part_sum}:
        var smem = attention_wgmma_smem_bytes[dtype](kt, key_dim)
        ctx.enqueue_function[attention_wgmma_kernel[dtype, kt]](
            q_full,
            cache.blocks,
            cache.lookup_table,
            Int32(cache.pages_per_request),
            Int32(cache.page_size),
            Int64(cache.page_stride),
            Int64(cache.layer_offset),
            input_row_offsets,
            cache_lengths,
            Int32(num_requests),
            Int32(num_heads),
            Int32(kv_lora_rank),
            Int32(key_dim),
            Int32(parts),
            scale,
            Int32(mask.kind),
            Int32(mask.window),
            Int32(score_mod),
            raw,
            part_out,
            part_max,
            part_sum,
            grid_dim=(attention_slots(num_tokens, num_heads, num_requests, WG_ROWS), parts),
            block_dim=WG_BLOCK_THREADS,
            shared_mem_bytes=smem,
            func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem)),
        )

    if shape[0] > 0:
        comptime if dtype == DType.bfloat16 or dtype == DType.float16:
            comptime if mma_groups > 0 and mma_gw == 0:
                launch_wgmma[mma_kt]()
            elif mma_groups > 0:
                launch_mma[PINNED]()
            else:
                if shape == WGMMA_SHAPE:
                    launch_wgmma[WGMMA_SHAPE[1]]()
                elif shape == MMA_MANY_HEADS:
                    launch_mma[MMA_MANY_HEADS]()
                elif shape == MMA_FEW_HEADS:
                    launch_mma[MMA_FEW_HEADS]()
                else:
                    launch_mma[MMA_FEW_HEADS_SMALL_RANK]()
    elif kv_lora_rank <= 2 * ATT_THREADS:
        launch_fma[2]()
    else:
        launch_fma[4]()
    if parts > 1:
        ctx.enqueue_function[merge_kernel[dtype]](
            part_out,
            part_max,
            part_sum,
            raw,
            Int32(rows),
            Int32(parts),
            Int32(kv_lora_rank),
            grid_dim=rows,
            block_dim=MERGE_THREADS,
        )
    # Freed in stream order, after the kernels above.
    _ = part_out_buf^
    _ = part_max_buf^
    _ = part_sum_buf^


def gpu_project_output[
    dtype: DType
](
    ctx: DeviceContext,
    raw: FPtr,
    w_uv: U8Ptr,
    w_uv_scale: FPtr,
    output: DPtr[dtype],
    num_tokens: Int,
    num_heads: Int,
    kv_lora_rank: Int,
    v_head_dim: Int,
    granularity: Granularity,
    a_dq: FPtr,
) raises:
    """Step 6: `output[t, h, :] = fp8mm(raw[t, h, :], w_uv[h])`; `a_dq` holds `H T R` floats."""
    gpu_fp8_batched_matmul[DType.float32, dtype](
        ctx,
        raw,
        kv_lora_rank,
        num_heads * kv_lora_rank,
        a_dq,
        w_uv,
        w_uv_scale,
        output,
        v_head_dim,
        num_heads * v_head_dim,
        num_heads,
        num_tokens,
        v_head_dim,
        kv_lora_rank,
        granularity,
    )


def mla_decode_branch_fp8_gpu[dtype: DType](p: DecodeProblem[dtype], ctx: DeviceContext) raises:
    """All six steps on the GPU of `ctx`; every pointer of `p` is device memory.

    Enqueues the kernels on `ctx`'s stream and returns without waiting;
    reads nothing back to the host. `p.max_visible_keys()` (pages per
    request times page size) bounds every request's visible keys; it only
    shapes the key partitioning.
    """
    var output = p.output
    var q = p.q
    var input_row_offsets = p.batch.offsets
    var cache_lengths = p.batch.cache_lengths
    var num_requests = p.batch.num_requests
    var freqs_cis = p.freqs_cis
    var kv_norm_gamma = p.kv_norm_gamma
    var cache = p.cache
    var num_tokens = p.num_tokens
    var num_heads = p.num_heads
    var nope_dim = p.nope_dim
    var rope_dim = p.rope_dim
    var kv_lora_rank = p.kv_lora_rank
    var v_head_dim = p.v_head_dim
    var max_cache_length_hint = p.max_visible_keys()
    var scale = p.scale
    var epsilon = p.epsilon
    var mask = p.mask
    var score_mod = p.score_mod
    var granularity = p.granularity
    var w_uk = p.w_uk
    var w_uk_scale = p.w_uk_scale
    var w_uv = p.w_uv
    var w_uv_scale = p.w_uv_scale
    if num_tokens == 0 or num_heads == 0:
        return
    check_gpu_shapes[dtype](cache, nope_dim, rope_dim, kv_lora_rank)
    var key_dim = kv_lora_rank + rope_dim
    var rows = num_tokens * num_heads

    gpu_rotate_and_normalize_new_rows[dtype](
        ctx, cache, input_row_offsets, cache_lengths, num_requests, num_tokens,
        freqs_cis, kv_norm_gamma, epsilon, kv_lora_rank, rope_dim, p.new_rows, p.has_new_rows,
    )

    var q_full_buf = ctx.enqueue_create_buffer[DType.float32](rows * key_dim)
    var a_dq_buf = ctx.enqueue_create_buffer[DType.float32](rows * max(nope_dim, kv_lora_rank))
    var raw_buf = ctx.enqueue_create_buffer[DType.float32](rows * kv_lora_rank)
    var q_full = q_full_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var a_dq = a_dq_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var raw = raw_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

    gpu_build_q_full[dtype](
        ctx, q, input_row_offsets, cache_lengths, num_requests, num_tokens, num_heads,
        nope_dim, rope_dim, kv_lora_rank, freqs_cis, w_uk, w_uk_scale, granularity, q_full, a_dq,
    )
    gpu_attention[dtype](
        ctx, q_full, cache, input_row_offsets, cache_lengths, num_requests, num_tokens, num_heads,
        kv_lora_rank, 0, max_cache_length_hint, scale, mask, score_mod, raw,
    )
    if p.has_attention_output:
        ctx.enqueue_function[store_kernel[dtype]](
            raw, p.attention_output, Int64(rows * kv_lora_rank),
            grid_dim=ceil_div(rows * kv_lora_rank, ELEMENTWISE_THREADS), block_dim=ELEMENTWISE_THREADS,
        )
    gpu_project_output[dtype](
        ctx, raw, w_uv, w_uv_scale, output, num_tokens, num_heads, kv_lora_rank, v_head_dim, granularity, a_dq
    )

    # The workspaces are freed in stream order, after the kernels above.
    _ = q_full_buf^
    _ = a_dq_buf^
    _ = raw_buf^
