"""Steps 3 and 6 on tensor cores: one block's tile of the fp8 block-scaled batched matmul.

`c[g, m, n] = rnd(sum_kb sa[g, m / bm, kb] sw[g, n / bn, kb] sum_{k in kb} aq[g, m, k] wq[g, n, k])`,
the formula of `pymla/quant.py` (`fp8_batched_matmul`): `aq` the activations
quantized dynamically (`s = amax / 448`, 1 when amax is 0, `aq = fp8(clamp(a / s))`,
bit for bit the rule of `quantize_kernel`), `wq` the fp8 e4m3 weights. A block owns
one (group `g`, tile of `MT` rows, tile of `NT` columns) and

1. `stage_weights`: starts a `cp.async` copy of its `NT` weight rows (fp8 bytes)
   and stages their scales, then
2. `stage_activations`: quantizes its `MT` activation rows once, into shared
   memory as float16 (every e4m3 value is exact in float16), with their scales;
3. `project_tile`: per K block, `mma.sync.m16n8k16` (f16 x f16, float32
   accumulation) sums the exact fp8 products of the block, then
   `acc += part * (sa * sw)`; the result is rounded to `value_dtype`.
   So it differs from the float32 FMA kernel (`fp8_matmul_kernel`) only in
   float32 summation order (each product of two e4m3 values is exact in float32).

Shared-memory layout: each K block is padded to a multiple of KCHUNK (64)
with zeros, so a 64-wide chunk never straddles two scale blocks; a weight row
is `kp` bytes, an activation row `kp` halves (plus padding against bank
conflicts). With `bk % 64 == 0` and `K % bk == 0` (the DeepSeek blockwise,
per-channel and per-tensor cases) the padded layout is the plain one and the
weights are copied with 16-byte `cp.async`; other block sizes take a byte loop.

Fragments: a lane `4 g + t` reads 16 consecutive fp8 weights (bytes
`16 t .. 16 t + 15` of a 64-chunk of row `g`) and the same 16 k of its
activation rows `g`, `g + 8`; k-step `j` of the chunk uses k `16 t + 4 j .. + 3`
as the mma's k `2t, 2t + 1, 2t + 8, 2t + 9`. A and B use the same permutation
of k, so the products summed are exactly those of the block (PTX `mma.m16n8k16`
layouts: A a0,a1 = (g, 2t..), a2,a3 = (g + 8, 2t..), a4,a5 = (g, 2t + 8..),
a6,a7 = (g + 8, 2t + 8..); B b0,b1 = (k 2t.., n g), b2,b3 = (k 2t + 8.., n g);
C c0,c1 = (g, 2t..2t+1), c2,c3 = (g + 8, 2t..2t+1)).
"""

from std.memory import bitcast
from std.sys import size_of

from max.gpu import WARP_SIZE, thread_idx
from max.gpu.compute.mma import mma
from max.gpu.memory import AddressSpace, async_copy, async_copy_commit_group
from max.gpu.primitives import warp

from ..common import ceil_div, ceil_div_u32, div_u32
from ..fp8 import Divisor, activation_scale, e4m3_as_f16
from ..spec import BlockShape
from .params import GFPtr, GlobalPtr, GPtr

comptime KCHUNK = 64  # k per 16-byte fp8 fragment load: 4 mma k-steps
comptime SEG_VECS = 4  # float32x4 registers per lane for one row's K block (K blocks up to 512)

comptime SPtr[dtype: DType] = Pointer[Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED]


@fieldwise_init
struct QuantizedRows(TrivialRegisterPassable):
    """Step 6's activations quantized by the merge: `values [T, H, R]` (e4m3 values as float16),
    `scales [T, H, R / block_k]`; `active` 0: not in use (the output step quantizes raw itself)."""

    var values: GPtr[DType.float16]
    var scales: GFPtr
    var block_k: Int32
    var heads: Int32
    var active: Int32

    @staticmethod
    def none(placeholder: GFPtr) -> Self:
        """Inactive: the output step quantizes its activations itself (`placeholder`, any device
        pointer, fills the pointer fields, which are never read)."""
        return Self(placeholder.unsafe_bitcast[Float16](), placeholder, 1, 1, 0)


