"""Step 5 on tensor cores (bf16 / f16 caches): paged MLA attention with `mma.sync`.

Same contract as `attention_fma_kernel` (`attention_fma.mojo`) (same arguments, same
outputs), for bfloat16 or float16 caches. The operands are the op's rounding
points (`pymla/reference.py`): q_full holds dtype values, the probabilities
are rounded to dtype for P V (their row sum stays float32), one tensor-core
product each, accumulated in float32.

Layout of one block: `groups` groups of `gw` warps (4 or 8); each group owns
16 (token, head) rows of one request; all groups share each key tile in
shared memory.

* Scores `S[16, KT] = Q K^T`: warp `w` of a group takes the k-steps
  (16 dims) `w, w + gw, ...` of the key dim with its q fragments held in
  registers, `ldmatrix` for K; partial scores are summed across the `gw`
  warps through shared memory.
* Softmax: warp `w` updates rows `w 16 / gw ..` of its group (online max/sum).
* `O[16, R] += P V`: warp `w` owns value columns `[w R / gw, (w + 1) R / gw)`,
  `ldmatrix.trans` for V (the first R columns of the same key tile).

Tensor-core products are issued so that consecutive ones feed different
accumulators: a product that waits on the one just before it stalls the
warp for the full mma latency.

Fragment layouts are those of PTX `mma.m16n8k16` (.row.col, f32 accumulate):
lane = 4 g + t; A: a0,a1 = (g, 2t..2t+1), a2,a3 = (g+8, 2t..), a4,a5 = (g, 2t+8..),
a6,a7 = (g+8, 2t+8..); B: b0,b1 = (k = 2t..2t+1, n = g), b2,b3 = (k = 2t+8.., n = g);
C: c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1).
"""

from std.math import exp
from std.sys import size_of
from std.utils.numerics import neg_inf

from max.gpu import WARP_SIZE, barrier, thread_idx
from max.gpu.compute.mma import ld_matrix, mma
from max.gpu.memory import AddressSpace, async_copy, async_copy_commit_group, external_memory
from max.gpu.primitives import warp

from ..common import ceil_div
from .attention_block import AttentionBlock, AttentionParams, KeyTiles, SoftmaxRows, key_tile_bytes
from .params import to_global
from .pdl import wait_for_producers

comptime MMA_ROWS = 16  # rows per group (the M of one mma)
comptime MMA_KEY_DIM_MAX = 576  # k-steps of 16 per warp: key_dim <= gw * ks_max(gw) * 16
comptime MMA_RANK_MAX = 512  # value n-tiles of 8 per warp: kv_lora_rank <= gw * nt_max(gw) * 8
comptime MMA_KEY_PAD = 8  # elements: key rows of (key_dim + 8) keep ldmatrix conflict-free
comptime MMA_ROW_PAD = 8  # floats: score / probability rows of (KT + 8)


