"""Step 5 on Hopper (sm_90a) for few rows per request: keys as the M of every `wgmma` ("swap AB"),
16 (token, head) rows per block as its N, bf16 / f16 caches and `fp8_ds_mla` caches for bf16 ops.

Same contract as `attention_sm90_kernel` (same `TmaAttentionParams`, outputs and rounding points:
q_full holds dtype values, scores are dtype products summed in float32, probabilities rounded to
dtype for P V, float32 row sums; no quantizing epilogue: the merge quantizes).

Why: at 16 heads a request has 16 rows, and the 64-row kernel (`attention_sm90.mojo`) computes 48
rows of padding in both products and keeps a 72 KiB Q in shared memory. With an `fp8_ds_mla` cache
that kernel is bound by its math, not by the (0.57x) bytes: one bf16 stage fits beside two raw
slots, and each block waits for its widening, its 4x padded products and its softmax in turn
(H100, 16 h b64 8k, step 5: 257.6 us on fp8 rows against 225.2 us on bf16 rows). Here:

* `S^T [64 keys, 16 rows] = K Q^T`: `wgmma m64 n16 k16`, A = the key block's boxes (K-major, as
  TMA lands them), B = Q (16 rows, K-major, 18 KiB). `O^T [512, 16] += V^T P^T`: 8 value tiles of
  `m64 n16 k16`, A = the same boxes read MN-major (the transpose bit), B = P^T (16 rows x 64 keys,
  K-major, 2 KiB). A quarter of the 64-row kernel's tensor work, none of it padding.
* Two math warpgroups share every block: warpgroup `wg` owns value boxes `4 wg ..< 4 wg + 4` (it
  widens them from the raw slot, scores over them, and its accumulator is their 256 columns) and
  half of the rope box's k steps. Their partial scores are exchanged once per block through
  shared memory (`exch`, by block parity), so both hold the whole `S^T` and run the same softmax
  (float additions commute: the two agree bit for bit) and write their own P^T; no other
  exchange between them.
* Shared memory: Q 18 KiB, then `SmemPlan[fp8, 16]` (bf16: two stages; fp8: one stage, whose
  box 8 is unused, and `N9_RAW_SLOTS` raw slots of 41 KiB, each a block's fp8 bytes, scales and
  rope box, released once both warpgroups have their scores: `SmemPlan.ROPE_IN_RAW`), then P^T
  and the exchange buffers (`NarrowSmem`). The producer warpgroup's first thread issues every copy
  (`produce_keys`, `produce_fp8_keys`); no `setmaxnreg` (the math needs far fewer than 168).
* Accumulator fragments (m64 n16, f32): warp `v` of a warpgroup, lane `4 g + t`, element `4 j + e`
  is M row (key, or value column) `16 v + g + 8 (e / 2)`, N column (block row) `8 j + 2 t + e % 2`:
  a thread holds 2 keys of 4 rows; a row's max and sum reduce over the lanes of one `t`
  (`shuffle_xor` 4, 8, 16) and the 4 warps (`xmax`, `xsum`).
"""

from std.math import exp
from std.utils import StaticTuple
from std.utils.numerics import neg_inf

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, WARP_SIZE, thread_idx
from max.gpu.compute.mma import wgmma_async, wgmma_commit_group_sync, wgmma_fence_aligned, wgmma_wait_group_sync
from max.gpu.memory import AddressSpace, external_memory
from max.gpu.primitives.warp import shuffle_idx, shuffle_xor
from max.gpu.sync import mbarrier_arrive, named_barrier

from .attention_block import AttentionBlock, SPtr, fence_async_proxy, rescale_row
from .hopper import Sw128, mbar_wait, smem_u32
from .pdl import allow_dependents, wait_for_producers
from .tma_producer import produce, start_block, widen_raw_rows, zero_outside_values
from .tma_smem import (
    KeyBlocks,
    S9_BLOCK_BYTES,
    S9_BOXES,
    S9_BOX_BYTES,
    S9_KEYS,
    S9_MATH_THREADS,
    S9_THREADS,
    S9_WG,
    SmemPlan,
    TmaAttentionParams,
    wg_barrier,
)