@fieldwise_init
struct StridedRows[dtype: DType](TrivialRegisterPassable):
    """Rows `[G, M, K]` of a projection's input or output: element `(g, m, k)` at `ptr + g g_stride + m m_stride + k`."""

    var ptr: GPtr[Self.dtype]
    var g_stride: Int64
    var m_stride: Int64


@fieldwise_init
struct ScaleBlocks(TrivialRegisterPassable):
    """The resolved fp8 scale blocks of a projection: elements per scale along M, N and K."""

    var m: Int32  # bm
    var n: Int32  # bn
    var k: Int32  # bk

    @staticmethod
    def of(blocks: BlockShape) -> Self:
        return Self(Int32(blocks.m), Int32(blocks.n), Int32(blocks.k))


@fieldwise_init
struct Fp8Projection[in_dtype: DType, out_dtype: DType](TrivialRegisterPassable):
    """One batched fp8 projection `c[g, m, :] = fp8mm(a[g, m, :], w[g])` over groups (heads) `g`.

    `a [G, M, K]`, `w [G, N, K]` fp8 bytes, `w_scale [G, ceil(N / bn),
    ceil(K / bk)]`, `c [G, M, N]`; `rows` M, `n_out` N, `depth` K. A field of
    the kernels' parameter structs.
    """

    var a: StridedRows[Self.in_dtype]
    var w: GlobalPtr[UInt8]
    var w_scale: GFPtr
    var c: StridedRows[Self.out_dtype]
    var rows: Int32
    var n_out: Int32
    var depth: Int32
    var blocks: ScaleBlocks

    def tile_grid(self, mt: Int, nt: Int) -> Tuple[Int, Int, Int]:
        """(row tiles, column tiles, dynamic shared memory per block) in tiles of `mt` x `nt`."""
        var smem = TileLayout.create(Int(self.depth), Int(self.blocks.k)).smem_bytes(mt, nt)
        return (ceil_div(Int(self.rows), mt), ceil_div(Int(self.n_out), nt), smem)


@fieldwise_init
struct TileLayout(TrivialRegisterPassable):
    """Shared-memory geometry of one block's tile (the same on the host and the device)."""

    var k_blocks: Int  # scale blocks along K
    var block_kp: Int  # padded K block: a multiple of KCHUNK
    var kp: Int  # padded K: k_blocks * block_kp
    var a_stride: Int  # halves per activation row
    var w_stride: Int  # bytes per weight row
    var fast_weights: Bool  # the padded layout is the plain one: 16-byte cp.async copies

    @staticmethod
    def create(depth: Int, block_k: Int) -> Self:
        var kb = ceil_div_u32(depth, block_k)
        var bkp = ceil_div(block_k, KCHUNK) * KCHUNK
        var kp = kb * bkp
        # Row strides that keep the 16-byte fragment loads of 8 lanes on distinct banks:
        # activation rows 16 bytes past a multiple of 128, weight rows 64 bytes past one.
        var a_stride = kp + 8
        var w_stride = kp + (64 if kp % 128 == 0 else 0)
        return Self(kb, bkp, kp, a_stride, w_stride, block_k % KCHUNK == 0 and depth == div_u32(depth, block_k) * block_k)

    def a_bytes(self, mt: Int) -> Int:
        return ceil_div(mt * self.a_stride * 2, 16) * 16

    def w_bytes(self, nt: Int) -> Int:
        return ceil_div(nt * self.w_stride, 16) * 16

    def smem_bytes(self, mt: Int, nt: Int) -> Int:
        """Dynamic shared memory of a block: activation and weight tiles, then their scales."""
        return self.a_bytes(mt) + self.w_bytes(nt) + ceil_div((mt + nt) * self.k_blocks * 4, 16) * 16


@fieldwise_init
struct TileSmem(TrivialRegisterPassable):
    """A block's shared-memory regions (`TileLayout.smem_bytes` bytes from `base`)."""

    var a_s: SPtr[DType.float16]  # [mt][a_stride] quantized activations
    var w_s: SPtr[DType.uint8]  # [nt][w_stride] fp8 weights
    var sa_s: SPtr[DType.float32]  # [mt][k_blocks]
    var sw_s: SPtr[DType.float32]  # [nt][k_blocks]

    @staticmethod
    def carve(base: SPtr[DType.uint8], lay: TileLayout, mt: Int, nt: Int) -> Self:
        var off = lay.a_bytes(mt)
        var w_s = base.unsafe_offset(off)
        off += lay.w_bytes(nt)
        var sa_s = base.unsafe_offset(off).unsafe_bitcast[Float32]()
        return Self(
            base.unsafe_bitcast[Float16](), w_s, sa_s, sa_s.unsafe_offset(mt * lay.k_blocks)
        )


