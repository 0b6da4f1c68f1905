"""Steps 3 and 6 on Hopper's warpgroup tensor cores (sm_90a `wgmma`): a block's tile of an fp8 projection.

The same product as `project_tile` (`projection_mma.mojo`, the formula of `pymla/quant.py`) where the
activations have per-row scales and the K blocks are whole 64-wide chunks (DeepSeek's: 128), computed
transposed, `C^T [o, r] = sum_k W [o, k] A [r, k]`:

* A = the weights, `m64` tiles of 64 output columns, from registers: each thread widens its own
  fragment (rows `16 w + g` and `+ 8` of a tile, 16 bytes at `16 t` of every 64-wide chunk) from the
  fp8 rows `stage_weights` copied, exactly, to bf16. No weight value is widened twice, and the
  weights take their fp8 bytes of shared memory only.
* B = the quantized activations, the block's `nr` rows (`n` = 8 to 256: few tokens cost no padded
  tensor work), K-major in shared memory with the 128-byte swizzle (`swizzled_offset`), written by
  the quantizer in the k order of the weights' fragments (`project_tile`'s permutation of k within
  each 16-byte load, applied to both operands: the products summed are exactly those of the block).
* e4m3 values are exact in bf16 and their products exact in float32; per K block the sum is in
  float32 on the tensor cores (as the mma.sync tile's), then `acc += part * (sa * sw)`, rounded to
  the dtype at the end.
* Step 6's activations, when the merge quantized them, are copied into that layout
  (`stage_quantized_swizzled`); otherwise both steps quantize with `stage_activations[swizzled=True]`.

A warpgroup takes `tpw` m64 tiles; a block `wgs` warpgroups (`64 tpw wgs` columns) over `nr` rows, so
the rows are quantized once for all of them. H100, 128 heads, 64 tokens (q step, ncu): see plan.mojo.

Accumulator fragments (m64 nN, f32): warp `w` of the warpgroup, lane `4 g + t`, element `4 j + e` is
output column `16 w + g + 8 (e / 2)` of the tile and block row `8 j + 2 t + e % 2`.
"""

from std.memory import bitcast

from max.gpu import WARP_SIZE, thread_idx
from max.gpu.compute.mma import wgmma_async, wgmma_commit_group_sync, wgmma_fence_aligned, wgmma_wait_group_sync

from ..common import div_u32
from .hopper import Sw128, smem_u32
from .projection_mma import KCHUNK, Fp8Projection, QuantizedRows, TileLayout, TileSmem, store_quantized

comptime WG_THREADS = 128  # a warpgroup
comptime WG_TILE_COLS = 64  # output columns of an m64 tile


def wg_tile_supported(rows_per_block: Int, cols_per_block: Int, n_out: Int, depth: Int, block_m: Int, block_k: Int) -> Bool:
    """Whether `project_tile_wg` handles a projection in blocks of `rows_per_block` x `cols_per_block`: per-row
    activation scales, K blocks of whole 64-wide chunks that tile the depth (a chunk is a 128-byte swizzle
    row; also the layout `stage_quantized_swizzled` copies), or one K block over a depth of whole chunks;
    whole blocks of output columns (no tile of a warpgroup is skipped: its wgmmas stay out of divergent
    code); `n` a multiple of 8."""
    var k_ok = (block_k >= depth and depth % KCHUNK == 0) or (block_k % KCHUNK == 0 and depth % block_k == 0)
    return (
        block_m == 1 and k_ok and n_out % cols_per_block == 0
        and cols_per_block % WG_TILE_COLS == 0 and rows_per_block % 8 == 0 and 8 <= rows_per_block <= 256
    )


@always_inline
def weight_bytes(sm: TileSmem, lay: TileLayout, row: Int, chunk: Int, t4: Int) -> SIMD[DType.uint32, 4]:
    """Bytes `16 t4 ..< 16 t4 + 16` of 64-wide chunk `chunk` of row `row` of the staged fp8 weights."""
    return sm.w_s.unsafe_offset(row * lay.w_stride + chunk * KCHUNK + 16 * t4).unsafe_bitcast[UInt32]().unsafe_load[
        width=4, alignment=16
    ](0)


@always_inline
def widened(bits: SIMD[DType.uint32, 4]) -> SIMD[DType.bfloat16, 16]:
    """16 e4m3 bytes as bf16 (exact)."""
    return bitcast[DType.float8_e4m3fn, 16](bits).cast[DType.float16]().cast[DType.bfloat16]()