comptime N9_ROWS = 16  # rows per block: the N of every wgmma
comptime N9_TILES = 4  # value tiles (one 64-column box each) per math warpgroup
comptime N9_ACC = 8  # float32 accumulator values per thread of an m64 n16 tile
comptime N9_PT_BYTES = N9_ROWS * 128  # P^T: 16 rows x 64 keys of dtype, one swizzle atom wide
# Named barriers (0 is `barrier()`): both math warpgroups; then per warpgroup (id + wg).
comptime BAR_N_SCORES: Int32 = 1
comptime BAR_N_MAX: Int32 = 2
comptime BAR_N_P: Int32 = 4
comptime BAR_N_SUM: Int32 = 6
comptime BAR_N_WIDEN: Int32 = 8


@always_inline
def align_1024(x: Int) -> Int:
    return (x + 1023) // 1024 * 1024


@fieldwise_init
struct NarrowSmem[fp8: Bool](TrivialRegisterPassable):
    """`SmemPlan[fp8, N9_ROWS]`, then each math warpgroup's P^T (1024-byte aligned: the swizzle atom)
    and the partial scores exchanged per block parity."""

    var plan: SmemPlan[Self.fp8, N9_ROWS]

    comptime PT = align_1024(SmemPlan[Self.fp8, N9_ROWS].END)
    comptime EXCH = Self.PT + 2 * N9_PT_BYTES
    comptime END = Self.EXCH + 2 * 2 * S9_WG * N9_ACC * 4

    @always_inline
    def pt(self, wg: Int) -> SPtr[UInt8]:
        return self.plan.base.unsafe_offset(Self.PT + wg * N9_PT_BYTES)

    @always_inline
    def exch(self, wg: Int, parity: Int) -> SPtr[Float32]:
        """Warpgroup `wg`'s partial scores of the blocks of `parity`: thread `t`'s 8 at `8 t`."""
        return self.plan.base.unsafe_offset(Self.EXCH + (2 * wg + parity) * S9_WG * N9_ACC * 4).unsafe_bitcast[Float32]()


def attention_narrow_smem_bytes[fp8: Bool = False]() -> Int:
    """Dynamic shared memory of `attention_narrow_kernel`."""
    return NarrowSmem[fp8].END


