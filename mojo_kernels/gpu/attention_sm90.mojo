"""Step 5 on Hopper with TMA key blocks and a producer warpgroup (sm_90a), bf16 / f16 caches, and
`fp8_ds_mla` caches for bf16 ops (`fp8`: each math warpgroup widens its keys' rows of raw TMA slots
into the bf16 stage; see `S9_FP8_STAGES`).

Same contract as `attention_wgmma_kernel` (same `AttentionParams`, outputs
and rounding points: q_full holds dtype values, scores are dtype products
summed in float32, probabilities rounded to dtype for P V, float32 row sums).

Where the 2.8x of `attention_wgmma_kernel` goes (H200, 128 heads b64 8k:
717 us, 206 TFLOP/s, against FlashMLA's 250 us, 584 TFLOP/s; one block of
256 threads per SM, 255 registers; `benchmarks/results/h200-2026-12-03-wgmma/`,
`../h200-2026-12-03-final/gpu_variants.log`). Per 64-key tile the wgmma
kernel runs, one after the other: (1) `cp.async.wait_group 0` + a block
barrier for the tile copied one step ahead; (2) every one of the 256 math
threads issues 18 16-byte `cp.async` for the next tile and looks up the page
table (integer work and issue slots taken from the math; the ncu report of
the sibling `mma.sync` kernel, `gpu_ncu_attention.log`, shows the same
kernels latency-bound: 0.35 issued per cycle, ALU the busiest pipe, 65% of
cycles with no eligible warp); (3) scores as m64 n32 k16 wgmmas (n32: the Q
operand is re-read from shared memory per 32 keys, half the reuse of n64),
waited at once; (4) masks and the row max exchanged through shared memory
with a block barrier; (5) probabilities stored to a separate P tile, another
barrier; (6) P V, waited at once. The tensor cores idle through (1), (2),
(4) and (5), and the copy of the next tile is only one step ahead (at 16
heads, memory-bound: 1.73 TB/s against FlashMLA's 4.09). FlashMLA
(`csrc/sm90/decode/dense`, its 2025-04-22 deep dive) instead: keys arrive
by TMA in 64 x 64 sub-tiles, each with its own transaction barrier, so the
score GEMM starts on the first sub-tile; one thread issues the copies; each
step takes two 64-key blocks, warpgroup w computing the scores of block w
with n = 64, the two warpgroups splitting the 512 value columns; and the
"seesaw" offsets the two warpgroups by half a step so one's softmax runs
under the other's GEMMs.

This kernel takes the first three of those (the biggest expected wins):

* Block = 64 packed (token, head) rows of one request (rows past the
  request's are zeros: 16 heads use it too) and three warpgroups: two math
  warpgroups (`S9_MATH_THREADS`) and a producer warpgroup whose first
  thread issues every copy (`KeyProducer`); the producer gives its
  registers to the math warpgroups (`setmaxnreg`).
* Keys in 64-key blocks aligned to 64 cache slots, the cache viewed as
  `[pages, page_size, key_dim]`: with pages of 64 keys or more a block lies
  in one page and each of its 9 column boxes (64 keys x 64 columns, 128-byte
  swizzle) is one TMA copy; smaller pages (8, 16, 32) take 64 / page_size
  copies per column box. Each column box completes its own mbarrier
  (`full`). Two stages (shared memory: Q 72 KiB + 2 x 72 KiB).
* Block b sits in stage b % 2, so the producer copies block b + 1 while the
  math warpgroups work on block b. Both warpgroups share the block: warpgroup
  w scores keys 32w..32w+31 (`S = Q K^T`, m64 n32 k16, started as each box
  lands, from `score_init`); the scale; the row max exchanged with the other
  warpgroup (one named barrier); its probabilities rounded to dtype into its
  32 columns of box 8 (the rope columns, which P V does not read); a second
  named barrier; then `O_w = O_w corr + P V[:, w]` over all 64 keys
  (m64 n256 k16, V read MN-major from boxes 4w..4w+3), and the stage is
  released to the producer (`empty`).
* Masks and ALiBi are in the scores' starting values (`score_init`: -inf
  outside a row's keys, else ALiBi's term over the scale), built while the
  block before runs P V, so only the scale follows the products, folded into
  each probability's one fused multiply-add (`exp2(s scale log2 e - m log2 e)`,
  the row max taken on the unscaled scores). Keys outside
  the block's span (the first and last blocks of a partition) have their rows
  zeroed in every box before the scores (a stale row could hold NaN, and
  `NaN - inf` is NaN; each warpgroup zeros the rows of its 32 keys).

FlashMLA's "seesaw" schedule (the warpgroups own alternate blocks and trade
the softmax rescale, one's softmax under the other's wgmmas) was written for
this kernel and measured 5-10% slower on an H100 (2026-12-05, branch
`sm90-seesaw`, README): not taken. The shared memory plan, the parameters and
the producer live in `tma_smem.mojo` and `tma_producer.mojo` (shared with
`attention_narrow.mojo`), the Hopper primitives in `hopper.mojo`.

Shared memory (1024-byte aligned: the swizzle atoms): `q_s` 9 boxes of
[64 rows][64 columns] (128-byte swizzle: 16-byte chunk `c` of row `r` at
`r 128 + (c ^ r % 8) 16`), `k_s` two stages of 9 such boxes, then the
mbarriers, the row max / sum exchange and the row masks.
Accumulator fragments (m64nN, f32): warp `v` of a warpgroup, lane `4 g + t`,
element `4 j + e` is row `16 v + g + 8 (e / 2)`, column `8 j + 2 t + e % 2`.
"""