@always_inline
def mma_ks_max(gw: Int) -> Int:
    """Key-dim k-steps (16 dims) one of `gw` warps holds q fragments for."""
    return ceil_div(MMA_KEY_DIM_MAX // 16, gw)


@always_inline
def mma_nt_max(gw: Int) -> Int:
    """Value n-tiles (8 columns) one of `gw` warps accumulates."""
    return MMA_RANK_MAX // (8 * gw)


comptime MMA_FP8_STAGES = 2
"""Staging slots of an `fp8_ds_mla` cache's rows (`KeyTiles.stages`): the next tile's copy starts
before this one is widened. Not yet timed on a device (single staging: 16 h b128 32k 3.29 ms
against 1.83 ms with a bf16 cache, H200, 2026-12-05)."""


def mma_supported[dtype: DType, gw: Int](key_dim: Int, kv_lora_rank: Int) -> Bool:
    """Whether `attention_mma_kernel` with `gw` warps per group handles these sizes (else use the FMA kernel)."""
    comptime if dtype != DType.bfloat16 and dtype != DType.float16:
        return False
    return (
        key_dim % 16 == 0
        and key_dim <= MMA_KEY_DIM_MAX
        and kv_lora_rank % (16 * gw) == 0  # an even count of 8-column n-tiles per warp
        and kv_lora_rank <= MMA_RANK_MAX
    )


def attention_mma_smem_bytes[dtype: DType](groups: Int, kt: Int, gw: Int, key_dim: Int, fp8_row_bytes: Int = 0) -> Int:
    """Dynamic shared memory of `attention_mma_kernel` (regions 16-byte aligned); `fp8_row_bytes`: of an fp8_ds_mla cache."""
    var k_bytes = key_tile_bytes[dtype](kt, (key_dim + MMA_KEY_PAD) * size_of[dtype](), fp8_row_bytes, MMA_FP8_STAGES)
    var red_bytes = groups * gw * MMA_ROWS * (kt + MMA_ROW_PAD) * 4
    var p_bytes = groups * MMA_ROWS * (kt + MMA_ROW_PAD) * 4
    var row_bytes = ceil_div(groups * MMA_ROWS * 7 * 4, 16) * 16
    var off_bytes = 2 * kt * 8
    return k_bytes + red_bytes + p_bytes + row_bytes + off_bytes


@always_inline
def mma_acc[dt: DType](mut acc: SIMD[DType.float32, 4], a: SIMD[dt, 8], b: SIMD[dt, 4]):
    """`acc += A B` for one m16n8k16 tile."""
    var c = acc
    mma(acc, a, b, c)


@fieldwise_init
struct TileVectors(TrivialRegisterPassable):
    """A thread's share of a key tile's 16-byte vectors: `tid, tid + threads, ...` as (row, vector) pairs,
    from `divmod(tid, per_row)` in steps of `divmod(threads, per_row)` (no divisions in the copy loop);
    `stride`: elements per row of the tile."""

    var row: Int
    var vec: Int
    var row_step: Int
    var vec_step: Int
    var stride: Int
    var per_row: Int

    @staticmethod
    @always_inline
    def of(tid: Int, threads: Int, per_row: Int, stride: Int) -> Self:
        return Self(tid // per_row, tid % per_row, threads // per_row, threads % per_row, stride, per_row)


@always_inline
def copy_key_tile[
    dtype: DType, kt: Int
](
    blocks: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.GLOBAL],
    rowoff: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    k_s: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    vecs: TileVectors,
):
    """Starts the copy of `kt` cache rows (offsets in `rowoff`, -1 = zeros) into `k_s`, this thread's
    vectors `vecs`; one commit group."""
    comptime VEC = 16 // size_of[dtype]()
    var r = vecs.row
    var c = vecs.vec
    while r < kt:
        var ro = Int(rowoff.unsafe_load(r))
        var src = blocks.unsafe_offset(max(ro, 0) + c * VEC)
        async_copy[16, fill=Scalar[dtype](0)](
            src, k_s.unsafe_offset(r * vecs.stride + c * VEC), src_size=Int32(16) if ro >= 0 else Int32(0)
        )
        r += vecs.row_step
        c += vecs.vec_step
        if c >= vecs.per_row:
            c -= vecs.per_row
            r += 1
    async_copy_commit_group()


@always_inline
def copy_tile[
    dtype: DType, kt: Int, fp8: Bool, stages: Int, //, threads: Int
](
    tiles: KeyTiles[dtype, kt, fp8, stages=stages],
    p: AttentionParams[dtype],
    blocks: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.GLOBAL],
    rowoff: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    k_s: Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    vecs: TileVectors,
    tid: Int,
):
    """Starts the copy of the tile of cache rows `rowoff`: into `k_s` (`copy_key_tile`), or (`fp8`)
    the `fp8_ds_mla` rows into `tiles`' staging (`KeyTiles.copy_staged`)."""
    comptime if fp8:
        tiles.copy_staged[threads](p, rowoff, tid)
    else:
        copy_key_tile[dtype, kt](blocks, rowoff, k_s, vecs)


