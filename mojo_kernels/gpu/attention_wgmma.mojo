"""Step 5 on Hopper's warpgroup tensor cores (`wgmma`, sm_90a), bf16 / f16 caches.

Same contract as `attention_mma_kernel` (same arguments, same outputs, same
rounding points): q_full holds dtype values, scores are dtype products summed
in float32, the probabilities are rounded to dtype for P V and their row sums
stay float32.

One block = 64 packed (token, head) rows of one request (the M of one wgmma)
and two warpgroups. Per tile of `kt` keys (double-buffered, `cp.async`):

* warpgroup `wg` computes the scores of its half of the keys,
  `S_wg[64, kt/2] = Q K_wg^T` (Q and K from shared memory, K-major);
* the two halves agree on the running row max through shared memory; each
  writes its probabilities (rounded to dtype) into the shared tile `P[64, kt]`;
* warpgroup `wg` accumulates its half of the value columns,
  `O[64, R/2] += P V[:, wg R/2 ..]` (V = the first R columns of the same keys,
  read MN-major), so the key tile is read once for both products.

Shared-memory tiles use wgmma's canonical no-swizzle layout: 8 x 16-byte
"core matrices" of 8 rows; element (row r, column c) of a tile with `C`
columns sits at `(r / 8) 8 C + (c / 8) 64 + (r % 8) 8 + c % 8`. Every
16-byte vector index `v` of a tile is then `((r / 8) (C / 8) + c / 8) 8 + r % 8`,
so copies write shared memory linearly.
Accumulator fragments (m64nN, f32): warp `w` of a warpgroup, lane `4 g + t`,
element `4 j + e` is row `16 w + g + 8 (e / 2)`, column `8 j + 2 t + e % 2`.
"""

from std.math import exp
from std.sys import size_of
from std.utils.numerics import neg_inf

from max.gpu import WARP_SIZE, barrier, thread_idx
from max.gpu.compute.mma import (
    WGMMADescriptor,
    wgmma_async,
    wgmma_commit_group_sync,
    wgmma_fence_aligned,
    wgmma_wait_group_sync,
)
from max.gpu.memory import AddressSpace, async_copy, async_copy_commit_group, external_memory
from max.gpu.primitives.warp import shuffle_xor
from max.gpu.sync import named_barrier

from .attention_block import (
    AttentionBlock,
    AttentionParams,
    KeyTiles,
    RowMasks,
    SPtr,
    fence_async_proxy,
    fp8_row_bytes,
    key_tile_bytes,
    rescale_row,
)
from .params import to_global
from .pdl import wait_for_producers

comptime WG_ROWS = 64  # rows per block: the M of one wgmma
comptime WG_THREADS = 128  # one warpgroup
comptime WG_COUNT = 2
comptime WG_BLOCK_THREADS = WG_COUNT * WG_THREADS
comptime WG_VALUE_COLS = 256  # value columns per warpgroup (the N of the P V wgmma)
comptime WG_KEY_DIM = 576  # compile-time key dim: the score k-loop is unrolled (DeepSeek: 512 + 64)
comptime WG_RANK = WG_COUNT * WG_VALUE_COLS  # kv_lora_rank
comptime WG_FP8_ROW_BYTES = fp8_row_bytes(WG_RANK, WG_KEY_DIM - WG_RANK)  # an fp8_ds_mla row: 656


def wgmma_supported[dtype: DType](key_dim: Int, kv_lora_rank: Int) -> Bool:
    """Whether `attention_wgmma_kernel` handles these sizes."""
    comptime if dtype != DType.bfloat16 and dtype != DType.float16:
        return False
    return key_dim == WG_KEY_DIM and kv_lora_rank == WG_RANK


def attention_wgmma_smem_bytes[dtype: DType](kt: Int, key_dim: Int, fp8_row_bytes: Int = 0) -> Int:
    """Dynamic shared memory of `attention_wgmma_kernel[dtype, kt]` (regions 16-byte aligned); `fp8_row_bytes`: of an fp8_ds_mla cache."""
    var q_bytes = WG_ROWS * key_dim * size_of[dtype]()
    var k_bytes = key_tile_bytes[dtype](kt, key_dim * size_of[dtype](), fp8_row_bytes)
    var p_bytes = WG_ROWS * kt * size_of[dtype]()
    var row_bytes = (2 * WG_COUNT + 4) * WG_ROWS * 4  # row max / sum exchange, lo, hi, pos, slope
    var off_bytes = 2 * kt * 8
    return q_bytes + k_bytes + p_bytes + row_bytes + off_bytes


