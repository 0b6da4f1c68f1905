"""Steps 3 and 6 on AMX tiles: the fp8 batched matmuls of `cpu/fp8_matmul.mojo` with `tdpbf16ps`.

Same products, same block scales, same rounding points: e4m3 weights widen
exactly to bf16, and so do the activations' e4m3 values (quantized by
`quantize_head`, the one rule of `fp8.mojo`); a product of two e4m3
values is exact in float32, so `tdpbf16ps` sums, per K block, the same
products in float32 as the vector path, in another order. Per
`(m_block, k_block)` the tile's partial sums are scaled by `sa * sw` and
added up in float32, as there.

Layout (`TileUnit` of `cpu/amx.mojo`, tiles of 16 rows x 64 bytes): the
weights are the left operands, `C^T [n x m] = W A^T`. A head's task widens
its weight rows a slice at a time, to bf16 rows in place order (`[rows, Kp]`),
and loads 16 x 32 tiles from them with the row stride; the head's activations
are packed once per call into the right operand's pair layout (`pack_queries`'
layout, one 16-row block of tokens per tile). Each K block starts on a
32-value step: a block of `bk` values takes `ceil(bk / 32)` steps, zeros
past its end in both operands, so a block that is not a multiple of 32 (or
the last, shorter one) still sums only its own products.
"""

from std.math import min

from ..common import DPtr, FPtr, U8Ptr, ceil_div
from ..fp8 import widen_e4m3, widen_e4m3_bf16
from ..spec import BlockShape
from .amx import (
    ACC,
    LEFT,
    RIGHT,
    TILE_BYTES,
    TILE_DEPTH,
    TILE_ELEMENTS,
    TILE_PAIRS,
    TILE_ROWS,
    AmxTiles,
    TileUnit,
    as_bytes,
    f32_bytes,
    transpose_into_scores,
)
from .attention import PATH_AMX
from .bf16 import STEP, BF16Ptr
from .fp8_matmul import QuantizedMatmul, StridedMatrices
from .scratch import Scratch
from .simd import F32_WIDTH, run_tasks

comptime AMX_PROJECTION_MIN_TOKENS = 8
"""Tokens from which steps 3 and 6 take the tiles: a tile's 16 rows are one head's tokens, so below 16
some of every `tdpbf16ps` multiplies padding, and the widened weights' tile loads are paid whatever the
tokens. Steps 3 + 6 alone (`tests/cpu/projection_check.mojo`, 2026-12-07, after the weights widened 32
bytes at a time), tiles against the AVX512-BF16 dots: on a 2-core AMX guest 8 tokens 128 heads 1.59-1.64
against 2.65-2.76 ms, 4 tokens 1.31 against 1.60, 2 tokens 1.21 against 1.36, 1 token 1.13 against 0.91,
8 tokens 16 heads 0.19 against 0.35; on the H100 machine's 16-core host 8 tokens 128 heads 1.12 against
1.13 ms, 16 heads level, 1 token 0.44 against 0.29. So from 8 tokens (level or faster on both)."""
comptime AMX_WEIGHT_ROWS_PER_SLICE = 64
"""Weight rows a head's task widens at a time (four 16-row tiles): 64 KiB of bf16 at K = 512, in L2."""


def projection_on_amx(path: Int, num_tokens: Int) -> Bool:
    """Whether steps 3 and 6 take the AMX tiles: step 5's path is AMX (`pipeline.attention_path`,
    the unit compiled in and granted by Linux) and the tokens fill a tile (`AMX_PROJECTION_MIN_TOKENS`)."""
    return path == PATH_AMX and num_tokens >= AMX_PROJECTION_MIN_TOKENS


