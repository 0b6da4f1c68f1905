"""Step 5 on float32 FMAs: float32 caches and the sizes the tensor-core kernels do not take."""

from std.math import exp
from std.sys import size_of
from std.utils.numerics import neg_inf

from max.gpu import WARP_SIZE, barrier, thread_idx
from max.gpu.memory import AddressSpace, async_copy, async_copy_wait_all, external_memory
from max.gpu.primitives import warp

from .attention_block import AttentionBlock, AttentionParams, SoftmaxRows
from ..common import ceil_div
from .params import to_global
from .pdl import wait_for_producers


# ATT_ROWS (token, head) rows of one request per block, ATT_KT keys
# per tile, ATT_THREADS threads; each thread owns `cols_per_thread` value columns.
comptime ATT_ROWS = 16
comptime ATT_KT = 32
comptime ATT_WARPS = 8
comptime ATT_THREADS = ATT_WARPS * WARP_SIZE
comptime ATT_ROWS_PER_WARP = ATT_ROWS // ATT_WARPS
comptime ATT_KEY_PAD = 4  # elements of padding per key row in shared memory (bank spread)


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
    p: AttentionParams[dtype]
):
    """One block per (request, tile of ATT_ROWS rows, key partition).

    Rows are the request's (token, head) pairs in q_full order; keys are whole
    cache rows (`key_dim` values), values their first `kv_lora_rank`. Each key
    tile is read from the paged cache once into shared memory and used by
    every row of the block; each row keeps an online softmax. Without a
    split the normalized result goes straight to `raw [T, H, R]`; with one,
    each partition writes its unnormalized output, running max and sum to its
    partial rows (`part_*`, schedule.mojo) for `merge_kernel`.
    """
    comptime CPT = cols_per_thread
    var tid = thread_idx.x
    var warp_id = tid // WARP_SIZE
    var lane = tid % WARP_SIZE
    var blk = AttentionBlock.locate[ATT_ROWS](p)
    if blk.exits_empty():
        return
    var rank = Int(p.kv_lora_rank)
    var dim = Int(p.cache.key_dim)

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
    var st = SoftmaxRows.carve(base, off, ATT_ROWS)  # m, l, corr, slope, lo, hi, pos
    off += 7 * ATT_ROWS * 4
    var rowoff_s = base.unsafe_offset(off).unsafe_bitcast[Int64]()

    # Per-row metadata: key range, position, ALiBi slope, empty softmax state.
    if tid < ATT_ROWS:
        st.start(blk, p, tid)
    # Above: the op's inputs only; q_full and the new cache rows come from the q step (pdl.mojo).
    wait_for_producers()

    # q rows, transposed: qT_s[k * ATT_ROWS + r] (rows of one k contiguous).
    for e in range(tid, ATT_ROWS * dim, ATT_THREADS):
        var r = e % ATT_ROWS
        var k = e // ATT_ROWS
        var v = Float32(0)
        if blk.row0 + r < blk.row_end:
            v = p.q_full.unsafe_load((blk.row0 + r) * dim + k)
        qT_s.unsafe_store(e, v)
    barrier()

    # Keys any row of the block needs in this partition.
    var span = st.masks.key_span(blk, ATT_ROWS)
    var kb_lo = span[0]
    var kb_hi = span[1]

    var acc = Array[SIMD[DType.float32, ATT_ROWS], CPT](fill=0)
    var blocks_global = to_global(p.cache.blocks)
    var c0 = tid * CPT
    var stride = dim + ATT_KEY_PAD
    var vec_per_row = dim // 4
    var j0 = kb_lo
    while j0 < kb_hi:
        var nkeys = min(ATT_KT, kb_hi - j0)
        if tid < ATT_KT:
            var ro = -1
            if tid < nkeys:
                ro = blk.key_row(p, j0 + tid)
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
            if key < kb_hi and key >= Int(st.masks.lo.unsafe_load(r)) and key < Int(st.masks.hi.unsafe_load(r)):
                s = s * p.scale - st.masks.slope.unsafe_load(r) * Float32(Int(st.masks.pos.unsafe_load(r)) - key)
            else:
                s = neg_inf[DType.float32]()
            var m_old = st.m.unsafe_load(r)
            var m_new = max(m_old, warp.max(s))
            var p = Float32(0)
            var corr = Float32(1)
            if m_new != neg_inf[DType.float32]():
                p = exp(s - m_new)
                corr = exp(m_old - m_new)
            var p_sum = warp.sum(p)
            pT_s.unsafe_store(lane * ATT_ROWS + r, p.cast[dtype]().cast[DType.float32]())
            if lane == 0:
                st.m.unsafe_store(r, m_new)
                st.l.unsafe_store(r, st.l.unsafe_load(r) * corr + p_sum)
                st.corr.unsafe_store(r, corr)
        barrier()

        # acc = acc * corr + P V for this thread's value columns.
        if c0 < rank:
            var corr_v = st.corr.unsafe_load[width=ATT_ROWS, alignment=16](0)
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
            if blk.row0 + r < blk.row_end:
                var v = SIMD[DType.float32, CPT](0)
                comptime for i in range(CPT):
                    v[i] = acc[i][r]
                var inv = AttentionBlock.inverse_sum(st.l.unsafe_load(r))
                blk.result_row(p, blk.row0 + r).unsafe_offset(c0).unsafe_store(
                    0, blk.result[dtype, CPT](v, inv)
                )
    if tid < ATT_ROWS:
        blk.store_stats(p, blk.row0 + tid, st.m.unsafe_load(tid), st.l.unsafe_load(tid))