@always_inline
def smem_desc[
    dtype: DType
](ptr: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED], lbo: Int, sbo: Int) -> WGMMADescriptor[dtype]:
    """No-swizzle wgmma descriptor: start address, leading / stride byte offsets (16-byte units)."""
    var addr = (Int(ptr) & 0x3FFFF) >> 4
    return WGMMADescriptor[dtype](Int64(addr) | (Int64(lbo >> 4) << 16) | (Int64(sbo >> 4) << 32))


@always_inline
def copy_key_tile_core[
    dtype: DType, kt: Int
](
    blocks: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.GLOBAL],
    rowoff: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    k_s: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    tid: Int,
    chunks: Int,
):
    """Starts the copy of `kt` cache rows (offsets in `rowoff`, -1 = zeros) into `k_s` in core-matrix layout.

    Thread `tid` copies the 16-byte vectors `v = tid + 256 i`: row `8 (u / chunks) + tid % 8`,
    chunk `u % chunks` with `u = v / 8` (lanes 0..7 fill one core matrix); one commit group.
    """
    comptime VEC = 16 // size_of[dtype]()
    comptime U_STEP = WG_BLOCK_THREADS // 8
    var r8 = tid % 8
    var u = tid // 8
    var rg = u // chunks
    var c = u % chunks
    var v = tid
    var total = kt * chunks
    while v < total:
        var ro = Int(rowoff.unsafe_load(rg * 8 + r8))
        var src = blocks.unsafe_offset(max(ro, 0) + c * VEC)
        async_copy[16, fill=Scalar[dtype](0)](
            src, k_s.unsafe_offset(v * VEC), src_size=Int32(16) if ro >= 0 else Int32(0)
        )
        v += WG_BLOCK_THREADS
        c += U_STEP
        while c >= chunks:
            c -= chunks
            rg += 1
    async_copy_commit_group()


@always_inline
def quad_max(x: Float32) -> Float32:
    var y = max(x, shuffle_xor(x, 1))
    return max(y, shuffle_xor(y, 2))


@always_inline
def quad_sum(x: Float32) -> Float32:
    var y = x + shuffle_xor(x, 1)
    return y + shuffle_xor(y, 2)


@always_inline
def sync_math[bar: Int, threads: Int]():
    """The two math warpgroups meet: named barrier `bar` of `threads` threads, or (`bar` 0) the block's."""
    comptime if bar == 0:
        barrier()
    else:
        named_barrier[Int32(threads)](Int32(bar))


@always_inline
def rows_of_both[
    maxima: Bool, rows: Int, bar: Int, threads: Int
](xs: SPtr[Float32], wg: Int, t4: Int, ra: Int, rb: Int, x_a: Float32, x_b: Float32) -> Tuple[Float32, Float32]:
    """Rows `ra`, `rb`'s maxima (`maxima`) or sums over both warpgroups: this thread's `x_a`, `x_b` reduced
    over its quad, then traded with the other warpgroup through `xs [2][rows]` (`sync_math[bar, threads]`);
    sums add warpgroup 0's and 1's in that order, so both warpgroups hold the same bits."""
    var a: Float32
    var b: Float32
    comptime if maxima:
        a = quad_max(x_a)
        b = quad_max(x_b)
    else:
        a = quad_sum(x_a)
        b = quad_sum(x_b)
    if t4 == 0:
        xs.unsafe_store(wg * rows + ra, a)
        xs.unsafe_store(wg * rows + rb, b)
    sync_math[bar, threads]()
    comptime if maxima:
        var other = (1 - wg) * rows
        return (max(a, xs.unsafe_load(other + ra)), max(b, xs.unsafe_load(other + rb)))
    return (xs.unsafe_load(ra) + xs.unsafe_load(rows + ra), xs.unsafe_load(rb) + xs.unsafe_load(rows + rb))