@always_inline
def row_of(q: Int, t4: Int) -> Int:
    """Block row of a thread's row slot `q` (`2 j + e % 2` of accumulator element `4 j + e`)."""
    return 8 * (q // 2) + 2 * t4 + q % 2


@always_inline
def scores_box[
    dtype: DType, kk_first: Int, kk_count: Int
](
    s: SIMD[DType.float32, N9_ACC], keys: Sw128[dtype, 16, 1024], q: Sw128[dtype, 16, 1024], box: Int, col: Int = 0
) -> SIMD[DType.float32, N9_ACC]:
    """`s += K Q^T` over k16 steps `kk_first ..< kk_first + kk_count` of column box `box` (both K-major),
    from byte column `col` of the box on (a multiple of 32: whole k16 steps); `keys` starts at the key
    block's box `box`."""
    var out = s
    comptime for kk in range(kk_first, kk_first + kk_count):
        out = wgmma_async[
            64, N9_ROWS, 16, DType.float32, N9_ACC, a_type=dtype, b_type=dtype, layout_a="row", layout_b="col"
        ](
            keys.at(col + kk * 32),
            q.at(box * SmemPlan[False, N9_ROWS].Q_BOX_BYTES + col + kk * 32),
            out,
        )
    return out


@always_inline
def values_tile[
    dtype: DType
](
    acc: SIMD[DType.float32, N9_ACC], v: Sw128[dtype, S9_BOX_BYTES, 1024], box: Int, pt: Sw128[dtype, 16, 1024]
) -> SIMD[DType.float32, N9_ACC]:
    """`acc += V^T P^T` for the 64-column value box `box` boxes on from `v` (MN-major: the transpose
    bit) over the block's 64 keys."""
    var out = acc
    comptime for kk in range(S9_KEYS // 16):
        out = wgmma_async[
            64, N9_ROWS, 16, DType.float32, N9_ACC, a_type=dtype, b_type=dtype, layout_a="col", layout_b="col"
        ](
            v.at(box * S9_BOX_BYTES + kk * 16 * 128),
            pt.at(kk * 32),
            out,
        )
    return out


@always_inline
def rescaled(acc: SIMD[DType.float32, N9_ACC], corr: SIMD[DType.float32, 4]) -> SIMD[DType.float32, N9_ACC]:
    """`acc` with element `4 j + e` times its row's correction `corr[2 j + e % 2]`."""
    var out = acc
    comptime for e in range(N9_ACC):
        out[e] = acc[e] * corr[2 * (e // 4) + e % 2]
    return out


@always_inline
def store_tile[
    dtype: DType
](
    p: TmaAttentionParams[dtype], blk: AttentionBlock, acc: SIMD[DType.float32, N9_ACC], col0: Int, t4: Int,
    inv: SIMD[DType.float32, 4],
):
    """One value tile of this thread's rows into their result rows (`AttentionBlock.result_row`): element
    `4 j + e` is column `col0 + 8 (e / 2)` of block row `8 j + 2 t4 + e % 2`."""
    comptime for e in range(N9_ACC):
        comptime q = 2 * (e // 4) + e % 2
        var row = blk.row0 + row_of(q, t4)
        if row < blk.row_end:
            var v = blk.result[dtype, 1](SIMD[DType.float32, 1](acc[e]), inv[q])
            blk.result_row(p.att, row).unsafe_store(col0 + 8 * ((e % 4) // 2), v[0])


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(S9_THREADS)))
@__llvm_arg_metadata(p, `nvvm.grid_constant`)
def attention_narrow_kernel[dtype: DType, fp8: Bool = False](p: TmaAttentionParams[dtype]):
    """One block per (request, 16 rows, key partition); see the module docstring.

    Grid `attention_grid` (a row slot or a task of the split schedule per block), block `S9_THREADS`
    threads, `attention_narrow_smem_bytes[fp8]()` bytes of dynamic shared memory.
    """
    comptime assert not fp8 or dtype == DType.bfloat16, "fp8_ds_mla rows serve bfloat16 ops"
    # With PDL every thread waits for the q step at once, before the role split (as attention_sm90_kernel).
    wait_for_producers()
    var tid = thread_idx.x
    var blk = AttentionBlock.locate[N9_ROWS](p.att)
    if not blk.has_rows():
        return
    var ns = NarrowSmem[fp8](
        SmemPlan[fp8, N9_ROWS](external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=1024]())
    )
    var keys = start_block(p, blk, ns.plan, tid)
    # From lane 0: warp-uniform for ptxas, so the wgmma descriptors derived from it live in uniform registers
    # (attention_sm90_kernel).
    var wg = Int(shuffle_idx(UInt32(tid // S9_WG), 0))
    if wg == 2:
        if tid == S9_MATH_THREADS:
            produce(p, blk, ns.plan, keys)
        return
    attend_narrow[dtype, fp8](p, blk, ns, keys, wg, tid % S9_WG)


@always_inline
def attend_narrow[
    dtype: DType, fp8: Bool
](p: TmaAttentionParams[dtype], blk: AttentionBlock, ns: NarrowSmem[fp8], keys: KeyBlocks, wg: Int, wt: Int):
    """Math warpgroup `wg`'s thread `wt`: every key block of the partition, then its 256 value columns
    of the block's rows and (warpgroup 0) the rows' running max and sum."""
    comptime STAGES = SmemPlan[fp8, N9_ROWS].STAGES
    comptime SLOTS = SmemPlan[fp8, N9_ROWS].RAW_SLOTS
    var sm = ns.plan
    var masks = sm.masks()
    var warp = wt // WARP_SIZE
    var lane = wt % WARP_SIZE
    var g = lane // 4
    var t4 = lane % 4
    # This thread's 4 rows: their keys `[lo, hi)` within the partition's span, position, slope.
    var lo = SIMD[DType.int32, 4](0)
    var hi = SIMD[DType.int32, 4](0)
    var pos = SIMD[DType.float32, 4](0)
    var slope = SIMD[DType.float32, 4](0)
    comptime for q in range(4):
        var r = row_of(q, t4)
        lo[q] = max(masks.lo.unsafe_load(r), Int32(keys.lo))
        hi[q] = min(masks.hi.unsafe_load(r), Int32(keys.hi))
        pos[q] = Float32(masks.pos.unsafe_load(r))
        slope[q] = masks.slope.unsafe_load(r)
    var scale = p.att.scale
    var xmax = sm.xmax()
    var q_u = sm.q_u32()
    var stage0_u = smem_u32(sm.stage(0))
    var pt = ns.pt(wg)
    var pt_u = smem_u32(pt)

    var m = SIMD[DType.float32, 4](neg_inf[DType.float32]())
    var l = SIMD[DType.float32, 4](0)  # this thread's keys' share of its rows' sums
    var acc0 = SIMD[DType.float32, N9_ACC](0)
    var acc1 = SIMD[DType.float32, N9_ACC](0)
    var acc2 = SIMD[DType.float32, N9_ACC](0)
    var acc3 = SIMD[DType.float32, N9_ACC](0)

    for b in range(keys.count()):
        var st = Int(shuffle_idx(UInt32(b % STAGES), 0))  # warp-uniform for ptxas, as `wg`
        var phase = (b // STAGES) & 1
        var par = b & 1
        var slot = b % SLOTS
        comptime if fp8:
            # This warpgroup's value boxes of the one stage, widened from the block's raw slot. Only this
            # warpgroup reads them (its scores and its P V, both waited for), so it waits for no one.
            mbar_wait(sm.raw_full(slot), (b // SLOTS) & 1)
            widen_raw_rows[dtype, S9_KEYS, 2, True](rebind[SmemPlan[True, N9_ROWS]](sm), slot, 0, 2 * wg, wt)
            fence_async_proxy()
            wg_barrier[BAR_N_WIDEN](wg)

        # S^T over this warpgroup's value boxes and its half of the rope box, each started as it lands.
        var s = SIMD[DType.float32, N9_ACC](0)
        var stage_u = stage0_u + UInt32(st * S9_BLOCK_BYTES)
        var q_d = Sw128[dtype, 16, 1024].of(q_u)
        comptime for i in range(N9_TILES):
            comptime if not fp8:
                mbar_wait(sm.full(st, 4 * wg + i), phase)
            # A fence after every wait (attention_sm90_kernel: else ptxas serializes every wgmma, C7520).
            wgmma_fence_aligned()
            var box = 4 * wg + i
            s = scores_box[dtype, 0, 4](s, Sw128[dtype, 16, 1024].of(stage_u + UInt32(box * S9_BOX_BYTES)), q_d, box)
        # The rope box: box 8 of the stage, or (fp8) the raw slot's, which came with the latent bytes.
        var rope_u = stage_u + UInt32((S9_BOXES - 1) * S9_BOX_BYTES)
        comptime if fp8:
            rope_u = smem_u32(sm.rope(slot))
        else:
            mbar_wait(sm.full(st, S9_BOXES - 1), phase)
        wgmma_fence_aligned()
        s = scores_box[dtype, 0, 2](s, Sw128[dtype, 16, 1024].of(rope_u), q_d, S9_BOXES - 1, wg * 64)  # its k steps 2 wg, 2 wg + 1
        wgmma_commit_group_sync()
        wgmma_wait_group_sync[0]()
        comptime if fp8:
            # The raw slot is read no more: the producer may copy block b + SLOTS into it, while this block's
            # softmax and P V and the next block's widening run.
            if lane == 0:
                _ = mbarrier_arrive(sm.raw_empty(slot))

        # The other warpgroup's partial scores: both now hold the block's S^T.
        ns.exch(wg, par).unsafe_offset(wt * N9_ACC).unsafe_store[alignment=32](0, s)
        named_barrier[S9_MATH_THREADS](BAR_N_SCORES)
        s = s + ns.exch(1 - wg, par).unsafe_offset(wt * N9_ACC).unsafe_load[width=N9_ACC, alignment=32](0)

        # Scale, ALiBi and masks; the rows' maxima over this thread's keys, the warp's, the warpgroup's.
        var key0 = Int32(keys.start(b) + 16 * warp + g)
        var bmax = SIMD[DType.float32, 4](neg_inf[DType.float32]())
        comptime for e in range(N9_ACC):
            comptime q = 2 * (e // 4) + e % 2
            var key = key0 + Int32(8 * ((e % 4) // 2))
            var x = s[e]
            if key >= lo[q] and key < hi[q]:
                x = x * scale - slope[q] * (pos[q] - Float32(key))
            else:
                x = neg_inf[DType.float32]()
            bmax[q] = max(bmax[q], x)
            s[e] = x
        comptime for q in range(4):
            var v = bmax[q]
            v = max(v, shuffle_xor(v, 4))
            v = max(v, shuffle_xor(v, 8))
            bmax[q] = max(v, shuffle_xor(v, 16))
        var rows_max = xmax.unsafe_offset((2 * wg + par) * 4 * N9_ROWS)
        if g == 0:
            comptime for q in range(4):
                rows_max.unsafe_store(warp * N9_ROWS + row_of(q, t4), bmax[q])
        wg_barrier[BAR_N_MAX](wg)
        var corr = SIMD[DType.float32, 4](1)
        var shift = SIMD[DType.float32, 4](0)
        comptime for q in range(4):
            var r = row_of(q, t4)
            var mx = max(
                max(rows_max.unsafe_load(r), rows_max.unsafe_load(N9_ROWS + r)),
                max(rows_max.unsafe_load(2 * N9_ROWS + r), rows_max.unsafe_load(3 * N9_ROWS + r)),
            )
            var step = rescale_row(m[q], max(m[q], mx))
            corr[q] = step[0]
            shift[q] = step[1]
            m[q] = max(m[q], mx)

        # Probabilities: float32 sums, dtype values into this warpgroup's P^T (row n, key k: 16-byte chunk
        # k / 8 of row n, swizzled).
        l = l * corr
        comptime for e in range(N9_ACC):
            comptime q = 2 * (e // 4) + e % 2
            var pr = exp(s[e] - shift[q])
            l[q] += pr
            var n = row_of(q, t4)
            var chunk = 2 * warp + (e % 4) // 2
            pt.unsafe_offset(n * 128 + ((chunk ^ (n % 8)) * 16) + 2 * g).unsafe_bitcast[Scalar[dtype]]().unsafe_store(
                0, pr.cast[dtype]()
            )
        if keys.partial(b):
            zero_outside_values[S9_KEYS, N9_TILES](sm, keys, b, st, 0, 4 * wg, wt)
        fence_async_proxy()
        wg_barrier[BAR_N_P](wg)  # its P^T (and zeroed rows) written

        # O^T = O^T corr + V^T P^T on this warpgroup's 4 value boxes.
        acc0 = rescaled(acc0, corr)
        acc1 = rescaled(acc1, corr)
        acc2 = rescaled(acc2, corr)
        acc3 = rescaled(acc3, corr)
        wgmma_fence_aligned()
        var v_d = Sw128[dtype, S9_BOX_BYTES, 1024].of(stage_u + UInt32(4 * wg * S9_BOX_BYTES))
        var pt_d = Sw128[dtype, 16, 1024].of(pt_u)
        acc0 = values_tile[dtype](acc0, v_d, 0, pt_d)
        acc1 = values_tile[dtype](acc1, v_d, 1, pt_d)
        acc2 = values_tile[dtype](acc2, v_d, 2, pt_d)
        acc3 = values_tile[dtype](acc3, v_d, 3, pt_d)
        wgmma_commit_group_sync()
        wgmma_wait_group_sync[0]()
        comptime if not fp8:
            if lane == 0:
                _ = mbarrier_arrive(sm.empty(st))

    # The key loop is done: the merge may be scheduled (pdl.mojo).
    allow_dependents()
    # Row sums: this thread's keys, the warp's lanes of one t4, the warpgroup's warps.
    var xsum = sm.xsum().unsafe_offset(wg * 4 * N9_ROWS)
    comptime for q in range(4):
        var v = l[q]
        v += shuffle_xor(v, 4)
        v += shuffle_xor(v, 8)
        l[q] = v + shuffle_xor(v, 16)
    if g == 0:
        comptime for q in range(4):
            xsum.unsafe_store(warp * N9_ROWS + row_of(q, t4), l[q])
    wg_barrier[BAR_N_SUM](wg)
    var inv = SIMD[DType.float32, 4](0)
    comptime for q in range(4):
        var r = row_of(q, t4)
        l[q] = (xsum.unsafe_load(r) + xsum.unsafe_load(N9_ROWS + r)) + (
            xsum.unsafe_load(2 * N9_ROWS + r) + xsum.unsafe_load(3 * N9_ROWS + r)
        )
        inv[q] = AttentionBlock.inverse_sum(l[q])
    var col0 = wg * 4 * 64 + 16 * warp + g
    store_tile(p, blk, acc0, col0, t4, inv)
    store_tile(p, blk, acc1, col0 + 64, t4, inv)
    store_tile(p, blk, acc2, col0 + 128, t4, inv)
    store_tile(p, blk, acc3, col0 + 192, t4, inv)
    if wg == 0 and warp == 0 and g == 0:
        comptime for q in range(4):
            blk.store_stats(p.att, blk.row0 + row_of(q, t4), m[q], l[q])
