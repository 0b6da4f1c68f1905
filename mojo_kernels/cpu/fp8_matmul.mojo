"""Steps 3 and 6: fp8 batched matmuls with block scales and dynamic activation quantization.

Both projections are `c[g, m, :] = a[g, m, :] @ w[g].T` over heads `g`, with
`w [G, N, K]` fp8 e4m3 (passed as raw bytes) and float32 scales
`w_scale [G, ceil(N / n_block), ceil(K / k_block)]`. The activations are
quantized here, one scale per `m_block x k_block` block:
`s = amax / 448` (1 when amax is 0), `a_q = fp8(clamp(a / s, -448, 448))`
rounded to nearest-even, as `pymla/quant.py` specifies. Then per K block the
exact fp8 products are summed and scaled by `sa * sw`. Where the CPU has
AVX512-BF16 and step 5 takes a bf16 path, the products are summed with
`vdpbf16ps` on bf16 copies of both operands (fp8 values are exact in bf16):
the same sums up to their float32 order, at twice the multiply rate of
float32 FMAs and with weights widened in 4 integer operations per 32.
"""

from std.math import min

from ..common import DPtr, FPtr, U8Ptr, ceil_div
from ..fp8 import activation_scale, round_to_e4m3, scaled_into_range, widen_e4m3, widen_e4m3_bf16
from ..spec import BlockShape
from .bf16 import HAS_AVX512_BF16, STEP, BF16Ptr
from .scratch import Scratch
from .simd import DOT_COLS, DOT_ROWS, F32Vec, F32_WIDTH, cast_copy, dot_lanes, sum_lanes

comptime WEIGHT_BYTES_PER_SLICE = 32768
"""fp8 weight bytes a head's task widens at a time (whole rows, at least one): 64 rows of step 6
(K 512), 256 of step 3 (K 128), a slice that stays in L2 widened."""


comptime WIDEN_IN_DOTS_MAX_ROWS = 2 * DOT_ROWS
"""Up to this many tokens the bf16 dots widen the weights' bytes in registers (4 integer operations per 32,
once per register block of DOT_ROWS tokens) instead of reading a slice widened once: no bf16 copy of the
weights to store and load again. On a 2-core AMD EPYC (AVX512-BF16), the whole op from memory, 4k keys,
16 and 128 heads, old and new alternated: 3-5% faster at batch 1 to 4, level at batch 8
(benchmarks/results/cpu-2026-12-08c-epyc-widen-in-dots). The float32 dots keep the slices (their widening
takes several times the operations: batch 1, 16 heads, 16% slower in registers)."""