from std.math import exp2
from std.sys import size_of
from std.utils import StaticTuple
from std.utils.numerics import neg_inf

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, WARP_SIZE, thread_idx
from max.gpu.compute.mma import (
    wgmma_async,
    wgmma_commit_group_sync,
    wgmma_fence_aligned,
    wgmma_wait_group_sync,
)
from max.gpu.memory import AddressSpace, external_memory
from max.gpu.intrinsics import warpgroup_reg_alloc, warpgroup_reg_dealloc
from max.gpu.primitives.warp import shuffle_idx
from max.gpu.sync import mbarrier_arrive, named_barrier

from ..fp8 import Divisor, activation_scale, e4m3_as_f16
from .attention_block import AttentionBlock, AttentionParams, fence_async_proxy, rescale_row
from .attention_wgmma import quad_max, rows_of_both
from .hopper import Sw128, mbar_wait, smem_u32
from .pdl import allow_dependents, wait_for_producers
from .tma_producer import produce, start_block, widen_raw_rows, zero_outside_values
from .tma_smem import (
    S9_BLOCK_BYTES,
    S9_BOXES,
    S9_BOX_BYTES,
    S9_BOX_COLS,
    S9_FP8_STAGES,
    S9_KEYS,
    S9_KEY_DIM,
    S9_MATH_THREADS,
    S9_RAW_BOXES,
    S9_RAW_SLOTS,
    S9_ROWS,
    S9_STAGES,
    S9_THREADS,
    S9_VALUE_COLS,
    S9_WG,
    SmemPlan,
    TmaAttentionParams,
    wg_barrier,
)