@fieldwise_init
struct KBlocks(TrivialRegisterPassable):
    """K blocks of `size` values, each padded to `padded` (a multiple of 32): `count * padded` values in all."""

    var size: Int
    var padded: Int
    var count: Int
    var depth: Int

    @staticmethod
    def of(depth: Int, size: Int) -> Self:
        return Self(size, ceil_div(min(size, depth), TILE_DEPTH) * TILE_DEPTH, ceil_div(depth, size), depth)

    def padded_depth(self) -> Int:
        return self.count * self.padded

    def steps(self) -> Int:
        """32-value steps of `tdpbf16ps` per K block."""
        return self.padded // TILE_DEPTH


@always_inline
def exact_f32[src_dtype: DType, w: Int](src: DPtr[src_dtype], i: Int) -> SIMD[DType.float32, w]:
    """`w` values from `src + i` as float32: e4m3 bytes widened (`widen_e4m3`), float32 as they are."""
    comptime if src_dtype == DType.uint8:
        return widen_e4m3[w](rebind[SIMD[DType.uint8, w]](src.unsafe_load[width=w](i)))
    else:
        return src.unsafe_load[width=w](i).cast[DType.float32]()


def to_padded_bf16[src_dtype: DType](src: DPtr[src_dtype], dst: BF16Ptr, kb: KBlocks):
    """`dst [kb.padded_depth()]`: the `kb.depth` values of `src` (e4m3 bytes or float32 holding e4m3 values,
    exact in bf16), each K block padded with zeros."""
    comptime W = F32_WIDTH
    for b in range(kb.count):
        var k0 = b * kb.size
        var n = min(kb.size, kb.depth - k0)
        var d = dst.unsafe_offset(b * kb.padded)
        var i = 0
        comptime if src_dtype == DType.uint8:  # e4m3 bytes: 32 at a time in integer arithmetic
            while i + STEP <= n:
                var bytes = rebind[SIMD[DType.uint8, STEP]](src.unsafe_load[width=STEP](k0 + i))
                d.unsafe_store(i, widen_e4m3_bf16[STEP](bytes, 0))
                i += STEP
        while i + W <= n:
            d.unsafe_store(i, exact_f32[src_dtype, W](src, k0 + i).cast[DType.bfloat16]())
            i += W
        while i < n:
            d.unsafe_store(i, exact_f32[src_dtype, 1](src, k0 + i).cast[DType.bfloat16]()[0])
            i += 1
        while i < kb.padded:
            d.unsafe_store(i, BFloat16(0))
            i += 1


def pack_activations(
    a_q: FPtr, packed: BF16Ptr, row_buf: BF16Ptr, g: Int, num_rows: Int, row_blocks: Int, kb: KBlocks
):
    """Head `g`'s quantized activations as right operands, per 16-row block `rb` and step `s`:

    `packed[((g * row_blocks + rb) * S + s) * 512 + 32 p + 2 m + i] = A[16 rb + m, 32 s + 2 p + i]`,
    `A` the padded bf16 rows (`to_padded_bf16`; zeros past `num_rows`), `S` the steps of `Kp`.
    `row_buf [Kp]` is scratch.
    """
    var padded_depth = kb.padded_depth()
    var steps = padded_depth // TILE_DEPTH
    var words = row_buf.unsafe_bitcast[UInt32]()
    for rb in range(row_blocks):
        var block = packed.unsafe_offset((g * row_blocks + rb) * steps * TILE_ELEMENTS).unsafe_bitcast[UInt32]()
        for m in range(TILE_ROWS):
            var row = rb * TILE_ROWS + m
            if row >= num_rows:
                break  # the rows past the tokens stay zero
            to_padded_bf16[DType.float32](a_q.unsafe_offset((g * num_rows + row) * kb.depth), row_buf, kb)
            for s in range(steps):
                for p in range(TILE_PAIRS):
                    block.unsafe_store((s * TILE_PAIRS + p) * TILE_ROWS + m, words.unsafe_load(s * TILE_PAIRS + p))