@always_inline
def copy_rows_16b[
    threads: Int
](src: GlobalPtr[UInt8], src_stride: Int, dst: SPtr[DType.uint8], dst_stride: Int, rows: Int, vecs: Int):
    """Starts `cp.async` copies of `rows` rows of `vecs` 16-byte vectors, `src_stride` bytes apart in
    global memory, into shared rows `dst_stride` bytes apart (16-byte aligned). Where the block's
    threads split evenly over a row's vectors, a thread keeps one vector column and steps down the
    rows by pointer increments (one division per thread, not two per vector)."""
    var tid = thread_idx.x
    if vecs > 0 and threads % vecs == 0:
        var step = div_u32(threads, vecs)
        var r = div_u32(tid, vecs)
        var col = 16 * (tid - r * vecs)
        var from_ = src.unsafe_offset(r * src_stride + col)
        var to = dst.unsafe_offset(r * dst_stride + col)
        while r < rows:
            async_copy[16](from_, to)
            from_ = from_.unsafe_offset(step * src_stride)
            to = to.unsafe_offset(step * dst_stride)
            r += step
        return
    for i in range(tid, rows * vecs, threads):
        var r = div_u32(i, vecs)
        var v = i - r * vecs
        async_copy[16](src.unsafe_offset(r * src_stride + 16 * v), dst.unsafe_offset(r * dst_stride + 16 * v))