def attention_mma_kernel[
    dtype: DType, groups: Int, kt: Int, gw: Int, fp8: Bool = False
](
    p: AttentionParams[dtype]
):
    """One block per (request, `16 groups` rows, key partition); see the module docstring.

    Grid: `enqueue_attention`'s (a row slot or a task of the split schedule per block), block
    `32 gw groups` threads, `attention_mma_smem_bytes` bytes of dynamic shared memory.
    `fp8`: the keys are `p.fp8`'s `fp8_ds_mla` rows, widened into one bfloat16 tile (`KeyTiles`).
    """
    comptime assert kt % 32 == 0, "kt must be a multiple of 32"
    comptime assert MMA_ROWS % gw == 0 and (MMA_RANK_MAX // 8) % gw == 0, "gw must divide 16"
    comptime GROUP_THREADS = gw * WARP_SIZE
    comptime KS_MAX = mma_ks_max(gw)
    comptime NT_MAX = mma_nt_max(gw)
    comptime THREADS = groups * GROUP_THREADS
    comptime ROWS_BLK = groups * MMA_ROWS
    comptime NSP = kt // 8  # score n-tiles
    comptime NPAIR = kt // 16  # score n-tile pairs (one ldmatrix.x4 each); PV k-steps
    comptime KPL = kt // WARP_SIZE  # keys per lane in the softmax
    comptime RS = kt + MMA_ROW_PAD  # row stride of the score / probability tiles
    comptime VEC = 16 // size_of[dtype]()  # elements per 16-byte load

    var tid = thread_idx.x
    var group = tid // GROUP_THREADS
    var w = (tid % GROUP_THREADS) // WARP_SIZE
    var lane = tid % WARP_SIZE
    var g = lane // 4
    var t4 = lane % 4
    var base = external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=16]()  # carved below

    var blk = AttentionBlock.locate[ROWS_BLK](p)
    if blk.exits_empty():
        return
    var rank = Int(p.kv_lora_rank)
    var dim = Int(p.cache.key_dim)

    # Shared memory.
    var stride = dim + MMA_KEY_PAD
    var off = 0
    var k_buf_bytes = ceil_div(kt * stride * size_of[dtype](), 16) * 16
    var k_s0 = base.unsafe_offset(off).unsafe_bitcast[Scalar[dtype]]()  # two buffers [kt][stride] (fp8: one)
    var k_s1 = base.unsafe_offset(off + k_buf_bytes).unsafe_bitcast[Scalar[dtype]]()
    var staging = base.unsafe_offset(off + k_buf_bytes)  # fp8: the staged rows
    comptime if fp8:
        k_s1 = k_s0
    off += key_tile_bytes[dtype](kt, stride * size_of[dtype](), p.fp8.row_bytes() if fp8 else 0, MMA_FP8_STAGES)
    var red_s = base.unsafe_offset(off).unsafe_bitcast[Float32]()  # [groups][gw][16][RS]
    off += groups * gw * MMA_ROWS * RS * 4
    var p_s = base.unsafe_offset(off).unsafe_bitcast[Float32]()  # [groups][16][RS]
    off += groups * MMA_ROWS * RS * 4
    var st = SoftmaxRows.carve(base, off, ROWS_BLK)  # m, l, corr, slope, lo, hi, pos: [ROWS_BLK] each
    off += 7 * ROWS_BLK * 4
    off = ceil_div(off, 16) * 16
    var rowoff_s = base.unsafe_offset(off).unsafe_bitcast[Int64]()  # two buffers [kt]

    if tid < ROWS_BLK:
        st.start(blk, p, tid)
    barrier()

    # Keys any row of the block needs in this partition.
    var span = st.masks.key_span(blk, ROWS_BLK)
    var kb_hi = span[1]

    var acc = Array[SIMD[DType.float32, 4], NT_MAX](fill=0)
    var nt_count = rank // (8 * gw)  # value n-tiles of this warp
    var col_base = w * (rank // gw)
    var vec_per_row = dim // VEC
    var red_g = red_s.unsafe_offset(group * gw * MMA_ROWS * RS)
    var red_w = red_g.unsafe_offset(w * MMA_ROWS * RS)
    var p_g = p_s.unsafe_offset(group * MMA_ROWS * RS)
    var blocks_global = to_global(p.cache.blocks)

    # Double-buffered key tiles: tile i + 1 is copied (cp.async) while tile i is used.
    var vecs = TileVectors.of(tid, THREADS, vec_per_row, stride)
    comptime Tiles = KeyTiles[dtype, kt, fp8, stages=MMA_FP8_STAGES if fp8 else 1]
    var tiles = Tiles(rowoff_s, k_s0, k_s1, span, staging, stride)
    tiles.start(blk, p, tid)
    # Everything above reads only the op's inputs; a first tile of rows cached before this call
    # is copied too (fp8: staged), before the wait for the q step (pdl.mojo), whose q_full and
    # new cache rows follow.
    var copied = tiles.more() and tiles.first_is_old(blk, p)
    if copied:
        copy_tile[THREADS](tiles, p, blocks_global, rowoff_s, k_s0, vecs, tid)
    wait_for_producers()
    if tiles.more() and not copied:
        copy_tile[THREADS](tiles, p, blocks_global, rowoff_s, k_s0, vecs, tid)

    # This lane's q fragments (rows g and g + 8 of its group), in dtype.
    var nks = dim // 16
    var gr_a = blk.row0 + group * MMA_ROWS + g
    var gr_b = gr_a + 8
    var q_h = Array[SIMD[dtype, 8], KS_MAX](fill=0)
    comptime for i in range(KS_MAX):
        var ks = w + gw * i
        if ks < nks:
            var d0 = ks * 16 + 2 * t4
            var x = SIMD[DType.float32, 8](0)
            comptime for h in range(2):  # row g in x[0, 1, 4, 5], row g + 8 in x[2, 3, 6, 7]
                if gr_a + 8 * h < blk.row_end:
                    var src = p.q_full.unsafe_offset((gr_a + 8 * h) * dim + d0)
                    var v0 = src.unsafe_load[width=2, alignment=8](0)
                    var v1 = src.unsafe_load[width=2, alignment=8](8)
                    x[2 * h] = v0[0]
                    x[2 * h + 1] = v0[1]
                    x[2 * h + 4] = v1[0]
                    x[2 * h + 5] = v1[1]
            q_h[i] = x.cast[dtype]()  # exact: q_full holds dtype values

    while tiles.more():
        var k_s = tiles.wait[fence=False, threads=THREADS](blk, p, tid)
        var j0 = tiles.j0
        if tiles.has_next and not Tiles.COPIES_IN_WAIT:
            copy_tile[THREADS](tiles, p, blocks_global, tiles.next_rows(), tiles.next_keys(), vecs, tid)
            tiles.look_ahead(blk, p, tid)

        # Partial scores of this warp's k-steps.
        var s_acc = Array[SIMD[DType.float32, 4], NSP](fill=0)
        comptime for i in range(KS_MAX):
            var ks = w + gw * i
            if ks < nks:
                var kf = Array[SIMD[dtype, 8], NPAIR](fill=0)
                comptime for np in range(NPAIR):
                    var key = np * 16 + (lane % 8) + 8 * (lane // 16)
                    var d = ks * 16 + 8 * ((lane // 8) % 2)
                    kf[np] = ld_matrix[8](k_s.unsafe_offset(key * stride + d))
                comptime for np in range(NPAIR):
                    mma_acc(s_acc[2 * np], q_h[i], kf[np].slice[4, offset=0]())
                    mma_acc(s_acc[2 * np + 1], q_h[i], kf[np].slice[4, offset=4]())
        comptime for nt in range(NSP):
            var col = nt * 8 + 2 * t4
            red_w.unsafe_offset(g * RS + col).unsafe_store[alignment=8](0, s_acc[nt].slice[2, offset=0]())
            red_w.unsafe_offset((g + 8) * RS + col).unsafe_store[alignment=8](0, s_acc[nt].slice[2, offset=2]())
        barrier()

        # Online softmax: warp w of a group updates rows w 16 / gw .. of the group.
        comptime for ri in range(MMA_ROWS // gw):
            var r = w * (MMA_ROWS // gw) + ri
            var rb = group * MMA_ROWS + r
            var lo = Int(st.masks.lo.unsafe_load(rb))
            var hi = Int(st.masks.hi.unsafe_load(rb))
            var pos = Int(st.masks.pos.unsafe_load(rb))
            var slope = st.masks.slope.unsafe_load(rb)
            var sv = SIMD[DType.float32, KPL](0)
            comptime for kk in range(KPL):
                var j = lane + WARP_SIZE * kk
                var s = Float32(0)
                comptime for w2 in range(gw):
                    s += red_g.unsafe_load((w2 * MMA_ROWS + r) * RS + j)
                var key = j0 + j
                if key < kb_hi and key >= lo and key < hi:
                    s = s * p.scale - slope * Float32(pos - key)
                else:
                    s = neg_inf[DType.float32]()
                sv[kk] = s
            var m_old = st.m.unsafe_load(rb)
            var m_new = max(m_old, warp.max(sv.reduce_max()))
            var p = SIMD[DType.float32, KPL](0)
            var corr = Float32(1)
            if m_new != neg_inf[DType.float32]():
                p = exp(sv - m_new)
                corr = exp(m_old - m_new)
            var p_sum = warp.sum(p.reduce_add())
            comptime for kk in range(KPL):
                p_g.unsafe_store(r * RS + lane + WARP_SIZE * kk, p[kk])
            if lane == 0:
                st.m.unsafe_store(rb, m_new)
                st.l.unsafe_store(rb, st.l.unsafe_load(rb) * corr + p_sum)
                st.corr.unsafe_store(rb, corr)
        barrier()

        # O = O * corr + P V on this warp's value columns.
        var corr_a = st.corr.unsafe_load(group * MMA_ROWS + g)
        var corr_b = st.corr.unsafe_load(group * MMA_ROWS + g + 8)
        var corr_v = SIMD[DType.float32, 4](corr_a, corr_a, corr_b, corr_b)
        comptime for nt in range(NT_MAX):
            if nt < nt_count:
                acc[nt] *= corr_v
        comptime for ks in range(NPAIR):
            var kc = ks * 16 + 2 * t4
            var pa = p_g.unsafe_offset(g * RS + kc)
            var pb = p_g.unsafe_offset((g + 8) * RS + kc)
            var x0 = pa.unsafe_load[width=2, alignment=8](0)
            var x1 = pb.unsafe_load[width=2, alignment=8](0)
            var x2 = pa.unsafe_load[width=2, alignment=8](8)
            var x3 = pb.unsafe_load[width=2, alignment=8](8)
            var x = SIMD[DType.float32, 8](x0[0], x0[1], x1[0], x1[1], x2[0], x2[1], x3[0], x3[1])
            var pf = x.cast[dtype]()  # the probabilities rounded to dtype
            # Two 16-column slices at a time: 4 products on 4 accumulators.
            comptime for ntq in range(ceil_div(NT_MAX, 4)):
                if 4 * ntq < nt_count:
                    var vf = Array[SIMD[dtype, 8], 2](fill=0)
                    comptime for h in range(2):
                        if 4 * ntq + 2 * h < nt_count:
                            var key = ks * 16 + (lane % 8) + 8 * ((lane // 8) % 2)
                            var col = col_base + (2 * ntq + h) * 16 + 8 * (lane // 16)
                            vf[h] = ld_matrix[8, transpose=True](k_s.unsafe_offset(key * stride + col))
                    comptime for h in range(2):
                        comptime nt = 4 * ntq + 2 * h
                        if nt < nt_count:
                            mma_acc(acc[nt], pf, vf[h].slice[4, offset=0]())
                            mma_acc(acc[nt + 1], pf, vf[h].slice[4, offset=4]())
        # No barrier here: the next iteration's first barrier orders this tile's reads of
        # k_s / p_s / red_s before they are written again.
        tiles.advance()

    # Results: rows g and g + 8 of the group, this warp's columns.
    var inv_a = AttentionBlock.inverse_sum(st.l.unsafe_load(group * MMA_ROWS + g))
    var inv_b = AttentionBlock.inverse_sum(st.l.unsafe_load(group * MMA_ROWS + g + 8))
    var out_a = blk.result_row(p, gr_a)
    var out_b = blk.result_row(p, gr_b)
    comptime for nt in range(NT_MAX):
        if nt < nt_count:
            var col = col_base + nt * 8 + 2 * t4
            if gr_a < blk.row_end:
                out_a.unsafe_offset(col).unsafe_store[alignment=8](
                    0, blk.result[dtype, 2](acc[nt].slice[2, offset=0](), inv_a)
                )
            if gr_b < blk.row_end:
                out_b.unsafe_offset(col).unsafe_store[alignment=8](
                    0, blk.result[dtype, 2](acc[nt].slice[2, offset=2](), inv_b)
                )
    if tid < ROWS_BLK:
        blk.store_stats(p, blk.row0 + tid, st.m.unsafe_load(tid), st.l.unsafe_load(tid))