@always_inline
def project_tile_wg[
    in_dtype: DType, out_dtype: DType, //, value_dtype: DType, tpw: Int, nr: Int
](p: Fp8Projection[in_dtype, out_dtype], lay: TileLayout, sm: TileSmem, g: Int, m0: Int, n0: Int):
    """`c[g, m0 ..< m0 + nr, n0 ..]` of the staged tiles (`sm.a_s` swizzled, `sm.sa_s`, `sm.sw_s`;
    `wg_tile_supported`): warpgroup `wg` owns m64 tiles `wg tpw ..< (wg + 1) tpw` of the block's output
    columns, one after the other (a tile's `part` and `acc` alone are live). Per K block the products
    are summed on tensor cores (`part`), then `acc += part * (sa * sw)`, as `project_tile` does; stored
    rounded to `value_dtype`. The caller fenced the activations' stores for the async proxy and synchronized."""
    comptime ACC = nr // 2  # float32 per thread of an m64 x nr tile
    var tid = thread_idx.x
    var wg = tid // WG_THREADS
    var w = (tid % WG_THREADS) // WARP_SIZE
    var lane = tid % WARP_SIZE
    var gq = lane // 4
    var t4 = lane % 4
    var kb_count = lay.k_blocks
    var block_chunks = lay.block_kp // KCHUNK
    var acts = Sw128[DType.bfloat16, 16, 1024].of(smem_u32(sm.a_s))
    var rows = Int(p.rows)
    var cms = Int(p.c.m_stride)
    var c_g = p.c.ptr.unsafe_offset(g * Int(p.c.g_stride))

    comptime for t in range(tpw):
        var col0 = (wg * tpw + t) * WG_TILE_COLS  # the tile's first output column in the block
        var row = col0 + 16 * w + gq  # the thread's first weight row (its accumulator's rows: row, row + 8)
        var acc = SIMD[DType.float32, ACC](0)
        var lo_bits = weight_bytes(sm, lay, row, 0, t4)
        var hi_bits = weight_bytes(sm, lay, row + 8, 0, t4)
        for kb in range(kb_count):
            var part = SIMD[DType.float32, ACC](0)
            for c in range(block_chunks):
                var ch = kb * block_chunks + c
                var lo = widened(lo_bits)
                var hi = widened(hi_bits)
                if ch + 1 < kb_count * block_chunks:  # the next chunk's bytes load under this chunk's products
                    lo_bits = weight_bytes(sm, lay, row, ch + 1, t4)
                    hi_bits = weight_bytes(sm, lay, row + 8, ch + 1, t4)
                wgmma_fence_aligned()
                comptime for step in range(KCHUNK // 16):
                    var x = lo.slice[4, offset = 4 * step]().join(hi.slice[4, offset = 4 * step]())
                    part = wgmma_async[
                        64, nr, 16, DType.bfloat16, DType.float32, 8, ACC,
                        a_type=DType.bfloat16, b_type=DType.bfloat16, layout_b="col",
                    ](x.shuffle[0, 1, 4, 5, 2, 3, 6, 7](), acts.at(ch * nr * 128 + 32 * step), part)
                # A's registers are read until the products complete, and the next chunk's widening may
                # reuse them (ptxas orders register writes before a wgmma, not after it): wait here.
                wgmma_commit_group_sync()
                wgmma_wait_group_sync[0]()
            var sw = SIMD[DType.float32, 2](sm.sw_s.unsafe_load(row * kb_count + kb), sm.sw_s.unsafe_load((row + 8) * kb_count + kb))
            comptime for j in range(nr // 8):
                comptime for e in range(2):
                    var sa = sm.sa_s.unsafe_load((8 * j + 2 * t4 + e) * kb_count + kb)
                    comptime for h in range(2):
                        comptime i = 4 * j + 2 * h + e
                        acc[i] = part[i].fma(sa * sw[h], acc[i])
        comptime for j in range(nr // 8):
            comptime for e in range(2):
                var r = 8 * j + 2 * t4 + e
                if m0 + r < rows:
                    comptime for h in range(2):
                        var v = acc[4 * j + 2 * h + e].cast[value_dtype]().cast[out_dtype]()
                        c_g.unsafe_store((m0 + r) * cms + n0 + row + 8 * h, v)


@always_inline
def stage_quantized_swizzled[
    threads: Int
](q: QuantizedRows, lay: TileLayout, sm: TileSmem, g: Int, m0: Int, mt: Int, rows: Int):
    """`stage_quantized` for a wgmma tile: rows `m0 ..< m0 + mt` of group (head) `g` the merge quantized
    into `sm.a_s` as the B operand (`store_quantized`; zeros past `rows`), scales into `sm.sa_s` (1 past
    `rows`). Loads and stores: no `cp.async` (the swizzle moves 4-byte pairs)."""
    var tid = thread_idx.x
    var heads = Int(q.heads)
    var kb_count = lay.k_blocks
    var vecs = lay.kp // 8  # 8 float16 values (16 bytes) a load
    for i in range(tid, mt * vecs, threads):
        var r = div_u32(i, vecs)
        var k = 8 * (i - r * vecs)
        var x = SIMD[DType.float16, 8](0)
        if m0 + r < rows:
            x = q.values.unsafe_offset(((m0 + r) * heads + g) * lay.kp + k).unsafe_load[width=8, alignment=16](0)
        store_quantized[True, 4](sm, lay, mt, r, k, x.slice[4]())
        store_quantized[True, 4](sm, lay, mt, r, k + 4, x.slice[4, offset=4]())
    for i in range(tid, mt * kb_count, threads):
        var r = div_u32(i, kb_count)
        var m = m0 + r
        var s = Float32(1)
        if m < rows:
            s = q.scales.unsafe_load((m * heads + g) * kb_count + i - r * kb_count)
        sm.sa_s.unsafe_store(i, s)