@always_inline
def stage_weights[
    in_dtype: DType, out_dtype: DType, threads: Int
](p: Fp8Projection[in_dtype, out_dtype], lay: TileLayout, sm: TileSmem, g: Int, n0: Int, nt: Int):
    """Starts the copy of weight rows `n0 .. n0 + nt` of group `g` into `sm.w_s`, stages their scales.

    Rows past N are left unset: they only reach output columns that are not stored.
    The caller waits for the copy (`async_copy_wait_all`) before `project_tile`.
    """
    var tid = thread_idx.x
    var n_total = Int(p.n_out)
    var k_total = Int(p.depth)
    var bn = Int(p.blocks.n)
    var bk = Int(p.blocks.k)
    var kb_count = lay.k_blocks
    var w_g = p.w.unsafe_offset(g * n_total * k_total)
    var rows = min(nt, n_total - n0)
    if lay.fast_weights:
        copy_rows_16b[threads](w_g.unsafe_offset(n0 * k_total), k_total, sm.w_s, lay.w_stride, rows, k_total // 16)
        async_copy_commit_group()
    else:
        # Any block size: byte by byte into the padded layout, zeros past each K block.
        for i in range(tid, rows * lay.kp, threads):
            var r = i // lay.kp
            var kp = i % lay.kp
            var kk = kp % lay.block_kp
            var k = (kp // lay.block_kp) * bk + kk
            var byte = UInt8(0)
            if kk < bk and k < k_total:
                byte = w_g.unsafe_load((n0 + r) * k_total + k)
            sm.w_s.unsafe_store(r * lay.w_stride + kp, byte)
    var n_blocks = ceil_div_u32(n_total, bn)
    for i in range(tid, nt * kb_count, threads):
        var r = div_u32(i, kb_count)
        var n = n0 + r
        var s = Float32(0)
        if n < n_total:
            s = p.w_scale.unsafe_load((g * n_blocks + div_u32(n, bn)) * kb_count + i - r * kb_count)
        sm.sw_s.unsafe_store(i, s)


@fieldwise_init
struct ActivationRows[in_dtype: DType, copy_dtype: DType](TrivialRegisterPassable):
    """A block's group of activation rows, as `stage_activations` reads them."""

    var a_g: GPtr[Self.in_dtype]  # row m at a_g + m ms
    var ms: Int
    var copy_g: GPtr[Self.copy_dtype]  # with do_copy, row m also stored at copy_g + m copy_ms
    var copy_ms: Int
    var do_copy: Bool
    var rows: Int  # M
    var k_total: Int  # K
    var bk: Int  # K block


@always_inline
def stage_activations[
    in_dtype: DType, out_dtype: DType, copy_dtype: DType, warps: Int, swizzled: Bool = False
](
    p: Fp8Projection[in_dtype, out_dtype],
    lay: TileLayout,
    sm: TileSmem,
    g: Int,
    m0: Int,
    mt: Int,
    copy: GPtr[copy_dtype],
    copy_g_stride: Int,
    copy_m_stride: Int,
    do_copy: Bool,
):
    """Quantizes activation rows `m0 .. m0 + mt` of group `g` into `sm.a_s` (float16) and `sm.sa_s`.

    Items are (row, K block) pairs: the scale of the row's `bm x bk` block,
    then the row's quantized values; zeros pad each K block and the rows past
    M. With `do_copy`, also stores the rows, as `copy_dtype`, at
    `copy + g copy_g_stride + m copy_m_stride + k` (the attention output).
    With `swizzled` the values go to `sm.a_s` as the wgmma tile's B operand
    (`store_quantized`, projection_wgmma.mojo) instead of plain rows.

    Per-row scales (`bm == 1`) of K blocks up to 512 wide: a warp takes
    SEG_VECS float32x4 slots per lane at once, i.e. 4 items of up to 128, 2 of
    up to 256 or 1 of up to 512 values, so that 4 loads per lane are in
    flight before the warp's max-reductions. Other shapes: one item per warp
    step, the amax over the whole block, values read twice.
    """
    var lane = thread_idx.x % WARP_SIZE
    var wid = thread_idx.x // WARP_SIZE
    var act = ActivationRows[in_dtype, copy_dtype](
        p.a.ptr.unsafe_offset(g * Int(p.a.g_stride)), Int(p.a.m_stride), copy.unsafe_offset(g * copy_g_stride), copy_m_stride,
        do_copy, Int(p.rows), Int(p.depth), Int(p.blocks.k),
    )
    var bm = Int(p.blocks.m)
    var kb_count = lay.k_blocks
    var items = mt * kb_count
    comptime SLOT = 4 * WARP_SIZE  # values per float32x4 slot of a warp
    var in_registers = (
        bm == 1
        and act.bk <= SEG_VECS * SLOT
        and act.bk % 4 == 0
        and act.k_total % 4 == 0
        and act.ms % 4 == 0
        and Int(p.a.g_stride) % 4 == 0
        and (not do_copy or (copy_m_stride % 4 == 0 and copy_g_stride % 4 == 0))
    )
    if in_registers:
        # Slots per item, 1, 2 or 4 (a 384-wide block takes 4), a compile-time parameter so that
        # the item arithmetic of a warp step folds away.
        var vpi = ceil_div(lay.block_kp, SLOT)
        if vpi == 1:
            quantize_rows_in_registers[warps, 1, swizzled](act, lay, sm, m0, mt)
        elif vpi == 2:
            quantize_rows_in_registers[warps, 2, swizzled](act, lay, sm, m0, mt)
        else:
            quantize_rows_in_registers[warps, 4, swizzled](act, lay, sm, m0, mt)
        return

    for item in range(wid, items, warps):
        var r = item // kb_count
        var kb = item % kb_count
        var m = m0 + r
        var k0 = kb * act.bk
        var width = min(act.bk, act.k_total - k0)
        var scale = Float32(1)
        if m < act.rows:
            # The amax over the whole `bm x bk` block, then this row.
            var amax = Float32(0)
            var r0 = (m // bm) * bm
            for mm in range(r0, min(r0 + bm, act.rows)):
                var row = act.a_g.unsafe_offset(mm * act.ms + k0)
                for kk in range(lane, width, WARP_SIZE):
                    amax = max(amax, abs(row.unsafe_load(kk).cast[DType.float32]()))
            amax = warp.max(amax)
            scale = activation_scale(amax)
        var src = act.a_g.unsafe_offset(m * act.ms + k0)
        var div = Divisor.of(scale)
        for kk in range(lane, lay.block_kp, WARP_SIZE):
            var x = SIMD[DType.float16, 1](0)
            if m < act.rows and kk < width:
                var xv = src.unsafe_load(kk)
                x = e4m3_as_f16[1](xv.cast[DType.float32](), div)
                if do_copy:
                    act.copy_g.unsafe_store(m * copy_m_stride + k0 + kk, xv.cast[copy_dtype]())
            store_quantized[swizzled, 1](sm, lay, mt, r, kb * lay.block_kp + kk, x)
        if lane == 0:
            sm.sa_s.unsafe_store(item, scale)


@always_inline
def quantize_rows_in_registers[
    in_dtype: DType, copy_dtype: DType, //, warps: Int, VPI: Int, swizzled: Bool
](act: ActivationRows[in_dtype, copy_dtype], lay: TileLayout, sm: TileSmem, m0: Int, mt: Int):
    """`stage_activations` for per-row scales (`bm == 1`) and K blocks of up to `VPI` float32x4 slots of a warp.

    A warp step takes `SEG_VECS / VPI` items (row, K block) in `SEG_VECS`
    slots: all loads first, then one max-reduction per item across the warp.
    The items of a step are consecutive, so their rows and K blocks come from
    one division per step.
    """
    comptime SLOT = 4 * WARP_SIZE
    comptime IPG = SEG_VECS // VPI  # items per warp step
    var lane = thread_idx.x % WARP_SIZE
    var wid = thread_idx.x // WARP_SIZE
    var kb_count = lay.k_blocks
    var items = mt * kb_count
    for grp in range(wid, ceil_div(items, IPG), warps):
        # Row and K block of the step's items, and the valid width of each block.
        var r_of = SIMD[DType.int32, IPG](0)
        var kb_of = SIMD[DType.int32, IPG](0)
        var r = div_u32(grp * IPG, kb_count)
        var kb = grp * IPG - r * kb_count
        comptime for q in range(IPG):
            r_of[q] = Int32(r)
            kb_of[q] = Int32(kb)
            kb += 1
            if kb == kb_count:
                kb = 0
                r += 1
        var v = Array[SIMD[DType.float32, 4], SEG_VECS](fill=0)
        var slot_max = SIMD[DType.float32, SEG_VECS](0)
        comptime for s in range(SEG_VECS):
            var rr = Int(r_of[s // VPI])
            var kbb = Int(kb_of[s // VPI])
            var kk = 4 * lane + SLOT * (s % VPI)
            if rr < mt and m0 + rr < act.rows and kk < min(act.bk, act.k_total - kbb * act.bk):
                v[s] = (
                    act.a_g.unsafe_offset((m0 + rr) * act.ms + kbb * act.bk + kk)
                    .unsafe_load[width=4, alignment=4 * size_of[in_dtype]()](0)
                    .cast[DType.float32]()
                )
                slot_max[s] = abs(v[s]).reduce_max()
        var item_max = SIMD[DType.float32, IPG](0)
        comptime for s in range(SEG_VECS):
            item_max[s // VPI] = max(item_max[s // VPI], slot_max[s])
        # (`warp.max` of a SIMD value reduces its elements too: one scalar reduction per item.)
        var scales = SIMD[DType.float32, IPG](0)
        var divs = Array[Divisor, IPG](fill=Divisor(1, 1, 1))
        comptime for q in range(IPG):
            scales[q] = activation_scale(warp.max(item_max[q]))
            divs[q] = Divisor.of(scales[q])
        comptime for s in range(SEG_VECS):
            var rr = Int(r_of[s // VPI])
            var kbb = Int(kb_of[s // VPI])
            var kk = 4 * lane + SLOT * (s % VPI)
            var div = divs[s // VPI]
            var scale = scales[s // VPI]
            if rr < mt and kk < lay.block_kp:
                store_quantized[swizzled, 4](sm, lay, mt, rr, kbb * lay.block_kp + kk, e4m3_as_f16[4](v[s], div))
                if lane == 0 and s % VPI == 0:
                    sm.sa_s.unsafe_store(rr * kb_count + kbb, scale)
                if act.do_copy and m0 + rr < act.rows and kk < min(act.bk, act.k_total - kbb * act.bk):
                    act.copy_g.unsafe_offset((m0 + rr) * act.copy_ms + kbb * act.bk + kk).unsafe_store[
                        alignment=4 * size_of[copy_dtype]()
                    ](0, v[s].cast[copy_dtype]())


@always_inline
def store_quantized[
    swizzled: Bool, w: Int
](sm: TileSmem, lay: TileLayout, mt: Int, r: Int, kp: Int, x: SIMD[DType.float16, w]):
    """Quantized activations `x` (e4m3 values, exact in float16 and bf16) of block row `r` at padded
    columns `kp ..< kp + w` (`w` 1, or 4 from a multiple of 4): plain rows of `lay.a_stride` float16
    values, or (`swizzled`) the wgmma tile's B operand of `mt` rows in bf16 (`swizzled_offset`)."""
    comptime if swizzled:
        var base = sm.a_s.unsafe_bitcast[UInt8]()
        var y = x.cast[DType.bfloat16]()
        comptime if w == 1:
            base.unsafe_offset(swizzled_offset(mt, r, kp)).unsafe_bitcast[BFloat16]().unsafe_store(0, y[0])
        else:
            comptime for i in range(w // 2):  # pairs: (k, k + 1) and (k + 2, k + 3) land 8 columns apart
                base.unsafe_offset(swizzled_offset(mt, r, kp + 2 * i)).unsafe_bitcast[BFloat16]().unsafe_store[
                    alignment=4
                ](0, y.slice[2, offset = 2 * i]())
    else:
        sm.a_s.unsafe_offset(r * lay.a_stride + kp).unsafe_store[alignment = 2 * w](0, x)


@always_inline
def swizzled_offset(rows: Int, r: Int, kp: Int) -> Int:
    """Byte offset of padded column `kp` of row `r` in a wgmma B operand of `rows` rows (K-major, boxes of
    64 columns x `rows` rows, 128-byte swizzle: 16-byte chunk `c` of row `r` at chunk `c ^ (r % 8)`), in
    `project_tile`'s k order: in each 64-wide chunk, byte `16 t + 4 j + i` of a lane's load is k step
    `j`'s column `2 t + i % 2 + 8 (i / 2)` (the m16n8k16 fragment's columns), so a load's 16 bytes
    hold the four k steps of one thread's fragment."""
    var c = kp % KCHUNK
    var t4 = c // 16
    var j = (c % 16) // 4
    var i = c % 4
    var e = 16 * j + 2 * t4 + i % 2 + 8 * (i // 2)  # column within the box
    return (kp // KCHUNK) * rows * 128 + r * 128 + (((e // 8) ^ (r % 8)) * 16) + (e % 8) * 2


@always_inline
def stage_quantized[threads: Int](q: QuantizedRows, lay: TileLayout, sm: TileSmem, g: Int, m0: Int, mt: Int, rows: Int):
    """`stage_activations`' result copied from rows the merge quantized (`q`, merge.mojo): rows
    `m0 .. m0 + mt` of group (head) `g` into `sm.a_s` with `cp.async` (zeros past `rows`), scales
    into `sm.sa_s` (1 past `rows`). The padded layout must be the plain one (`lay.fast_weights`:
    `block_k % 64 == 0`, `K % block_k == 0`). The caller waits for the copy (`async_copy_wait_all`)."""
    var tid = thread_idx.x
    var heads = Int(q.heads)
    var kb_count = lay.k_blocks
    var vecs = lay.kp // 8  # 16-byte vectors of float16 per row
    var live = max(0, min(mt, rows - m0))
    copy_rows_16b[threads](
        q.values.unsafe_offset((m0 * heads + g) * lay.kp).unsafe_bitcast[UInt8](), heads * lay.kp * 2,
        sm.a_s.unsafe_bitcast[UInt8](), lay.a_stride * 2, live, vecs,
    )
    for i in range(live * vecs + tid, mt * vecs, threads):  # zeros for the rows past `rows`
        var r = div_u32(i, vecs)
        sm.a_s.unsafe_offset(r * lay.a_stride + 8 * (i - r * vecs)).unsafe_store[alignment=16](
            0, SIMD[DType.float16, 8](0)
        )
    async_copy_commit_group()
    for i in range(tid, mt * kb_count, threads):
        var r = div_u32(i, kb_count)
        var m = m0 + r
        var s = Float32(1)
        if m < rows:
            s = q.scales.unsafe_load((m * heads + g) * kb_count + i - r * kb_count)
        sm.sa_s.unsafe_store(i, s)


@always_inline
def weight_bytes(sm: TileSmem, lay: TileLayout, row: Int, kp: Int) -> SIMD[DType.uint32, 4]:
    """Bytes `kp ..< kp + 16` (16-byte aligned) of row `row` of the staged fp8 weights: one lane's fragment
    load (`project_tile`, `project_tile_wg`)."""
    return sm.w_s.unsafe_offset(row * lay.w_stride + kp).unsafe_bitcast[UInt32]().unsafe_load[width=4, alignment=16](0)


@always_inline
def project_tile[
    in_dtype: DType, out_dtype: DType, value_dtype: DType, warps_m: Int, warps_n: Int, tm: Int, tn: Int
](p: Fp8Projection[in_dtype, out_dtype], lay: TileLayout, sm: TileSmem, g: Int, m0: Int, n0: Int):
    """`c[g, m0 .., n0 ..]` of the staged tiles: warp `(wm, wn)` owns `16 tm` rows x `8 tn` columns.

    Per K block the fp8 products are summed on tensor cores (`part`), then
    `acc += part * (sa * sw)`; stored rounded to `value_dtype`.
    """
    comptime NACC = tm * tn
    var tid = thread_idx.x
    var wid = tid // WARP_SIZE
    var lane = tid % WARP_SIZE
    var gq = lane // 4
    var t4 = lane % 4
    var row_base = (wid // warps_n) * tm * 16
    var col_base = (wid % warps_n) * tn * 8
    var kb_count = lay.k_blocks
    var chunks = lay.block_kp // KCHUNK

    var acc = Array[SIMD[DType.float32, 4], NACC](fill=0)
    for kb in range(kb_count):
        var part = Array[SIMD[DType.float32, 4], NACC](fill=0)
        for ch in range(chunks):
            var kp0 = kb * lay.block_kp + ch * KCHUNK + 16 * t4
            var wf = Array[SIMD[DType.float16, 16], tn](fill=0)
            comptime for j in range(tn):
                wf[j] = bitcast[DType.float8_e4m3fn, 16](weight_bytes(sm, lay, col_base + j * 8 + gq, kp0)).cast[DType.float16]()
            var af = Array[SIMD[DType.float16, 16], 2 * tm](fill=0)
            comptime for i in range(2 * tm):
                var ap = sm.a_s.unsafe_offset((row_base + (i // 2) * 16 + gq + 8 * (i % 2)) * lay.a_stride + kp0)
                af[i] = ap.unsafe_load[width=8, alignment=16](0).join(ap.unsafe_load[width=8, alignment=16](8))
            comptime for step in range(4):
                comptime for i in range(tm):
                    var x = af[2 * i].slice[4, offset=4 * step]().join(af[2 * i + 1].slice[4, offset=4 * step]())
                    var a = x.shuffle[0, 1, 4, 5, 2, 3, 6, 7]()
                    comptime for j in range(tn):
                        var c = part[i * tn + j]
                        mma(part[i * tn + j], a, wf[j].slice[4, offset=4 * step](), c)
        comptime for i in range(tm):
            var ra = row_base + i * 16 + gq
            var sa0 = sm.sa_s.unsafe_load(ra * kb_count + kb)
            var sa1 = sm.sa_s.unsafe_load((ra + 8) * kb_count + kb)
            comptime for j in range(tn):
                var col = col_base + j * 8 + 2 * t4
                var sw0 = sm.sw_s.unsafe_load(col * kb_count + kb)
                var sw1 = sm.sw_s.unsafe_load((col + 1) * kb_count + kb)
                var s = SIMD[DType.float32, 4](sa0 * sw0, sa0 * sw1, sa1 * sw0, sa1 * sw1)
                acc[i * tn + j] = part[i * tn + j].fma(s, acc[i * tn + j])

    var rows = Int(p.rows)
    var n_total = Int(p.n_out)
    var cgs = Int(p.c.g_stride)
    var cms = Int(p.c.m_stride)
    var pairs = cgs % 2 == 0 and cms % 2 == 0 and n_total % 2 == 0
    var c_g = p.c.ptr.unsafe_offset(g * cgs)
    comptime for i in range(tm):
        comptime for h in range(2):
            var m = m0 + row_base + i * 16 + gq + 8 * h
            if m < rows:
                comptime for j in range(tn):
                    var n = n0 + col_base + j * 8 + 2 * t4
                    var v = acc[i * tn + j].slice[2, offset=2 * h]().cast[value_dtype]().cast[out_dtype]()
                    var dst = c_g.unsafe_offset(m * cms + n)
                    if pairs and n < n_total:
                        dst.unsafe_store[alignment=2 * size_of[out_dtype]()](0, v)
                    else:
                        if n < n_total:
                            dst.unsafe_store(0, v[0])
                        if n + 1 < n_total:
                            dst.unsafe_store(1, v[1])