def weight_rows_per_slice(depth: Int) -> Int:
    return max(1, WEIGHT_BYTES_PER_SLICE // max(depth, 1))


@fieldwise_init
struct StridedMatrices[dtype: DType](TrivialRegisterPassable):
    """Matrices `x[g]` with element `(g, m, c)` at `ptr + g * g_stride + m * m_stride + c`."""

    var ptr: DPtr[Self.dtype]
    var g_stride: Int
    var m_stride: Int

    def row(self, g: Int, m: Int) -> DPtr[Self.dtype]:
        return self.ptr.unsafe_offset(g * self.g_stride + m * self.m_stride)


def quantize_head[
    dtype: DType
](
    a: StridedMatrices[dtype],
    g: Int,
    num_rows: Int,
    depth: Int,
    blocks: BlockShape,
    a_q: FPtr,
    a_scale: FPtr,
):
    """Quantizes head `g`'s rows of `a` into fp8 values kept as float32 in `a_q [G, M, K]`, their scales
    in `a_scale [G, MB, KB]` (every value of head `g` in both is written)."""
    comptime W = F32_WIDTH
    var m_blocks = ceil_div(num_rows, blocks.m)
    var k_blocks = ceil_div(depth, blocks.k)
    for mb in range(m_blocks):
        var m0 = mb * blocks.m
        var m1 = min(m0 + blocks.m, num_rows)
        for kb in range(k_blocks):
            var k0 = kb * blocks.k
            var k1 = min(k0 + blocks.k, depth)
            var vec_end = k0 + (k1 - k0) - (k1 - k0) % W
            var amax = Float32(0)
            for m in range(m0, m1):
                var src = a.row(g, m)
                var vmax = F32Vec(0)
                for k in range(k0, vec_end, W):
                    vmax = max(vmax, abs(src.unsafe_load[width=W](k).cast[DType.float32]()))
                amax = max(amax, vmax.reduce_max())
                for k in range(vec_end, k1):
                    amax = max(amax, abs(src.unsafe_load(k).cast[DType.float32]()))
            var s = activation_scale(amax)
            a_scale.unsafe_store((g * m_blocks + mb) * k_blocks + kb, s)
            for m in range(m0, m1):
                var src = a.row(g, m)
                var dst = a_q.unsafe_offset((g * num_rows + m) * depth)
                for k in range(k0, vec_end, W):
                    var x = src.unsafe_load[width=W](k).cast[DType.float32]()
                    dst.unsafe_store(k, round_to_e4m3[W](scaled_into_range[W](x, s)))
                for k in range(vec_end, k1):
                    var x = F32Vec(src.unsafe_load(k).cast[DType.float32]())
                    dst.unsafe_store(k, round_to_e4m3[W](scaled_into_range[W](x, s))[0])


def widen_weight_rows[elem: DType](w: U8Ptr, dst: DPtr[elem], count: Int):
    """`dst[i] = e4m3(w[i])` for `count` bytes, exactly: as float32 (`fp8.widen_e4m3`) or, for the
    bf16 dots, as bfloat16 (`fp8.widen_e4m3_bf16`, 32 at a time)."""
    comptime W = STEP if elem == DType.bfloat16 else F32_WIDTH
    var main = count - count % W
    for i in range(0, main, W):
        var bytes = w.unsafe_load[width=W](i)
        comptime if elem == DType.bfloat16:
            dst.unsafe_store(i, rebind[SIMD[elem, W]](widen_e4m3_bf16[W](bytes, 0)))
        else:
            dst.unsafe_store(i, widen_e4m3[W](bytes).cast[elem]())
    for i in range(main, count):
        dst.unsafe_store(i, widen_e4m3[F32_WIDTH](SIMD[DType.uint8, F32_WIDTH](w.unsafe_load(i)))[0].cast[elem]())


@fieldwise_init
struct QuantizedMatmul[in_dtype: DType, out_dtype: DType](TrivialRegisterPassable):
    """One fp8 batched matmul: its activations, their quantized copies (written per head by `quantize`),
    the weights and the output."""

    var a: StridedMatrices[Self.in_dtype]
    var a_q: FPtr  # [G, M, K] fp8 values as float32
    var a_bf16: BF16Ptr  # the same values as bfloat16 for the bf16 dots (else not read)
    var a_scale: FPtr  # [G, MB, KB]
    var w: U8Ptr  # [G, N, K] fp8 bytes
    var w_scale: FPtr  # [G, NB, KB]
    var c: StridedMatrices[Self.out_dtype]
    var num_rows: Int
    var n_out: Int
    var depth: Int
    var blocks: BlockShape
    var on_bf16: Bool  # the products on the AVX512-BF16 unit (`vdpbf16ps`), else float32 FMAs

    @staticmethod
    def create(
        mut mem: Scratch,
        a: StridedMatrices[Self.in_dtype],
        w: U8Ptr,
        w_scale: FPtr,
        c: StridedMatrices[Self.out_dtype],
        num_groups: Int,
        num_rows: Int,
        n_out: Int,
        depth: Int,
        blocks: BlockShape,
        bf16_dots: Bool,
    ) -> Self:
        """The matmul with its quantized activations' buffers from `mem` (not filled: `quantize` writes a
        head's whole share of them); `bf16_dots` where the AVX512-BF16 unit is compiled in."""
        var values = max(num_groups * num_rows * depth, 1)
        var on_bf16 = bf16_dots and HAS_AVX512_BF16
        var scales = num_groups * ceil_div(num_rows, blocks.m) * ceil_div(depth, blocks.k)
        return Self(
            a, mem.take[DType.float32](values, zero=False),
            mem.take[DType.bfloat16](values if on_bf16 else 0, zero=False),
            mem.take[DType.float32](scales, zero=False), w, w_scale, c, num_rows, n_out, depth, blocks, on_bf16,
        )

    def quantize(self, g: Int):
        """Head `g`'s activations quantized (`quantize_head`), and their bf16 copies for the bf16 dots
        (exact: the quantized values are e4m3's)."""
        quantize_head[Self.in_dtype](self.a, g, self.num_rows, self.depth, self.blocks, self.a_q, self.a_scale)
        if self.on_bf16:
            var n = self.num_rows * self.depth
            cast_copy(self.a_q.unsafe_offset(g * n), self.a_bf16.unsafe_offset(g * n), n)

    def head(self, g: Int):
        """`c[g]`: head `g`'s activations quantized, then its outputs (`outputs`) on bf16 or float32 dots."""
        self.quantize(g)
        comptime if HAS_AVX512_BF16:
            if self.on_bf16:
                self.outputs[DType.bfloat16](g)
                return
        self.outputs[DType.float32](g)

    def outputs[elem: DType](self, g: Int):
        """`c[g]` on `elem` dots. On bf16 dots with at most WIDEN_IN_DOTS_MAX_ROWS tokens the dots widen the
        weights' bytes in registers as they load them; otherwise the weight rows are taken in slices of
        `weight_rows_per_slice` rows (`slice_outputs`: widened once, in L2, for every token)."""
        comptime if elem == DType.bfloat16:
            if self.num_rows <= WIDEN_IN_DOTS_MAX_ROWS:
                self.token_rows[elem](self.w.unsafe_offset(g * self.n_out * self.depth), g, 0, self.n_out)
                return
        var rows_per_slice = weight_rows_per_slice(self.depth)
        for n0 in range(0, self.n_out, rows_per_slice):
            self.slice_outputs[elem](g, n0, min(n0 + rows_per_slice, self.n_out))

    def activations[elem: DType](self) -> DPtr[elem]:
        """The quantized activations as `elem` values: `a_q` (float32) or `a_bf16` (bfloat16)."""
        comptime if elem == DType.bfloat16:
            return rebind[DPtr[elem]](self.a_bf16)
        return rebind[DPtr[elem]](self.a_q)

    def output_block[
        rows: Int, cols: Int, elem: DType, w_stored: DType
    ](self, w_rows: DPtr[w_stored], g: Int, m0: Int, n0: Int):
        """`c[g, m0 : m0 + rows, n0 : n0 + cols]`: per K block, exact fp8 dot products times `sa * sw`.

        `w_rows` holds weight rows `n0 ..` of head `g`, widened to `elem` (or their fp8 bytes, `w_stored`
        uint8, widened by the dots): float32 (against `a_q`) or bfloat16 (against `a_bf16`; `dot_lanes` on
        `vdpbf16ps`). The per-block products stay in vector lanes, scaled
        lane-wise, and are summed across lanes once at the end.
        """
        var m_blocks = ceil_div(self.num_rows, self.blocks.m)
        var n_blocks = ceil_div(self.n_out, self.blocks.n)
        var k_blocks = ceil_div(self.depth, self.blocks.k)
        var a_rows = self.activations[elem]().unsafe_offset((g * self.num_rows + m0) * self.depth)
        var sa = Array[FPtr, rows](fill=self.a_scale)
        comptime for r in range(rows):
            sa[r] = self.a_scale.unsafe_offset((g * m_blocks + (m0 + r) // self.blocks.m) * k_blocks)
        var sw = Array[FPtr, cols](fill=self.w_scale)
        comptime for cc in range(cols):
            sw[cc] = self.w_scale.unsafe_offset((g * n_blocks + (n0 + cc) // self.blocks.n) * k_blocks)
        var total = Array[F32Vec, rows * cols](fill=F32Vec(0))
        for kb in range(k_blocks):
            var k0 = kb * self.blocks.k
            var k1 = min(k0 + self.blocks.k, self.depth)
            var part = dot_lanes[rows, cols, elem, w_stored](
                a_rows.unsafe_offset(k0), self.depth, w_rows.unsafe_offset(k0), self.depth, k1 - k0
            )
            comptime for r in range(rows):
                var s_a = sa[r].unsafe_load(kb)
                comptime for cc in range(cols):
                    total[r * cols + cc] += part[r * cols + cc] * (s_a * sw[cc].unsafe_load(kb))
        var sums = sum_lanes(total)
        comptime for r in range(rows):
            comptime for cc in range(cols):
                self.c.row(g, m0 + r).unsafe_store(n0 + cc, sums[r * cols + cc].cast[Self.out_dtype]())

    def output_rows[
        rows: Int, elem: DType, w_stored: DType
    ](self, w_rows: DPtr[w_stored], g: Int, m0: Int, n0: Int, n1: Int):
        """Columns `n0 .. n1 - 1` of `rows` output rows, in blocks of DOT_COLS columns."""
        var n = n0
        while n + DOT_COLS <= n1:
            self.output_block[rows, DOT_COLS, elem](w_rows.unsafe_offset((n - n0) * self.depth), g, m0, n)
            n += DOT_COLS
        while n < n1:
            self.output_block[rows, 1, elem](w_rows.unsafe_offset((n - n0) * self.depth), g, m0, n)
            n += 1

    def token_rows[elem: DType, w_stored: DType](self, w_rows: DPtr[w_stored], g: Int, n0: Int, n1: Int):
        """Columns `n0 .. n1 - 1` of head `g` for every token, from weight rows `n0 ..` at `w_rows`."""
        var m = 0
        while m + DOT_ROWS <= self.num_rows:
            self.output_rows[DOT_ROWS, elem](w_rows, g, m, n0, n1)
            m += DOT_ROWS
        while m < self.num_rows:
            self.output_rows[1, elem](w_rows, g, m, n0, n1)
            m += 1

    def slice_outputs[elem: DType](self, g: Int, n0: Int, n1: Int):
        """Columns `n0 .. n1 - 1` of head `g` for every token: the slice's weights widened to `elem`
        once (a scratch slice that stays in L2), then multiplied with every token."""
        var mem = Scratch()
        var w_rows = mem.take[elem]((n1 - n0) * self.depth, zero=False)
        widen_weight_rows(self.w.unsafe_offset((g * self.n_out + n0) * self.depth), w_rows, (n1 - n0) * self.depth)
        self.token_rows[elem](w_rows, g, n0, n1)
        _ = mem^
