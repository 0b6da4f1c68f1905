"""The TMA attention kernels' data movement (`attention_sm90.mojo`, `attention_narrow.mojo`): the block's
prologue (row masks, barriers, Q), the producer thread's copies of the key blocks (bf16 / f16 boxes, or
`fp8_ds_mla` rows into raw slots and the rope part), and the math warpgroups' widening of raw fp8
rows and zeroing of value rows outside a partition."""

from std.memory import bitcast
from std.sys._assembly import inlined_assembly

from max.gpu import barrier
from max.gpu.primitives.warp import vote

from ..common import U32Ptr
from .attention_block import AttentionBlock, AttentionParams, SPtr, dequantize8, fence_async_proxy, opaque
from .hopper import arrive_expect_tx, mbar_wait, mbar_wait_u32, smem_u32, tma_load_box
from .tma_smem import (
    S9_BLOCK_BYTES,
    S9_BOXES,
    S9_BOX_BYTES,
    S9_BOX_COLS,
    S9_FP8_STAGES,
    S9_KEY_DIM,
    S9_MATH_THREADS,
    S9_RAW_BOXES,
    S9_RAW_BOX_BYTES,
    S9_ROPE_COL,
    S9_STAGES,
    S9_THREADS,
    S9_WG,
    KeyBlocks,
    SmemPlan,
    TmaAttentionParams,
    box_rows,
)