# Registers per thread at launch: ptxas gives a kernel with `setmaxnreg` the most that `.maxntid`
# allows (65536 / 384, rounded down to 8: 168), and the block's register pool is that many per
# thread, not the 65536 of the SM. `setmaxnreg.inc` waits until the pool holds what it asks for,
# so the math warpgroups' increase must fit in what the producer releases (128 x 48 + 256 x 232
# = 65536 > 384 x 168 = 64512 hung every block on the H200, 2026-12-05). CUTLASS's split: 40 / 232.
comptime S9_LAUNCH_REGS = (65536 // S9_THREADS) // 8 * 8
comptime S9_PRODUCER_REGS = 40
comptime S9_MATH_REGS = 232
comptime LOG2E = Float32(1.4426950408889634)
comptime S9_QUANT_BLOCK = 128  # step 6's K block the epilogue quantizes rows in (`TmaAttentionParams.quant`)
# Named barriers of the two math warpgroups (0 is `barrier()`).
comptime BAR_MAX = 1
comptime BAR_P = 2
comptime BAR_SUM = 3
comptime BAR_WIDEN: Int32 = 4  # fp8, + the math warpgroup: its threads done widening its rows of a block
comptime BAR_ZERO: Int32 = 6  # + the math warpgroup: its threads done zeroing its keys' stale rows


def sm90_supported[dtype: DType](key_dim: Int, kv_lora_rank: Int, page_size: Int) -> Bool:
    """Whether `attention_sm90_kernel` handles these sizes.

    Pages: a multiple of 64 keys (a 64-key block in one page, one box), or a
    divisor of 64 of at least 8 rows (a box lands 1024-byte aligned, as the
    128-byte swizzle needs).
    """
    comptime if dtype != DType.bfloat16 and dtype != DType.float16:
        return False
    var pages_ok = page_size > 0 and (page_size % S9_KEYS == 0 or (page_size % 8 == 0 and S9_KEYS % page_size == 0))
    return key_dim == S9_KEY_DIM and kv_lora_rank == 2 * S9_VALUE_COLS and pages_ok


def attention_sm90_smem_bytes[fp8: Bool = False]() -> Int:
    """Dynamic shared memory of `attention_sm90_kernel`: Q, the key stages (`fp8`: one, and the raw slots),
    barriers, row tables."""
    return SmemPlan[fp8].END


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(S9_THREADS)))
@__llvm_arg_metadata(p, `nvvm.grid_constant`)
def attention_sm90_kernel[dtype: DType, fp8: Bool = False](p: TmaAttentionParams[dtype]):
    """One block per (request, 64 rows, key partition); see the module docstring (`fp8`: the keys are
    `p.att.fp8`'s `fp8_ds_mla` rows, `TmaAttentionParams.create_fp8`).

    Grid `attention_grid` (a row slot or a task of the split schedule per block), block `S9_THREADS`
    threads, `attention_sm90_smem_bytes[fp8]()` bytes of dynamic shared memory.
    """
    comptime HALF = S9_KEYS // 2  # keys scored per warpgroup
    comptime NJ_S = HALF // 8  # score n-tiles per thread
    comptime NJ_O = S9_VALUE_COLS // 8  # value n-tiles per thread
    comptime ACC_W = S9_ROWS * S9_VALUE_COLS // S9_WG
    comptime ESZ = size_of[dtype]()
    comptime assert ESZ == 2, "bf16 / f16 boxes: 64 columns = 128 bytes"
    comptime STAGES = S9_FP8_STAGES if fp8 else S9_STAGES
    comptime assert not fp8 or dtype == DType.bfloat16, "fp8_ds_mla rows serve bfloat16 ops"
    comptime assert (
        S9_WG * S9_PRODUCER_REGS + S9_MATH_THREADS * S9_MATH_REGS <= S9_THREADS * S9_LAUNCH_REGS
    ), "setmaxnreg: the math warpgroups' registers must come from the producer's (else setmaxnreg.inc waits forever)"

    # With PDL (pdl.mojo) every thread waits for the q step (q_full, the new cache rows) at once,
    # before the role split: the producer's TMA copies and load_q read what it wrote.
    wait_for_producers()
    var tid = thread_idx.x
    var blk = AttentionBlock.locate[S9_ROWS](p.att)
    if not blk.has_rows():
        return
    var sm = SmemPlan[fp8](external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=1024]())
    var masks = sm.masks()
    var keys = start_block(p, blk, sm, tid)

    # From lane 0 (`shuffle_idx`): ptxas then knows that every lane of the warp holds the same value, so the
    # wgmma descriptors derived from it (and from `st` below) are built in uniform registers instead of being
    # moved there before every wgmma (2 R2UR each: 98 of the loop's 802 instructions a block at 128 heads).
    var wg = Int(shuffle_idx(UInt32(tid // S9_WG), 0))
    if wg == 2:
        warpgroup_reg_dealloc[S9_PRODUCER_REGS]()
        if tid == S9_MATH_THREADS:
            produce(p, blk, sm, keys)
        return
    warpgroup_reg_alloc[S9_MATH_REGS]()

    var wt = tid % S9_WG
    var warp = wt // WARP_SIZE
    var lane = tid % WARP_SIZE
    var g = lane // 4
    var t4 = lane % 4
    var ra = 16 * warp + g
    var rb = ra + 8
    # This thread's two rows: their keys `[lo, hi)` within the partition's span, position, slope (32-bit: registers).
    var lo_a = max(masks.lo.unsafe_load(ra), Int32(keys.lo))
    var hi_a = min(masks.hi.unsafe_load(ra), Int32(keys.hi))
    var pos_a = Float32(masks.pos.unsafe_load(ra))
    var slope_a = masks.slope.unsafe_load(ra)
    var lo_b = max(masks.lo.unsafe_load(rb), Int32(keys.lo))
    var hi_b = min(masks.hi.unsafe_load(rb), Int32(keys.hi))
    var pos_b = Float32(masks.pos.unsafe_load(rb))
    var slope_b = masks.slope.unsafe_load(rb)
    var scale = p.att.scale
    var scale_log2e = scale * LOG2E
    # The scores start from `score_init`: 0 or -inf (the masks) plus ALiBi's term over the scale, so
    # that after the products only the scale remains to apply (in the probabilities' FFMA).
    var slope_sa = slope_a / scale
    var slope_sb = slope_b / scale
    var xmax_s = sm.xmax()
    var q_u = sm.q_u32()
    var stage0_u = smem_u32(sm.stage(0))

    var m_a = neg_inf[DType.float32]()
    var m_b = neg_inf[DType.float32]()
    var l_a = Float32(0)
    var l_b = Float32(0)
    var acc = SIMD[DType.float32, ACC_W](0)

    @always_inline
    @parameter
    def score_init(k0: Int) -> SIMD[DType.float32, NJ_S * 4]:
        """The accumulators the scores of the warpgroup's keys from `k0` start from: `-inf` outside the
        row's keys, else ALiBi's `-slope (pos - key)` over the scale (0 without ALiBi, exactly)."""
        var init = SIMD[DType.float32, NJ_S * 4](0)
        var key0 = Int32(k0) + 2 * Int32(t4)
        comptime for j in range(NJ_S):
            comptime for e in range(4):
                var key = key0 + Int32(8 * j + e % 2)
                var x: Float32
                comptime if e < 2:
                    x = -slope_sa * (pos_a - Float32(key)) if key >= lo_a and key < hi_a else neg_inf[DType.float32]()
                else:
                    x = -slope_sb * (pos_b - Float32(key)) if key >= lo_b and key < hi_b else neg_inf[DType.float32]()
                init[4 * j + e] = x
        return init

    var s = score_init(keys.start(0) + wg * HALF)
    for b in range(keys.count()):
        var st = Int(shuffle_idx(UInt32(b % STAGES), 0))  # warp-uniform for ptxas, as `wg`
        var phase = (b // STAGES) & 1
        comptime if fp8:
            # Its keys' rows widened into the stage once both warpgroups' P V of the block before is done.
            var slot = b % S9_RAW_SLOTS
            mbar_wait(sm.empty(0), (b & 1) ^ 1)
            mbar_wait(sm.raw_full(slot), (b // S9_RAW_SLOTS) & 1)
            widen_raw_rows[dtype, S9_KEYS // 2, S9_RAW_BOXES, False](rebind[SmemPlan[True]](sm), slot, wg * (S9_KEYS // 2), 0, wt)
            fence_async_proxy()
            wg_barrier[BAR_WIDEN](wg)
            if lane == 0:
                _ = mbarrier_arrive(sm.raw_empty(slot))

        if keys.partial(b):
            # Rows outside the partition's keys may hold any bits (NaN): zeroed in every box before the
            # scores, whose -inf start then stays -inf (and P V reads zeros there).
            comptime for box in range(S9_BOXES):
                comptime if not fp8 or box == S9_BOXES - 1:  # fp8: boxes 0-7 widened above
                    mbar_wait(sm.full(st, box), phase)
            zero_outside_values[S9_KEYS // 2, S9_BOXES](sm, keys, b, st, wg * HALF, 0, wt)
            fence_async_proxy()
            wg_barrier[BAR_ZERO](wg)

        # S = Q K^T + init on this warpgroup's 32 keys (rows 32 wg.. of every box), each box started as it lands.
        var stage_u = stage0_u + UInt32(st * S9_BLOCK_BYTES)
        var q_d = Sw128[dtype, 16, 1024].of(q_u)
        var k_d = Sw128[dtype, 16, 1024].of(stage_u + UInt32(wg * HALF * 128))
        comptime for box in range(S9_BOXES):
            comptime if not fp8 or box == S9_BOXES - 1:  # fp8: boxes 0-7 widened above
                mbar_wait(sm.full(st, box), phase)
            # A fence after every wait: ptxas takes the wait's spin loop for a divergent path and,
            # without one, serializes every wgmma of the kernel (C7520).
            wgmma_fence_aligned()
            comptime for kk in range(S9_BOX_COLS // 16):
                comptime off = box * S9_BOX_BYTES + kk * 32
                s = wgmma_async[64, HALF, 16, DType.float32, NJ_S * 4, a_type=dtype, b_type=dtype, layout_b="col"](
                    q_d.at(off), k_d.at(off), s
                )
        wgmma_commit_group_sync()
        wgmma_wait_group_sync[0]()

        # This warpgroup's row maxima of the scaled scores (the scale > 0: the max of the scaled scores is the
        # scaled max, rounding being monotonic), exchanged with the other's.
        var mx_a = neg_inf[DType.float32]()
        var mx_b = neg_inf[DType.float32]()
        comptime for j in range(NJ_S):
            comptime for e in range(4):
                comptime if e < 2:
                    mx_a = max(mx_a, s[4 * j + e])
                else:
                    mx_b = max(mx_b, s[4 * j + e])
        var mx = rows_of_both[True, S9_ROWS, BAR_MAX, S9_MATH_THREADS](
            xmax_s, wg, t4, ra, rb, mx_a * scale, mx_b * scale
        )
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

        # Probabilities: float32 row sums, dtype values into this warpgroup's 32 columns of box 8
        # (K-major, swizzled: 16-byte chunk 4 wg + j of the row).
        var ps_a = Float32(0)
        var ps_b = Float32(0)
        var p_box = sm.stage(st).unsafe_offset((S9_BOXES - 1) * S9_BOX_BYTES)
        # exp(s scale - m) as 2^(s (scale log2 e) - m log2 e): one fused multiply-add a score.
        var shl_a = sh_a * LOG2E
        var shl_b = sh_b * LOG2E
        comptime for j in range(NJ_S):
            var pa = exp2(SIMD[DType.float32, 2](s[4 * j], s[4 * j + 1]).fma(scale_log2e, -shl_a))
            var pb = exp2(SIMD[DType.float32, 2](s[4 * j + 2], s[4 * j + 3]).fma(scale_log2e, -shl_b))
            ps_a += pa.reduce_add()
            ps_b += pb.reduce_add()
            var chunk = (HALF // 8) * wg + j
            var at_a = ra * 128 + ((chunk ^ (ra % 8)) * 16) + 4 * t4
            var at_b = rb * 128 + ((chunk ^ (rb % 8)) * 16) + 4 * t4
            p_box.unsafe_offset(at_a).unsafe_bitcast[Scalar[dtype]]().unsafe_store[alignment=4](0, pa.cast[dtype]())
            p_box.unsafe_offset(at_b).unsafe_bitcast[Scalar[dtype]]().unsafe_store[alignment=4](0, pb.cast[dtype]())
        l_a = l_a * corr_a + ps_a
        l_b = l_b * corr_b + ps_b
        fence_async_proxy()
        named_barrier[S9_MATH_THREADS](BAR_P)  # both halves of P written

        # O = O corr + P V on this warpgroup's 256 value columns (boxes 4 wg .. 4 wg + 3), all 64 keys.
        comptime for j in range(NJ_O):
            acc[4 * j] *= corr_a
            acc[4 * j + 1] *= corr_a
            acc[4 * j + 2] *= corr_b
            acc[4 * j + 3] *= corr_b
        wgmma_fence_aligned()
        var p_d = Sw128[dtype, 16, 1024].of(stage_u + UInt32((S9_BOXES - 1) * S9_BOX_BYTES))
        var v_d = Sw128[dtype, S9_BOX_BYTES, 1024].of(stage_u + UInt32(4 * wg * S9_BOX_BYTES))
        comptime for kk in range(S9_KEYS // 16):
            acc = wgmma_async[64, S9_VALUE_COLS, 16, DType.float32, ACC_W, a_type=dtype, b_type=dtype, layout_b="row"](
                p_d.at(kk * 32), v_d.at(kk * 16 * 128), acc
            )
        wgmma_commit_group_sync()
        s = score_init(keys.start(b + 1) + wg * HALF)  # the next block's, under P V
        wgmma_wait_group_sync[0]()
        if lane == 0:
            _ = mbarrier_arrive(sm.empty(st))

    # The key loop is done: the merge may be scheduled (pdl.mojo), as late as this so that its blocks
    # never wait on SMs this kernel's blocks still need (the producer warpgroup has exited).
    allow_dependents()
    # Row sums: this thread's quad, then both warpgroups.
    var sums = rows_of_both[False, S9_ROWS, BAR_SUM, S9_MATH_THREADS](sm.xsum(), wg, t4, ra, rb, l_a, l_b)
    l_a = sums[0]
    l_b = sums[1]
    if blk.normalized and p.quant.active != 0:
        store_quantized_rows[ACC_W, NJ_O](p, blk, acc, wg, t4, ra, l_a)
        store_quantized_rows[ACC_W, NJ_O](p, blk, acc, wg, t4, rb, l_b, second=True)
    else:
        store_rows[ACC_W, NJ_O](p.att, blk, acc, wg * S9_VALUE_COLS + 2 * t4, ra, m_a, l_a)
        store_rows[ACC_W, NJ_O](p.att, blk, acc, wg * S9_VALUE_COLS + 2 * t4, rb, m_b, l_b, second=True)
    if wg == 0 and t4 == 0:
        blk.store_stats(p.att, blk.row0 + ra, m_a, l_a)
        blk.store_stats(p.att, blk.row0 + rb, m_b, l_b)


@always_inline
def store_rows[
    dtype: DType, //, acc_w: Int, nj: Int
](
    p: AttentionParams[dtype], blk: AttentionBlock, acc: SIMD[DType.float32, acc_w], col0: Int, r: Int, m: Float32,
    l: Float32, second: Bool = False,
):
    """Block row `r`'s part of the accumulator (elements `4 j + 2 second + {0, 1}`, columns `col0 + 8 j`)
    into `raw` (one partition: normalized, in dtype) or this partition's `part_out`."""
    var row = blk.row0 + r
    if row >= blk.row_end:
        return
    var out = blk.result_row(p, row)
    var inv = AttentionBlock.inverse_sum(l)
    var e0 = 2 if second else 0
    comptime for j in range(nj):
        var v = SIMD[DType.float32, 2](acc[4 * j + e0], acc[4 * j + e0 + 1])
        out.unsafe_offset(col0 + 8 * j).unsafe_store[alignment=8](0, blk.result[dtype, 2](v, inv))


@always_inline
def store_quantized_rows[
    dtype: DType, //, acc_w: Int, nj: Int
](
    p: TmaAttentionParams[dtype], blk: AttentionBlock, acc: SIMD[DType.float32, acc_w], wg: Int, t4: Int, r: Int,
    l: Float32, second: Bool = False,
):
    """Block row `r`'s 256 columns of warpgroup `wg`, normalized (`blk.result`), quantized for step 6 as
    `merge.quantize_row` quantizes a merged row, bit for bit: per K block of S9_QUANT_BLOCK columns
    `s = activation_scale(amax)`, the values `e4m3(x / s)` as float16 into `p.quant`; with
    `has_attention_output` the row as dtype too. A quad holds 256 contiguous columns of the row
    (elements `4 j + 2 second + {0, 1}`, columns `8 j + 2 t4`), so a block's amax is a quad max."""
    comptime J_PER_BLOCK = S9_QUANT_BLOCK // 8
    var row = blk.row0 + r
    var live = row < blk.row_end  # every lane of the quad agrees (one row): the quad max runs on all
    var rank = Int(p.att.kv_lora_rank)
    var inv = AttentionBlock.inverse_sum(l)
    var e0 = 2 if second else 0
    comptime for kb in range(nj // J_PER_BLOCK):
        var vals = SIMD[DType.float32, 2 * J_PER_BLOCK](0)
        comptime for jj in range(J_PER_BLOCK):
            comptime j = kb * J_PER_BLOCK + jj
            var v = blk.result[dtype, 2](SIMD[DType.float32, 2](acc[4 * j + e0], acc[4 * j + e0 + 1]), inv)
            vals[2 * jj] = v[0]
            vals[2 * jj + 1] = v[1]
        var scale = activation_scale(quad_max(abs(vals).reduce_max()))
        var div = Divisor.of(scale)
        if live:
            var block = (wg * S9_VALUE_COLS) // S9_QUANT_BLOCK + kb
            if t4 == 0:
                p.quant.scales.unsafe_store(row * (rank // S9_QUANT_BLOCK) + block, scale)
            comptime for jj in range(J_PER_BLOCK):
                var col = wg * S9_VALUE_COLS + 8 * (kb * J_PER_BLOCK + jj) + 2 * t4
                var v = SIMD[DType.float32, 2](vals[2 * jj], vals[2 * jj + 1])
                p.quant.values.unsafe_offset(row * rank + col).unsafe_store[alignment=4](0, e4m3_as_f16[2](v, div))
                if p.has_attention_output != 0:
                    p.attention_output.unsafe_offset(row * rank + col).unsafe_store[alignment=2 * size_of[dtype]()](
                        0, v.cast[dtype]()
                    )
