"""Step 3 on Hopper's warpgroup tensor cores (sm_90a `wgmma`): a block's tile of the q step's fp8 projection.

The same product as `project_tile` (`projection_mma.mojo`, the formula of `pymla/quant.py`) where the
activations have per-row scales and K is one scale block (DeepSeek's q projection: K = nope_dim = 128 =
block_k), computed transposed, `C^T [o, r] = sum_k W [o, k] A [r, k]`:

* A = the weights, `m64` tiles of 64 output columns, from registers: each thread widens its own
  fragment (rows `16 w + g` and `+ 8` of a tile, 16 bytes at `16 t` of every 64-wide chunk) from the
  fp8 rows `stage_weights` copied, exactly, to bf16. No weight value is widened twice, and the
  weights take their fp8 bytes of shared memory only.
* B = the quantized activations, the block's `nr` rows (`n` = 8 to 256: few tokens cost no padded
  tensor work), K-major in shared memory with the 128-byte swizzle (`swizzled_offset`), written by
  the quantizer in the k order of the weights' fragments (`project_tile`'s permutation of k within
  each 16-byte load, applied to both operands: the products summed are exactly those of the block).
* e4m3 values are exact in bf16 and their products exact in float32; the sum is in float32 on the
  tensor cores (as the mma.sync tile's), then `part * (sa * sw)`, rounded to the dtype.

A warpgroup takes `tpw` m64 tiles; a block `wgs` warpgroups (`64 tpw wgs` columns) over `nr` rows, so
the rows are quantized once for all of them. A register-A `wgmma` reads its A registers until it
completes: each chunk's products are waited for before the next chunk is widened (`project_tile_wg`).
Where the op takes this tile, and what it measured: `PROJ_TILES` in plan.mojo.

Accumulator fragments (m64 nN, f32): warp `w` of the warpgroup, lane `4 g + t`, element `4 j + e` is
output column `16 w + g + 8 (e / 2)` of the tile and block row `8 j + 2 t + e % 2`.
"""

from std.memory import bitcast
from std.utils import StaticTuple

from max.gpu import WARP_SIZE, thread_idx
from max.gpu.compute.mma import wgmma_async, wgmma_commit_group_sync, wgmma_fence_aligned, wgmma_wait_group_sync

from .hopper import Sw128, smem_u32
from .projection_mma import KCHUNK, Fp8Projection, TileLayout, TileSmem, weight_bytes

comptime WG_THREADS = 128  # a warpgroup
comptime WG_TILE_COLS = 64  # output columns of an m64 tile


def wg_tile_supported(rows_per_block: Int, cols_per_block: Int, n_out: Int, depth: Int, block_m: Int, block_k: Int) -> Bool:
    """Whether `project_tile_wg` handles a projection in blocks of `rows_per_block` x `cols_per_block`: per-row
    activation scales, one K block of whole 64-wide chunks (a 128-byte swizzle row each), whole blocks of
    output columns (no tile of a warpgroup is skipped: its wgmmas stay out of divergent code), `n` a
    multiple of 8."""
    return (
        block_m == 1 and block_k >= depth and depth % KCHUNK == 0 and n_out % cols_per_block == 0
        and cols_per_block % WG_TILE_COLS == 0 and rows_per_block % 8 == 0 and 8 <= rows_per_block <= 256
    )


@always_inline
def widened(bits: SIMD[DType.uint32, 4]) -> SIMD[DType.bfloat16, 16]:
    """16 e4m3 bytes as bf16 (exact)."""
    return bitcast[DType.float8_e4m3fn, 16](bits).cast[DType.float16]().cast[DType.bfloat16]()


@always_inline
def project_tile_wg[
    in_dtype: DType, out_dtype: DType, //, value_dtype: DType, tpw: Int, nr: Int
](p: Fp8Projection[in_dtype, out_dtype], lay: TileLayout, sm: TileSmem, g: Int, m0: Int, n0: Int):
    """`c[g, m0 ..< m0 + nr, n0 ..]` of the staged tiles (`sm.a_s` swizzled, `sm.sa_s` and `sm.sw_s` with one
    K block; `wg_tile_supported`): warpgroup `wg` owns m64 tiles `wg tpw ..< (wg + 1) tpw` of the block's
    output columns. The caller fenced the activations' stores for the async proxy and synchronized."""
    comptime ACC = nr // 2  # float32 per thread of an m64 x nr tile
    var tid = thread_idx.x
    var wg = tid // WG_THREADS
    var w = (tid % WG_THREADS) // WARP_SIZE
    var lane = tid % WARP_SIZE
    var gq = lane // 4
    var t4 = lane % 4
    var chunks = lay.kp // KCHUNK
    var acts = Sw128[DType.bfloat16, 16, 1024].of(smem_u32(sm.a_s))

    var acc = StaticTuple[SIMD[DType.float32, ACC], tpw]()
    comptime for t in range(tpw):
        var row = (wg * tpw + t) * WG_TILE_COLS + 16 * w + gq  # the fragment's first weight row in the block
        var out = SIMD[DType.float32, ACC](0)
        var lo_bits = weight_bytes(sm, lay, row, 16 * t4)
        var hi_bits = weight_bytes(sm, lay, row + 8, 16 * t4)
        for ch in range(chunks):
            var lo = widened(lo_bits)
            var hi = widened(hi_bits)
            if ch + 1 < chunks:  # the next chunk's bytes load under this chunk's products
                lo_bits = weight_bytes(sm, lay, row, (ch + 1) * KCHUNK + 16 * t4)
                hi_bits = weight_bytes(sm, lay, row + 8, (ch + 1) * KCHUNK + 16 * t4)
            wgmma_fence_aligned()
            comptime for step in range(KCHUNK // 16):
                var x = lo.slice[4, offset = 4 * step]().join(hi.slice[4, offset = 4 * step]())
                out = wgmma_async[
                    64, nr, 16, DType.bfloat16, DType.float32, 8, ACC,
                    a_type=DType.bfloat16, b_type=DType.bfloat16, layout_b="col",
                ](x.shuffle[0, 1, 4, 5, 2, 3, 6, 7](), acts.at(ch * nr * 128 + 32 * step), out)
            # A's registers are read until the products complete, and the next chunk's widening may reuse
            # them (ptxas orders register writes before a wgmma, not after it): wait before going on.
            wgmma_commit_group_sync()
            wgmma_wait_group_sync[0]()
        acc[t] = out

    var rows = Int(p.rows)
    var cms = Int(p.c.m_stride)
    var c_g = p.c.ptr.unsafe_offset(g * Int(p.c.g_stride))
    comptime for t in range(tpw):
        var col0 = (wg * tpw + t) * WG_TILE_COLS
        comptime for h in range(2):
            var o = col0 + 16 * w + gq + 8 * h
            var sw = sm.sw_s.unsafe_load(o)
            comptime for j in range(nr // 8):
                comptime for e in range(2):
                    var r = 8 * j + 2 * t4 + e
                    if m0 + r < rows:
                        var s = sm.sa_s.unsafe_load(r) * sw
                        var v = (acc[t][4 * j + 2 * h + e] * s).cast[value_dtype]().cast[out_dtype]()
                        c_g.unsafe_store((m0 + r) * cms + n0 + o, v)