@always_inline
def produce_keys[
    dtype: DType, rows_: Int
](p: AttentionParams[dtype], desc: Int, blk: AttentionBlock, sm: SmemPlan[False, rows_], keys: KeyBlocks):
    """The producer thread: block `b`'s 9 column boxes into stage `b % 2` once the stage is released.

    A column box is `box_rows(page_size)` rows of one page; a 64-key block takes
    `64 / box_rows` of them per column box (one for pages of 64 keys or more),
    `keys.copies(b)` of them. `desc`: the
    generic address of the kernel parameter's TMA descriptor (taken in the
    kernel: a copy of the parameter would not be in parameter space).

    Every box's barrier is armed with the bytes of all its copies before the
    first copy of the block starts. Runtime loops and 32-bit key arithmetic:
    this thread runs on `S9_PRODUCER_REGS` registers.
    """
    var page_size = UInt32(p.cache.page_size)
    var rows = UInt32(box_rows(Int(p.cache.page_size)))
    var lookup = p.cache.lookup.unsafe_offset(blk.request * Int(p.cache.pages_per_request))
    var stage0 = smem_u32(sm.stage(0))
    var full0 = smem_u32(sm.full(0, 0))
    var empty0 = smem_u32(sm.empty(0))
    for b in range(keys.count()):
        var s = b % S9_STAGES
        # Phase parity: a fresh barrier passes parity 1 at once (the first use of a stage waits for nothing).
        mbar_wait_u32(empty0 + UInt32(8 * s), UInt32(((b // S9_STAGES) & 1) ^ 1))
        var k = UInt32(keys.start(b))
        var parts = keys.copies(b, rows)
        var dst = stage0 + UInt32(s * S9_BLOCK_BYTES)
        var full = full0 + UInt32(8 * S9_BOXES * s)
        for box in range(S9_BOXES):
            arrive_expect_tx(full + UInt32(8 * box), parts * rows * 128)
        for q in range(parts):
            var key = k + q * rows
            var page = UInt32(lookup.unsafe_load(Int(key // page_size)))
            var row = key % page_size
            var at = dst + q * rows * 128
            for box in range(S9_BOXES):
                tma_load_box(
                    at + UInt32(box * S9_BOX_BYTES), desc, full + UInt32(8 * box), UInt32(box * S9_BOX_COLS), row, page
                )


@always_inline
def produce_fp8_keys[
    dtype: DType, rows_: Int
](p: AttentionParams[dtype], descs: Tuple[Int, Int], blk: AttentionBlock, sm: SmemPlan[True, rows_], keys: KeyBlocks):
    """The producer thread on an `fp8_ds_mla` cache (module docstring, `fp8`).

    It keeps the raw slots `RAW_SLOTS` blocks ahead (`copy_raw_block`): block `b + RAW_SLOTS` goes
    into block `b`'s slot once both math warpgroups have widened it (`raw_empty`; `ROPE_IN_RAW`: and
    scored its rope box, which came in the slot, so there is nothing else to copy). Else, per block, once
    the math warps release box 8 of the one stage (`empty`: the 64-row kernel after P V of the block
    before, which also read P from box 8; the narrow kernel after its scores), it copies the rope
    part into box 8 by TMA (`descs[0]`: the 128-byte boxes; the rows' bytes land in the layout of
    a bf16 box).
    """
    var cache = p.fp8.rows
    var page_size = UInt32(cache.page_size)
    var rows = UInt32(box_rows(Int(cache.page_size)))
    var lookup = cache.lookup.unsafe_offset(blk.request * Int(cache.pages_per_request))
    var count = keys.count()
    comptime SLOTS = SmemPlan[True, rows_].RAW_SLOTS
    for b in range(min(count, SLOTS)):
        copy_raw_block(descs, sm, b, lookup, page_size, rows, keys)
    comptime if SmemPlan[True, rows_].ROPE_IN_RAW:
        for b in range(count - SLOTS):
            mbar_wait(sm.raw_empty(b % SLOTS), (b // SLOTS) & 1)
            copy_raw_block(descs, sm, b + SLOTS, lookup, page_size, rows, keys)
        return
    var rope_box = smem_u32(sm.stage(0)) + UInt32((S9_BOXES - 1) * S9_BOX_BYTES)
    var rope_full = smem_u32(sm.full(0, S9_BOXES - 1))
    for b in range(count):
        var slot = b % SLOTS
        mbar_wait(sm.empty(0), ((b // S9_FP8_STAGES) & 1) ^ 1)
        var k = UInt32(keys.start(b))
        var parts = keys.copies(b, rows)
        arrive_expect_tx(rope_full, parts * rows * 128)
        for q in range(parts):
            var key = k + q * rows
            var page = UInt32(lookup.unsafe_load(Int(key // page_size)))
            tma_load_box(rope_box + q * rows * 128, descs[0], rope_full, UInt32(S9_ROPE_COL), key % page_size, page)
        if b + SLOTS < count:
            mbar_wait(sm.raw_empty(slot), (b // SLOTS) & 1)
            copy_raw_block(descs, sm, b + SLOTS, lookup, page_size, rows, keys)


@always_inline
def copy_raw_block[
    rows_: Int
](
    descs: Tuple[Int, Int], sm: SmemPlan[True, rows_], b: Int, lookup: U32Ptr, page_size: UInt32, rows: UInt32,
    keys: KeyBlocks,
):
    """One thread: block `b`'s `fp8_ds_mla` bytes into raw slot `b % RAW_SLOTS` by TMA (its latent boxes
    with `descs[0]`, its scales with `descs[1]`; `ROPE_IN_RAW`: its rope box too, with `descs[0]`), all on
    the slot's one transaction barrier."""
    comptime ROPE = SmemPlan[True, rows_].ROPE_IN_RAW
    var slot = b % SmemPlan[True, rows_].RAW_SLOTS
    var bar = smem_u32(sm.raw_full(slot))
    var dst = smem_u32(sm.raw(slot))
    var k = UInt32(keys.start(b))
    var parts = keys.copies(b, rows)
    comptime ROW_BYTES = S9_ROPE_COL + (128 if ROPE else 0)  # TMA bytes a key brings: latent, scales (rope)
    arrive_expect_tx(bar, parts * rows * UInt32(ROW_BYTES))
    var rope_dst = smem_u32(sm.rope(slot))
    for q in range(parts):
        var key = k + q * rows
        var page = UInt32(lookup.unsafe_load(Int(key // page_size)))
        var row = key % page_size
        for j in range(S9_RAW_BOXES):
            tma_load_box(dst + UInt32(j * S9_RAW_BOX_BYTES) + q * rows * 128, descs[0], bar, UInt32(j * 128), row, page)
        tma_load_box(
            dst + UInt32(S9_RAW_BOXES * S9_RAW_BOX_BYTES) + q * rows * 16, descs[1], bar, UInt32(S9_RAW_BOXES * 128), row, page
        )
        comptime if ROPE:
            tma_load_box(rope_dst + q * rows * 128, descs[0], bar, UInt32(S9_ROPE_COL), row, page)


@always_inline
def pow2_multiplier(scale: Float32) -> UInt32:
    """`scale * 2^120` as bfloat16 bits in both halves of a word where `scale` is a power of two `2^k` with
    `-126 <= k <= 7` (every scale pymla's quantizer writes for latent values under 448 * 2^7:
    `pymla/cache_format.py`), else 0: `widen_pow2`'s factor."""
    var bits = bitcast[DType.uint32](scale)
    var e = bits >> 23  # the biased exponent of a positive scale
    if (bits & 0x807FFFFF) != 0 or e == 0 or e > 134:  # the power-of-two test of fp8.bf16_scale_shift, another range
        return 0
    var m = (e + 120) << 7
    return m | (m << 16)


@always_inline
def widen_pow2(e4m3: SIMD[DType.uint8, 8], mult: UInt32) -> SIMD[DType.bfloat16, 8]:
    """`dequantize8` for a power-of-two scale without conversion instructions (two values: one `prmt`, one
    shift, one `and`, one bfloat16 multiply; `dequantize8` takes six). An e4m3 byte `s eeee mmm` sign-extended
    to 16 bits (`prmt`'s sign mode), shifted left by 4 and masked to `s 0000eeee mmm0000` (the CPU's
    `fp8.widen_e4m3_bf16` moves the bits so too, then rebiases the exponent instead) is a bfloat16 of the
    value times `2^-120`, exactly (zero and subnormals too: a bfloat16 subnormal), and one bfloat16 multiply
    by `mult` (`pow2_multiplier`) gives the value times the scale, exactly as `dequantize8` (a value of 4
    significant bits times a power of two). NaN bytes read as 480 times the scale."""
    var w = bitcast[DType.uint32, 2](e4m3)
    var out = SIMD[DType.uint32, 4](0)
    comptime for i in range(4):
        # Bytes 2 (i % 2) and 2 (i % 2) + 1 of word i / 2, each sign-extended into a 16-bit half.
        var x = inlined_assembly["prmt.b32 $0, $1, 0, $2;", UInt32, constraints="=r,r,r"](
            w[i // 2], UInt32(0x9180 + 0x2222 * (i % 2))
        )
        out[i] = inlined_assembly["mul.rn.bf16x2 $0, $1, $2;", UInt32, constraints="=r,r,r"]((x << 4) & 0x87F087F0, mult)
    return bitcast[DType.bfloat16, 8](out)


@always_inline
def widen_raw_rows[
    rows_: Int, //, dtype: DType, key_rows: Int, raw_boxes: Int, try_pow2: Bool
](sm: SmemPlan[True, rows_], slot: Int, row0: Int, jb0: Int, wt: Int):
    """One math warpgroup's thread `wt`: the latent bytes of keys `row0 ..< row0 + key_rows` in raw boxes
    `jb0 ..< jb0 + raw_boxes` of raw slot `slot` times their scales into bf16 boxes `2 jb0 ..` of the stage,
    in the 128-byte swizzle of both: with `try_pow2`, `widen_pow2` where every scale of the warp's rows of
    a raw box is a power of two it serves (a warp-uniform branch), else `dequantize8`. (H100, 2026-12-07:
    the narrow kernel's whole op on fp8 rows 1.5-2% faster with it at 16 heads; the 64-row kernel's 7%
    slower at 128 h b64 8k, where the widening runs between its products.) The thread takes 16-byte output
    chunk `wt % 8` of rows `row0 + wt / 8 + 16 i` of each box."""
    comptime ROWS_PER_THREAD = key_rows * 8 // S9_WG  # 16-byte chunks of a box per thread
    var raw = sm.raw(slot)
    var scales = raw.unsafe_offset(S9_RAW_BOXES * S9_RAW_BOX_BYTES).unsafe_bitcast[Float32]()
    var c = wt % 8
    var r0 = row0 + wt // 8
    var swz = r0 % 8  # the rows r0 + 16 i share it
    comptime for jbi in range(raw_boxes):
        var jb = jb0 + jbi
        var sc = SIMD[DType.float32, ROWS_PER_THREAD](0)
        comptime for i in range(ROWS_PER_THREAD):
            sc[i] = scales.unsafe_load((r0 + 16 * i) * 4 + jb)
        # Every load of the box before the first store: a store may alias the next load for the
        # compiler, which would otherwise wait for each chunk's load, widening and store in turn.
        var bytes = SIMD[DType.uint8, 16 * ROWS_PER_THREAD](0)
        comptime for half in range(2):
            comptime for i in range(ROWS_PER_THREAD):
                var r = r0 + 16 * i
                var src = raw.unsafe_offset(jb * S9_RAW_BOX_BYTES + r * 128 + (((half * 4 + c // 2) ^ swz) * 16) + (c % 2) * 8)
                bytes = bytes.insert[offset = 8 * (half * ROWS_PER_THREAD + i)](src.unsafe_load[width=8, alignment=8](0))
        var args = WidenedBox[ROWS_PER_THREAD](sm.stage(0), jb, r0, c, swz)
        comptime if try_pow2 and dtype == DType.bfloat16:
            var pow2 = True
            comptime for i in range(ROWS_PER_THREAD):
                pow2 = pow2 and pow2_multiplier(sc[i]) != 0
            if vote[DType.uint32](pow2) == UInt32(0xFFFFFFFF):  # every lane's rows: a warp-uniform branch
                args.store[dtype, True](bytes, sc)
            else:
                args.store[dtype, False, fenced=True](bytes, sc)
        else:
            args.store[dtype, False](bytes, sc)


@fieldwise_init
struct WidenedBox[rows: Int](TrivialRegisterPassable):
    """Where `widen_raw_rows`' thread stores raw box `jb`'s two bf16 boxes: 16-byte chunk `c` of rows
    `r0 + 16 i` (swizzle `swz`) of stage 0."""

    var stage: SPtr[UInt8]
    var jb: Int
    var r0: Int
    var c: Int
    var swz: Int

    @always_inline
    def store[
        dtype: DType, pow2: Bool, fenced: Bool = False
    ](self, bytes: SIMD[DType.uint8, 16 * Self.rows], sc: SIMD[DType.float32, Self.rows]):
        """The loaded bytes (`8 (half rows + i)`: half `half` of row `i`) widened, `widen_pow2` with `pow2`
        (every scale `sc` one it serves); `fenced`: `dequantize8` behind the `widen_pow2` branch."""
        comptime for half in range(2):
            var box = 2 * self.jb + half
            comptime for i in range(Self.rows):
                var raw8 = bytes.slice[8, offset = 8 * (half * Self.rows + i)]()
                var v: SIMD[dtype, 8]
                comptime if pow2:
                    v = rebind[SIMD[dtype, 8]](widen_pow2(raw8, pow2_multiplier(sc[i])))
                elif fenced:
                    # The bytes through an `asm volatile` move: else the optimizer hoists this path's conversions
                    # above the branch, onto the `widen_pow2` path too.
                    var word = UInt64(opaque(Int(bitcast[DType.uint64, 1](raw8))))
                    v = dequantize8[dtype](bitcast[DType.uint8, 8](word), sc[i])
                else:
                    v = dequantize8[dtype](raw8, sc[i])
                self.stage.unsafe_offset(box * S9_BOX_BYTES + (self.r0 + 16 * i) * 128 + ((self.c ^ self.swz) * 16)).unsafe_bitcast[
                    Scalar[dtype]
                ]().unsafe_store[alignment=16](0, v)


@always_inline
def load_q[
    dtype: DType, fp8: Bool, rows: Int, //
](p: AttentionParams[dtype], blk: AttentionBlock, sm: SmemPlan[fp8, rows], tid: Int):
    """Q rows of the block into `q_s` in dtype (exact: q_full holds dtype values), zeros past the request's rows:
    box `c / 8` of `rows` rows x 128 bytes, swizzled."""
    comptime CHUNKS = S9_KEY_DIM // 8  # 16-byte chunks per row
    var v = tid
    while v < rows * CHUNKS:
        var r = v // CHUNKS
        var c = v % CHUNKS
        var x = SIMD[DType.float32, 8](0)
        if blk.row0 + r < blk.row_end:
            x = p.q_full.unsafe_offset((blk.row0 + r) * S9_KEY_DIM + c * 8).unsafe_load[width=8, alignment=16](0)
        var at = (c // 8) * SmemPlan[fp8, rows].Q_BOX_BYTES + r * 128 + (((c % 8) ^ (r % 8)) * 16)
        sm.base.unsafe_offset(at).unsafe_bitcast[Scalar[dtype]]().unsafe_store[alignment=16](0, x.cast[dtype]())
        v += S9_THREADS


@always_inline
def zero_outside_values[
    fp8: Bool, rows: Int, //, key_rows: Int, boxes: Int
](sm: SmemPlan[fp8, rows], keys: KeyBlocks, b: Int, s: Int, row0: Int, box0: Int, wt: Int):
    """Zeros the value rows of block `b`'s keys outside `[lo, hi)` in stage `s`: one warpgroup's thread
    `wt`, rows `row0 ..< row0 + key_rows` of boxes `box0 ..< box0 + boxes`."""
    var k0 = keys.start(b)
    comptime CHUNKS = boxes * 8  # 16-byte chunks of a row's columns in those boxes
    var v = wt
    while v < key_rows * CHUNKS:
        var r = row0 + v // CHUNKS
        var c = v % CHUNKS
        var key = k0 + r
        if key < keys.lo or key >= keys.hi:
            var at = (box0 + c // 8) * S9_BOX_BYTES + r * 128 + (c % 8) * 16
            sm.stage(s).unsafe_offset(at).unsafe_bitcast[UInt32]().unsafe_store[alignment=16](
                0, SIMD[DType.uint32, 4](0)
            )
        v += S9_WG


@always_inline
def start_block[
    dtype: DType, fp8: Bool, rows: Int, //
](p: TmaAttentionParams[dtype], blk: AttentionBlock, sm: SmemPlan[fp8, rows], tid: Int) -> KeyBlocks:
    """Every thread of a TMA kernel's block: the rows' masks, the barriers, Q; then (after a block barrier)
    the partition's keys any of the block's rows needs."""
    var masks = sm.masks()
    if tid < rows:
        masks.store(blk, p.att, tid)
    if tid == S9_MATH_THREADS:
        sm.init_barriers()
    load_q(p.att, blk, sm, tid)
    fence_async_proxy()
    barrier()
    return KeyBlocks.of(masks.key_span(blk, rows))


@always_inline
def produce[
    dtype: DType, fp8: Bool, rows: Int, //
](p: TmaAttentionParams[dtype], blk: AttentionBlock, sm: SmemPlan[fp8, rows], keys: KeyBlocks):
    """The producer thread of a TMA kernel: `produce_fp8_keys` or `produce_keys` (the descriptors' addresses
    in parameter space, `p` being the kernel's grid-constant parameter)."""
    comptime if fp8:
        produce_fp8_keys(
            p.att, (Int(Pointer(to=p.keys)), Int(Pointer(to=p.scales))), blk, rebind[SmemPlan[True, rows]](sm), keys
        )
    else:
        produce_keys(p.att, Int(Pointer(to=p.keys)), blk, rebind[SmemPlan[False, rows]](sm), keys)