def attention_wgmma_kernel[
    dtype: DType, kt: Int, fp8: Bool = False
](
    p: AttentionParams[dtype]
):
    """One block per (request, 64 rows, key partition); see the module docstring.

    Grid: `enqueue_attention`'s (a row slot or a task of the split schedule per block), block 256 threads,
    `attention_wgmma_smem_bytes` bytes of dynamic shared memory.
    `fp8`: the keys are `p.fp8`'s `fp8_ds_mla` rows, widened into one bfloat16 tile (`KeyTiles`).
    """
    # The parameters the kernel reads, loaded at entry, and its epilogue written out: with
    # `AttentionBlock.store_stats` (and the loads at the end) ptxas 13.0 spilled 100 bytes
    # with reloads inside the main loop, against 4-8 bytes after the loop this way.
    var q_full = p.q_full
    var blocks = p.cache.blocks
    var kv_lora_rank = p.kv_lora_rank
    var split = p.split.active()
    var scale = p.scale
    var raw = p.raw
    var part_out = p.part_out
    var part_max = p.part_max
    var part_sum = p.part_sum
    comptime assert kt % 32 == 0 and kt <= 256, "kt: a multiple of 32 (two halves of n >= 16)"
    comptime KH = kt // WG_COUNT  # keys per warpgroup: the N of the score wgmma
    comptime NJ_S = KH // 8  # score n-tiles per thread
    comptime NJ_O = WG_VALUE_COLS // 8  # value n-tiles per thread
    comptime ACC_W = WG_ROWS * WG_VALUE_COLS // WG_THREADS  # accumulator floats per thread
    comptime VEC = 16 // size_of[dtype]()
    comptime ESZ = size_of[dtype]()

    var tid = thread_idx.x
    var wg = tid // WG_THREADS
    var wt = tid % WG_THREADS
    var w = wt // WARP_SIZE
    var lane = tid % WARP_SIZE
    var g = lane // 4
    var t4 = lane % 4

    var rank = Int(kv_lora_rank)
    comptime dim = WG_KEY_DIM  # == key_dim (wgmma_supported)

    # With PDL (pdl.mojo) the block waits for the q step at once: any later wait makes ptxas
    # spill (160 bytes instead of 4), and this kernel's prologue is short next to its key loop.
    wait_for_producers()
    var blk = AttentionBlock.locate[WG_ROWS](p)
    if not blk.has_rows():
        return
    var row0 = blk.row0
    var row_end = blk.row_end
    var partial0 = blk.partial0
    var normalized = blk.normalized

    # Shared memory.
    comptime chunks = dim // 8  # 16-byte vectors per row
    var base = external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=128]()
    var off = 0
    var q_s = base.unsafe_offset(off).unsafe_bitcast[Scalar[dtype]]()  # [64][dim], core layout
    off += WG_ROWS * dim * ESZ
    var k_s0 = base.unsafe_offset(off).unsafe_bitcast[Scalar[dtype]]()  # two buffers [kt][dim], core layout (fp8: one)
    var k_s1 = base.unsafe_offset(off + kt * dim * ESZ).unsafe_bitcast[Scalar[dtype]]()
    var staging = base.unsafe_offset(off + kt * dim * ESZ)  # fp8: the staged rows
    comptime if fp8:
        k_s1 = k_s0
    off += key_tile_bytes[dtype](kt, dim * ESZ, WG_FP8_ROW_BYTES if fp8 else 0)  # compile-time offsets
    var p_s = base.unsafe_offset(off).unsafe_bitcast[Scalar[dtype]]()  # [64][kt], core layout
    off += WG_ROWS * kt * ESZ
    var xmax_s = base.unsafe_offset(off).unsafe_bitcast[Float32]()  # [2][64]
    off += WG_COUNT * WG_ROWS * 4
    var xsum_s = base.unsafe_offset(off).unsafe_bitcast[Float32]()  # [2][64]
    off += WG_COUNT * WG_ROWS * 4
    var lo_s = base.unsafe_offset(off).unsafe_bitcast[Int32]()
    off += WG_ROWS * 4
    var hi_s = base.unsafe_offset(off).unsafe_bitcast[Int32]()
    off += WG_ROWS * 4
    var pos_s = base.unsafe_offset(off).unsafe_bitcast[Int32]()
    off += WG_ROWS * 4
    var slope_s = base.unsafe_offset(off).unsafe_bitcast[Float32]()
    off += WG_ROWS * 4
    var rowoff_s = base.unsafe_offset(off).unsafe_bitcast[Int64]()  # two buffers [kt]

    var masks = RowMasks(lo_s, hi_s, pos_s, slope_s)
    if tid < WG_ROWS:
        masks.store(blk, p, tid)

    # Q tile in dtype (exact: q_full holds dtype values), zeros past the request's rows.
    var v = tid
    while v < WG_ROWS * chunks:
        var r = (v // (8 * chunks)) * 8 + v % 8
        var c = (v // 8) % chunks
        var x = SIMD[DType.float32, 8](0)
        if row0 + r < row_end:
            x = q_full.unsafe_offset((row0 + r) * dim + c * 8).unsafe_load[width=8, alignment=16](0)
        q_s.unsafe_offset(v * VEC).unsafe_store[alignment=16](0, x.cast[dtype]())
        v += WG_BLOCK_THREADS
    barrier()

    # This thread's two rows (g and g + 8 of its warp) and their mask data.
    var ra = 16 * w + g
    var rb = ra + 8
    var lo_a = Int(lo_s.unsafe_load(ra))
    var hi_a = Int(hi_s.unsafe_load(ra))
    var pos_a = Int(pos_s.unsafe_load(ra))
    var slope_a = slope_s.unsafe_load(ra)
    var lo_b = Int(lo_s.unsafe_load(rb))
    var hi_b = Int(hi_s.unsafe_load(rb))
    var pos_b = Int(pos_s.unsafe_load(rb))
    var slope_b = slope_s.unsafe_load(rb)

    # Keys any row of the block needs in this partition.
    var span = masks.key_span(blk, WG_ROWS)
    var kb_hi = span[1]

    var blocks_global = to_global(blocks)
    # Descriptor strides (bytes): 16-byte columns of a core matrix are 128 bytes apart along a row;
    # 8-row groups are 8 C ESZ apart.
    comptime sbo_qk = 8 * dim * ESZ
    comptime SBO_P = 8 * kt * ESZ

    var m_a = neg_inf[DType.float32]()
    var m_b = neg_inf[DType.float32]()
    var l_a = Float32(0)
    var l_b = Float32(0)
    var acc = SIMD[DType.float32, ACC_W](0)

    var tiles = KeyTiles[dtype, kt, fp8, core_layout=True, dims=(WG_RANK, WG_KEY_DIM - WG_RANK)](rowoff_s, k_s0, k_s1, span, staging, 0)
    tiles.start(blk, p, tid)
    if tiles.more():
        comptime if fp8:
            tiles.copy_staged[WG_BLOCK_THREADS](p, rowoff_s, tid)
        else:
            copy_key_tile_core[dtype, kt](blocks_global, rowoff_s, k_s0, tid, chunks)
    while tiles.more():
        # This tile is in k_s; the previous tile's P V is done in both warpgroups.
        var k_s = tiles.wait[fence=True, threads=WG_BLOCK_THREADS](blk, p, tid)
        var j0 = tiles.j0
        if tiles.has_next:
            comptime if fp8:
                tiles.copy_staged[WG_BLOCK_THREADS](p, tiles.next_rows(), tid)
            else:
                copy_key_tile_core[dtype, kt](blocks_global, tiles.next_rows(), tiles.next_keys(), tid, chunks)
            tiles.look_ahead(blk, p, tid)

        # S = Q K^T for this warpgroup's KH keys: dim / 16 k-steps of m64 n(KH) k16.
        var s = SIMD[DType.float32, KH // 2](0)
        var a_desc = smem_desc[dtype](q_s, 128, sbo_qk)
        var b_desc = smem_desc[dtype](k_s.unsafe_offset(wg * KH * dim), 128, sbo_qk)
        wgmma_fence_aligned()
        comptime for ks in range(WG_KEY_DIM // 16):
            s = wgmma_async[64, KH, 16, DType.float32, KH // 2, a_type=dtype, b_type=dtype, layout_b="col"](
                a_desc + ks * 256, b_desc + ks * 256, s
            )
        wgmma_commit_group_sync()
        wgmma_wait_group_sync[0]()

        # Scale, bias and mask; this warpgroup's row maxima.
        var mx_a = neg_inf[DType.float32]()
        var mx_b = neg_inf[DType.float32]()
        comptime for j in range(NJ_S):
            comptime for e in range(4):
                var key = j0 + wg * KH + 8 * j + 2 * t4 + e % 2
                var x = s[4 * j + e]
                comptime if e < 2:
                    if key < kb_hi and key >= lo_a and key < hi_a:
                        x = x * scale - slope_a * Float32(pos_a - key)
                    else:
                        x = neg_inf[DType.float32]()
                    mx_a = max(mx_a, x)
                else:
                    if key < kb_hi and key >= lo_b and key < hi_b:
                        x = x * scale - slope_b * Float32(pos_b - key)
                    else:
                        x = neg_inf[DType.float32]()
                    mx_b = max(mx_b, x)
                s[4 * j + e] = x
        var mx = rows_of_both[True, WG_ROWS, 0, 2 * WG_THREADS](xmax_s, wg, t4, ra, rb, mx_a, mx_b)
        var mn_a = max(m_a, mx[0])
        var mn_b = max(m_b, mx[1])
        var step_a = rescale_row(m_a, mn_a)
        var step_b = rescale_row(m_b, mn_b)
        var corr_a = step_a[0]
        var corr_b = step_b[0]
        var sh_a = step_a[1]
        var sh_b = step_b[1]
        m_a = mn_a
        m_b = mn_b

        # Probabilities: float32 row sums, dtype values into P (columns wg KH ..).
        var ps_a = Float32(0)
        var ps_b = Float32(0)
        comptime for j in range(NJ_S):
            var pa = exp(SIMD[DType.float32, 2](s[4 * j], s[4 * j + 1]) - sh_a)
            var pb = exp(SIMD[DType.float32, 2](s[4 * j + 2], s[4 * j + 3]) - sh_b)
            ps_a += pa.reduce_add()
            ps_b += pb.reduce_add()
            var col = wg * KH + 8 * j + 2 * t4
            var at_a = (ra // 8) * (8 * kt) + (col // 8) * 64 + (ra % 8) * 8 + col % 8
            var at_b = (rb // 8) * (8 * kt) + (col // 8) * 64 + (rb % 8) * 8 + col % 8
            p_s.unsafe_offset(at_a).unsafe_store[alignment=4](0, pa.cast[dtype]())
            p_s.unsafe_offset(at_b).unsafe_store[alignment=4](0, pb.cast[dtype]())
        l_a = l_a * corr_a + ps_a
        l_b = l_b * corr_b + ps_b
        fence_async_proxy()
        barrier()  # P complete

        # O = O corr + P V on this warpgroup's value columns: kt / 16 k-steps of m64 n256 k16.
        var cv = SIMD[DType.float32, ACC_W](0)
        comptime for j in range(NJ_O):
            cv[4 * j] = corr_a
            cv[4 * j + 1] = corr_a
            cv[4 * j + 2] = corr_b
            cv[4 * j + 3] = corr_b
        acc *= cv
        var pa_desc = smem_desc[dtype](p_s, 128, SBO_P)
        var v_desc = smem_desc[dtype](k_s.unsafe_offset(wg * WG_VALUE_COLS * 8), sbo_qk, 128)
        wgmma_fence_aligned()
        comptime for ks in range(kt // 16):
            acc = wgmma_async[
                64, WG_VALUE_COLS, 16, DType.float32, ACC_W, a_type=dtype, b_type=dtype, layout_b="row"
            ](pa_desc + ks * 256, v_desc + ks * 2 * sbo_qk, acc)
        wgmma_commit_group_sync()
        wgmma_wait_group_sync[0]()
        tiles.advance()

    # Row sums: this thread's quad, then both warpgroups.
    var sums = rows_of_both[False, WG_ROWS, 0, 2 * WG_THREADS](xsum_s, wg, t4, ra, rb, l_a, l_b)
    l_a = sums[0]
    l_b = sums[1]
    var inv_a = Float32(1) / l_a if l_a > 0 else Float32(0)
    var inv_b = Float32(1) / l_b if l_b > 0 else Float32(0)
    var gr_a = row0 + ra
    var gr_b = row0 + rb
    comptime for j in range(NJ_O):
        var col = wg * WG_VALUE_COLS + 8 * j + 2 * t4
        var va = SIMD[DType.float32, 2](acc[4 * j], acc[4 * j + 1])
        var vb = SIMD[DType.float32, 2](acc[4 * j + 2], acc[4 * j + 3])
        if normalized:
            if gr_a < row_end:
                raw.unsafe_offset(gr_a * rank + col).unsafe_store[alignment=8](
                    0, (va * inv_a).cast[dtype]().cast[DType.float32]()
                )
            if gr_b < row_end:
                raw.unsafe_offset(gr_b * rank + col).unsafe_store[alignment=8](
                    0, (vb * inv_b).cast[dtype]().cast[DType.float32]()
                )
        else:
            if gr_a < row_end:
                part_out.unsafe_offset((partial0 + gr_a) * rank + col).unsafe_store[alignment=8](0, va)
            if gr_b < row_end:
                part_out.unsafe_offset((partial0 + gr_b) * rank + col).unsafe_store[alignment=8](0, vb)
    if split and wg == 0 and t4 == 0:
        if gr_a < row_end:
            part_max.unsafe_store(partial0 + gr_a, m_a)
            part_sum.unsafe_store(partial0 + gr_a, l_a)
        if gr_b < row_end:
            part_max.unsafe_store(partial0 + gr_b, m_b)
            part_sum.unsafe_store(partial0 + gr_b, l_b)
