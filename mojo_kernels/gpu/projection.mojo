"""Steps 3 and 6 on the GPU: dynamic fp8 activation quantization and the fp8 block-scaled batched matmul."""

from std.memory import bitcast, stack_allocation

from max.gpu import WARP_SIZE, barrier, block_idx, thread_idx
from max.gpu.memory import AddressSpace
from max.gpu.primitives import warp

from ..common import ceil_div
from ..fp8 import activation_scale, scaled_into_range
from .params import GFPtr, KernelParams
from .projection_mma import Fp8Projection


# Quantization: one warp per scale block.
comptime QUANT_WARPS = 4

# fp8 matmul: one thread per weight row, MATMUL_M_TILE activation rows per block
# staged in MATMUL_SMEM_FLOATS floats of shared memory.
comptime MATMUL_THREADS = 128
comptime MATMUL_M_TILE = 16
comptime MATMUL_SMEM_FLOATS = 8192


# ---------------------------------------------------------------------------
# Steps 3 and 6: fp8 batched matmul with dynamic activation quantization
# ---------------------------------------------------------------------------


@fieldwise_init
struct FmaProjectionParams[in_dtype: DType, out_dtype: DType](KernelParams):
    """Parameters of `quantize_kernel` and `fp8_matmul_kernel`, a projection's two launches on float32 FMA units.

    `proj` for the groups `g < num_groups`; its activations quantized into
    `a_dq [G, M, K]` (float32), `m_tile` rows of them per matmul block.
    """

    var proj: Fp8Projection[Self.in_dtype, Self.out_dtype]
    var a_dq: GFPtr
    var num_groups: Int32
    var m_tile: Int32


def quantize_kernel[in_dtype: DType, out_dtype: DType](p: FmaProjectionParams[in_dtype, out_dtype]):
    """Quantizes `proj.a` blockwise to fp8.

    One warp per `block_m x block_k` block: `s = amax / 448` (1 when amax is 0),
    `q = fp8(clamp(x / s, -448, 448))`; writes the dequantized `q * s` to
    `a_dq [G, M, K]` (float32, contiguous).
    """
    var tid = thread_idx.x
    var lane = tid % WARP_SIZE
    var rows = Int(p.proj.rows)
    var k_total = Int(p.proj.depth)
    var bm = Int(p.proj.blocks.m)
    var bk = Int(p.proj.blocks.k)
    var m_blocks = ceil_div(rows, bm)
    var k_blocks = ceil_div(k_total, bk)
    var qb = block_idx.x * QUANT_WARPS + tid // WARP_SIZE
    if qb >= Int(p.num_groups) * m_blocks * k_blocks:
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
    var src = p.proj.a.ptr.unsafe_offset(g * Int(p.proj.a.g_stride))
    var ms = Int(p.proj.a.m_stride)

    var amax = Float32(0)
    for e in range(lane, count, WARP_SIZE):
        var m = m0 + e // width
        var k = k0 + e % width
        amax = max(amax, abs(src.unsafe_load(m * ms + k).cast[DType.float32]()))
    amax = warp.max(amax)
    var s = activation_scale(amax)
    var dst = p.a_dq.unsafe_offset(g * rows * k_total)
    for e in range(lane, count, WARP_SIZE):
        var m = m0 + e // width
        var k = k0 + e % width
        var x = scaled_into_range[1](src.unsafe_load(m * ms + k).cast[DType.float32](), s)
        dst.unsafe_store(m * k_total + k, x.cast[DType.float8_e4m3fn]().cast[DType.float32]() * s)


@always_inline
def fp8_chunk_fma(
    mut acc: Array[SIMD[DType.float32, 4], MATMUL_M_TILE],
    bits: SIMD[DType.uint32, 4],
    a_s: Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    s_row: GFPtr,
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
    in_dtype: DType, out_dtype: DType, value_dtype: DType
](p: FmaProjectionParams[in_dtype, out_dtype]):
    """`c[g, m, n] = sum_k a[g, m, k] * w[g, n, k] * s_w[g, n / bn, k / bk]` (`proj.c`, `a_dq`, `proj.w`).

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
    var rows = Int(p.proj.rows)
    var n_total = Int(p.proj.n_out)
    var k_total = Int(p.proj.depth)
    var bk = Int(p.proj.blocks.k)
    var m0 = block_idx.z * Int(p.m_tile)
    var mt = min(Int(p.m_tile), rows - m0)

    var a_src = p.a_dq.unsafe_offset((g * rows + m0) * k_total)
    if k_total % 4 == 0:
        for i in range(4 * tid, mt * k_total, 4 * MATMUL_THREADS):
            a_s.unsafe_offset(i).unsafe_store[alignment=16](0, a_src.unsafe_offset(i).unsafe_load[width=4, alignment=16](0))
    else:
        for i in range(tid, mt * k_total, MATMUL_THREADS):
            a_s.unsafe_store(i, a_src.unsafe_load(i))
    barrier()
    if n >= n_total:
        return

    var w_row = p.proj.w.unsafe_offset((g * n_total + n) * k_total)
    var bn = Int(p.proj.blocks.n)
    var s_row = p.proj.w_scale.unsafe_offset((g * ceil_div(n_total, bn) + n // bn) * ceil_div(k_total, bk))
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

    var dst = p.proj.c.ptr.unsafe_offset(g * Int(p.proj.c.g_stride) + m0 * Int(p.proj.c.m_stride) + n)
    comptime for m in range(MATMUL_M_TILE):
        if m < mt:
            dst.unsafe_store(m * Int(p.proj.c.m_stride), acc[m].reduce_add().cast[value_dtype]().cast[out_dtype]())