@fieldwise_init
struct AmxMatmul[in_dtype: DType, out_dtype: DType](TrivialRegisterPassable):
    """One fp8 batched matmul on tiles: `QuantizedMatmul`'s activations (quantized per head), packed per
    head as right operands."""

    var q: QuantizedMatmul[Self.in_dtype, Self.out_dtype]  # the sizes, weights, output; the quantized activations
    var a_packed: BF16Ptr  # [G, row_blocks, steps, 16, 32]
    var kb: KBlocks
    var row_blocks: Int

    @staticmethod
    def create(mut mem: Scratch, quantized: QuantizedMatmul[Self.in_dtype, Self.out_dtype], num_groups: Int) -> Self:
        """The tile matmul of `quantized` (made without bf16 dots), its packed operands from `mem` (zero-filled:
        the rows past the tokens stay zero)."""
        var kb = KBlocks.of(quantized.depth, quantized.blocks.k)
        var row_blocks = ceil_div(quantized.num_rows, TILE_ROWS)
        var packed = mem.take[DType.bfloat16](num_groups * row_blocks * kb.padded_depth() * TILE_ROWS)
        return Self(quantized, packed, kb, row_blocks)

    def head[tiles: TileUnit](self, g: Int):
        """`c[g]` on the tiles: head `g`'s activations quantized and packed, then its weight rows in
        slices of AMX_WEIGHT_ROWS_PER_SLICE (widened once to bf16, rows past the last zero), each
        multiplied with every token."""
        var mem = Scratch()
        self.q.quantize(g)
        var row_buf = mem.take[DType.bfloat16](self.kb.padded_depth())
        pack_activations(self.q.a_q, self.a_packed, row_buf, g, self.q.num_rows, self.row_blocks, self.kb)
        var w_rows = mem.take[DType.bfloat16](AMX_WEIGHT_ROWS_PER_SLICE * self.kb.padded_depth(), zero=False)
        var buf = mem.take[DType.float32](9 * TILE_ROWS * TILE_ROWS)
        var unit = tiles()
        unit.start()
        for n0 in range(0, self.q.n_out, AMX_WEIGHT_ROWS_PER_SLICE):
            var n1 = min(n0 + AMX_WEIGHT_ROWS_PER_SLICE, self.q.n_out)
            var n_tiles = ceil_div(n1 - n0, TILE_ROWS)
            for i in range((n1 - n0) * self.kb.padded_depth(), n_tiles * TILE_ROWS * self.kb.padded_depth()):
                w_rows.unsafe_store(i, 0)
            self.widen_weights(g, n0, n1, w_rows)
            self.tiles_of_slice(unit, w_rows, g, n0, n_tiles, buf)
        unit.stop()
        _ = mem^

    def widen_weights(self, g: Int, n0: Int, n1: Int, w_rows: BF16Ptr):
        """`w_rows [n1 - n0, Kp]`: weight rows `n0 ..` of head `g` in bf16, K blocks padded."""
        for n in range(n0, n1):
            var src = self.q.w.unsafe_offset((g * self.q.n_out + n) * self.kb.depth)
            to_padded_bf16[DType.uint8](src, w_rows.unsafe_offset((n - n0) * self.kb.padded_depth()), self.kb)

    def scale_into(self, part: FPtr, total: FPtr, g: Int, m0: Int, n0: Int, b: Int):
        """`total[n, m] += part[n, m] * (sa[m0 + m, b] * sw[n0 + n, b])` for a `16 x 16` tile (`[n, m]`)."""
        var m_blocks = ceil_div(self.q.num_rows, self.q.blocks.m)
        var n_blocks = ceil_div(self.q.n_out, self.q.blocks.n)
        var sa = SIMD[DType.float32, TILE_ROWS](0)
        for m in range(min(TILE_ROWS, self.q.num_rows - m0)):
            sa[m] = self.q.a_scale.unsafe_load((g * m_blocks + (m0 + m) // self.q.blocks.m) * self.kb.count + b)
        for n in range(min(TILE_ROWS, self.q.n_out - n0)):
            var sw = self.q.w_scale.unsafe_load((g * n_blocks + (n0 + n) // self.q.blocks.n) * self.kb.count + b)
            var at = n * TILE_ROWS
            total.unsafe_store(
                at, total.unsafe_load[width=TILE_ROWS](at) + part.unsafe_load[width=TILE_ROWS](at) * (sa * sw)
            )

    def store_tile(self, total: FPtr, transposed: FPtr, g: Int, m0: Int, n0: Int):
        """`c[g, m0 + m, n0 + n] = total[n, m]` for the tile's rows and columns inside `c`."""
        transpose_into_scores(total, transposed, 0, 0, TILE_ROWS)
        var cols = min(TILE_ROWS, self.q.n_out - n0)
        for m in range(min(TILE_ROWS, self.q.num_rows - m0)):
            var dst = self.q.c.row(g, m0 + m).unsafe_offset(n0)
            if cols == TILE_ROWS:
                dst.unsafe_store(transposed.unsafe_load[width=TILE_ROWS](m * TILE_ROWS).cast[Self.out_dtype]())
            else:
                for n in range(cols):
                    dst.unsafe_store(n, transposed.unsafe_load(m * TILE_ROWS + n).cast[Self.out_dtype]())

    def tiles_of_slice[T: TileUnit](self, mut unit: T, w_rows: BF16Ptr, g: Int, n0: Int, n_tiles: Int, buf: FPtr):
        """`c[g, :, n0 : n0 + 16 n_tiles]` from the widened rows; `buf [9 x 256]` scratch.

        Two weight tiles (column blocks of `C^T`) by two token blocks: four accumulators, two left and
        two right operands, the eight tile registers; per K block the accumulators are stored, scaled
        and added into the totals (`buf` tiles 0..3; tile 4..7 the partial sums; 8 the transposed tile).
        """
        comptime T2 = TILE_ROWS * TILE_ROWS
        var steps = self.kb.steps()
        var all_steps = self.kb.padded_depth() // TILE_DEPTH
        var w_stride = self.kb.padded_depth() * 2
        var rb = 0
        while rb < self.row_blocks:
            var two_m = rb + 1 < self.row_blocks
            var a0 = as_bytes(self.a_packed, (g * self.row_blocks + rb) * all_steps * TILE_ELEMENTS)
            var a1 = as_bytes(self.a_packed, (g * self.row_blocks + rb + 1) * all_steps * TILE_ELEMENTS)
            var nt = 0
            while nt < n_tiles:
                var two_n = nt + 1 < n_tiles
                var w0 = as_bytes(w_rows, nt * TILE_ROWS * self.kb.padded_depth())
                var w1 = as_bytes(w_rows, (nt + 1) * TILE_ROWS * self.kb.padded_depth())
                for i in range(4 * T2):
                    buf.unsafe_store(i, 0)
                for b in range(self.kb.count):
                    unit.zero[ACC]()
                    unit.zero[ACC + 1]()
                    unit.zero[ACC + 2]()
                    unit.zero[ACC + 3]()
                    for s in range(b * steps, (b + 1) * steps):
                        unit.load[LEFT](w0.unsafe_offset(s * TILE_BYTES), w_stride)
                        unit.load[RIGHT](a0.unsafe_offset(s * TILE_ELEMENTS * 2), TILE_BYTES)
                        unit.dot[ACC, LEFT, RIGHT]()
                        if two_n:
                            unit.load[LEFT + 1](w1.unsafe_offset(s * TILE_BYTES), w_stride)
                            unit.dot[ACC + 2, LEFT + 1, RIGHT]()
                        if two_m:
                            unit.load[RIGHT + 1](a1.unsafe_offset(s * TILE_ELEMENTS * 2), TILE_BYTES)
                            unit.dot[ACC + 1, LEFT, RIGHT + 1]()
                            if two_n:
                                unit.dot[ACC + 3, LEFT + 1, RIGHT + 1]()
                    # Accumulator ACC + 2 i + j: weight tile nt + i, token block rb + j.
                    unit.store[ACC](f32_bytes(buf, 4 * T2), TILE_BYTES)
                    unit.store[ACC + 1](f32_bytes(buf, 5 * T2), TILE_BYTES)
                    unit.store[ACC + 2](f32_bytes(buf, 6 * T2), TILE_BYTES)
                    unit.store[ACC + 3](f32_bytes(buf, 7 * T2), TILE_BYTES)
                    comptime for t in range(4):
                        var m0 = (rb + t % 2) * TILE_ROWS
                        var c0 = n0 + (nt + t // 2) * TILE_ROWS
                        if rb + t % 2 < self.row_blocks and nt + t // 2 < n_tiles:
                            self.scale_into(buf.unsafe_offset((4 + t) * T2), buf.unsafe_offset(t * T2), g, m0, c0, b)
                comptime for t in range(4):
                    var m0 = (rb + t % 2) * TILE_ROWS
                    var c0 = n0 + (nt + t // 2) * TILE_ROWS
                    if rb + t % 2 < self.row_blocks and nt + t // 2 < n_tiles:
                        self.store_tile(buf.unsafe_offset(t * T2), buf.unsafe_offset(8 * T2), g, m0, c0)
                nt += 2
            rb += 2


trait HeadPrologue(ImplicitlyCopyable, Deinitable):
    """What a projection's task for head `h` runs first: it writes that head's rows of the activations."""

    def run(self, h: Int):
        ...


@fieldwise_init
struct NoPrologue(HeadPrologue, TrivialRegisterPassable):
    """The prologue of a projection whose activations are all in place already."""

    def run(self, h: Int):
        pass


def fp8_projection[
    Prologue: HeadPrologue, //, in_dtype: DType, out_dtype: DType, tiles: TileUnit = AmxTiles
](
    a: StridedMatrices[in_dtype],
    w: U8Ptr,
    w_scale: FPtr,
    c: StridedMatrices[out_dtype],
    num_groups: Int,
    num_rows: Int,
    n_out: Int,
    depth: Int,
    blocks: BlockShape,
    on_amx: Bool,
    bf16_dots: Bool,
    prologue: Prologue,
) raises:
    """Step 3 or 6, one parallel stage of a task per head `g`: `prologue.run(g)` (what writes head `g`'s
    rows of `a`: the merge of step 5's partitions, RoPE on q; `NoPrologue` where `a` is ready), then
    `c[g]` on tiles where `on_amx` (`projection_on_amx`: `AmxMatmul.head`), else on the vector unit
    (`QuantizedMatmul.head`; with `bf16_dots` on the AVX512-BF16 unit where it serves): the same `c`,
    up to the order of the float32 sums.

    One stage instead of one per phase (quantize, copy, products): each stage costs the task runner
    about 25 us on 16 cores, the phases of a head need nothing from other heads, and a task per head
    (16 or 128 in DeepSeek-V3's shapes) fills the cores. The tile registers are asked for by the
    caller (`amx_permitted`, done by `pipeline.attention_path`).
    """
    var mem = Scratch()
    var quantized = QuantizedMatmul[in_dtype, out_dtype].create(
        mem, a, w, w_scale, c, num_groups, num_rows, n_out, depth, blocks, bf16_dots and not on_amx
    )
    var amx = AmxMatmul[in_dtype, out_dtype].create(mem, quantized, num_groups if on_amx else 0)

    def head_task(g: Int) {var prologue, var quantized, var amx, var on_amx}:
        prologue.run(g)
        if on_amx:
            amx.head[tiles](g)
        else:
            quantized.head(g)

    run_tasks(head_task, num_groups, num_groups * n_out * depth * max(num_rows, 1))
    _ = mem^
