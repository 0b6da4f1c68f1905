"""Steps 3 and 6: fp8 batched matmuls with block scales and dynamic activation quantization.

Both projections are `c[g, m, :] = a[g, m, :] @ w[g].T` over heads `g`, with
`w [G, N, K]` fp8 e4m3 (passed as raw bytes) and float32 scales
`w_scale [G, ceil(N / n_block), ceil(K / k_block)]`. The activations are
quantized here, one scale per `m_block x k_block` block:
`s = amax / 448` (1 when amax is 0), `a_q = fp8(clamp(a / s, -448, 448))`
rounded to nearest-even, as `pymla/quant.py` specifies. Then per K block the
exact fp8 products are summed and scaled by `sa * sw`.
"""

from std.math import min
from std.memory import bitcast
from max.algorithm import sync_parallelize

from .common import DOT_COLS, DOT_ROWS, DPtr, FPtr, U8Ptr, F32_WIDTH, ceil_div, dot_block, scratch

comptime FP8_MAX: Float32 = 448.0
comptime F32V = SIMD[DType.float32, F32_WIDTH]
comptime U32V = SIMD[DType.uint32, F32_WIDTH]
comptime WEIGHT_ROWS_PER_TASK = 64


@fieldwise_init
struct Granularity(TrivialRegisterPassable):
    """Scale granularity `(m, n, k)` of the op; 0 means the whole axis."""

    var m: Int
    var n: Int
    var k: Int

    def resolve(self, m: Int, n: Int, k: Int) -> BlockShape:
        """Block extents for one matmul of `m x k` activations and `n x k` weights."""
        return BlockShape(
            max(m, 1) if self.m == 0 else self.m,
            max(n, 1) if self.n == 0 else self.n,
            max(k, 1) if self.k == 0 else self.k,
        )


@fieldwise_init
struct BlockShape(TrivialRegisterPassable):
    """Elements per scale along M, N and K of one matmul."""

    var m: Int
    var n: Int
    var k: Int


@fieldwise_init
struct StridedMatrices[dtype: DType](TrivialRegisterPassable):
    """Matrices `x[g]` with element `(g, m, c)` at `ptr + g * g_stride + m * m_stride + c`."""

    var ptr: DPtr[Self.dtype]
    var g_stride: Int
    var m_stride: Int

    def row(self, g: Int, m: Int) -> DPtr[Self.dtype]:
        return self.ptr.unsafe_offset(g * self.g_stride + m * self.m_stride)


def round_to_e4m3(x: F32V) -> F32V:
    """The e4m3 value nearest to `x` (ties to even), as float32; `|x| <= 448`.

    Normal range (`|x| >= 2^-6`): round the float32 mantissa to 3 bits in
    integer arithmetic. Subnormal range: the e4m3 quantum is 2^-9, and adding
    then subtracting 2^14 (whose float32 ulp is 2^-9) rounds to it.
    """
    var bits = bitcast[DType.uint32, F32_WIDTH](x)
    var sign = bits & 0x80000000
    var magnitude = bits & 0x7FFFFFFF
    var lsb = (magnitude >> 20) & 1
    var normal = bitcast[DType.float32, F32_WIDTH]((magnitude + 0x7FFFF + lsb) & 0xFFF00000)
    var a = bitcast[DType.float32, F32_WIDTH](magnitude)
    var subnormal = (a + 16384.0) - 16384.0
    var rounded = a.lt(0.015625).select(subnormal, normal)
    return bitcast[DType.float32, F32_WIDTH](bitcast[DType.uint32, F32_WIDTH](rounded) | sign)


def widen_e4m3(bytes: SIMD[DType.uint8, F32_WIDTH]) -> F32V:
    """Widens fp8 e4m3fn bytes to float32, exactly (NaN bytes are not expected in weights).

    Normal values: move exponent and mantissa into float32 position and
    rebias the exponent by 127 - 7; subnormal values are `mantissa * 2^-9`.
    """
    var b = bytes.cast[DType.uint32]()
    var magnitude = b & 0x7F
    var normal = bitcast[DType.float32, F32_WIDTH]((magnitude << 20) + (120 << 23))
    var subnormal = (magnitude & 7).cast[DType.float32]() * 0.001953125
    var value = magnitude.lt(8).select(subnormal, normal)
    return bitcast[DType.float32, F32_WIDTH](bitcast[DType.uint32, F32_WIDTH](value) | ((b & 0x80) << 24))


def quantize_activations[
    dtype: DType
](
    a: StridedMatrices[dtype],
    num_groups: Int,
    num_rows: Int,
    padded_rows: Int,
    depth: Int,
    blocks: BlockShape,
    a_q: FPtr,
    a_scale: FPtr,
) raises:
    """Quantizes `a` into fp8 values kept as float32 in `a_q [G, padded_rows, K]` (padding rows
    stay zero) with scales in `a_scale [G, MB, KB]`."""
    var m_blocks = ceil_div(num_rows, blocks.m)
    var k_blocks = ceil_div(depth, blocks.k)

    def block_row_task(i: Int) {var a, var num_rows, var padded_rows, var depth, var blocks, var a_q, var a_scale, var m_blocks, var k_blocks}:
        comptime W = F32_WIDTH
        var g = i // m_blocks
        var mb = i % m_blocks
        var m0 = mb * blocks.m
        var m1 = min(m0 + blocks.m, num_rows)
        for kb in range(k_blocks):
            var k0 = kb * blocks.k
            var k1 = min(k0 + blocks.k, depth)
            var vec_end = k0 + (k1 - k0) - (k1 - k0) % W
            var amax = Float32(0)
            for m in range(m0, m1):
                var src = a.row(g, m)
                var vmax = F32V(0)
                for k in range(k0, vec_end, W):
                    vmax = max(vmax, abs(src.unsafe_load[width=W](k).cast[DType.float32]()))
                amax = max(amax, vmax.reduce_max())
                for k in range(vec_end, k1):
                    amax = max(amax, abs(src.unsafe_load(k).cast[DType.float32]()))
            var s = amax / FP8_MAX if amax > 0 else Float32(1)
            a_scale.unsafe_store((g * m_blocks + mb) * k_blocks + kb, s)
            for m in range(m0, m1):
                var src = a.row(g, m)
                var dst = a_q.unsafe_offset((g * padded_rows + m) * depth)
                for k in range(k0, vec_end, W):
                    var x = src.unsafe_load[width=W](k).cast[DType.float32]() / s
                    dst.unsafe_store(k, round_to_e4m3(min(max(x, -FP8_MAX), FP8_MAX)))
                for k in range(vec_end, k1):
                    var x = F32V(src.unsafe_load(k).cast[DType.float32]() / s)
                    dst.unsafe_store(k, round_to_e4m3(min(max(x, -FP8_MAX), FP8_MAX))[0])

    sync_parallelize(block_row_task, num_groups * m_blocks)


def widen_weight_rows(w: U8Ptr, dst: FPtr, num_rows: Int, depth: Int):
    """Widens `num_rows` consecutive rows of fp8 weight bytes to float32."""
    comptime W = F32_WIDTH
    var total = num_rows * depth
    var i = 0
    while i + W <= total:
        dst.unsafe_store(i, widen_e4m3(w.unsafe_load[width=W](i)))
        i += W
    while i < total:
        dst.unsafe_store(i, widen_e4m3(SIMD[DType.uint8, W](w.unsafe_load(i)))[0])
        i += 1


def fp8_batched_matmul[
    in_dtype: DType, out_dtype: DType
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
) raises:
    """`c[g, m, n] = sum_kb sa[g, m, kb] * sw[g, n, kb] * sum_{k in kb} a_q[g, m, k] * w[g, n, k]`.

    Quantizes `a` first. Each task widens a slice of weight rows of one head
    once and multiplies it with every token in 4 x 4 register blocks, so the
    weights are read once per call.
    """
    var m_blocks = ceil_div(num_rows, blocks.m)
    var n_blocks = ceil_div(n_out, blocks.n)
    var k_blocks = ceil_div(depth, blocks.k)
    var padded_rows = ceil_div(num_rows, DOT_ROWS) * DOT_ROWS
    var a_q_buf = List[Float32](length=max(num_groups * padded_rows * depth, 1), fill=0)
    var a_scale_buf = List[Float32](length=max(num_groups * m_blocks * k_blocks, 1), fill=0)
    var a_q = scratch(a_q_buf)
    var a_scale = scratch(a_scale_buf)
    quantize_activations[in_dtype](a, num_groups, num_rows, padded_rows, depth, blocks, a_q, a_scale)

    var slices = ceil_div(n_out, WEIGHT_ROWS_PER_TASK)

    def slice_task(i: Int) {var w, var w_scale, var c, var num_rows, var n_out, var depth, var blocks, var a_q, var a_scale, var m_blocks, var n_blocks, var k_blocks, var padded_rows, var slices}:
        var g = i // slices
        var n0 = (i % slices) * WEIGHT_ROWS_PER_TASK
        var rows = min(WEIGHT_ROWS_PER_TASK, n_out - n0)
        var padded = ceil_div(rows, DOT_COLS) * DOT_COLS
        var w_buf = List[Float32](length=padded * depth, fill=0)
        var w_rows = scratch(w_buf)
        widen_weight_rows(w.unsafe_offset((g * n_out + n0) * depth), w_rows, rows, depth)
        for m0 in range(0, padded_rows, DOT_ROWS):
            var a_rows = a_q.unsafe_offset((g * padded_rows + m0) * depth)
            for j0 in range(0, padded, DOT_COLS):
                var total = Array[Float32, DOT_ROWS * DOT_COLS](fill=0)
                for kb in range(k_blocks):
                    var k0 = kb * blocks.k
                    var k1 = min(k0 + blocks.k, depth)
                    var part = dot_block(
                        a_rows.unsafe_offset(k0), depth, w_rows.unsafe_offset(j0 * depth + k0), depth, k1 - k0
                    )
                    comptime for r in range(DOT_ROWS):
                        var sa = a_scale.unsafe_load((g * m_blocks + min(m0 + r, num_rows - 1) // blocks.m) * k_blocks + kb)
                        comptime for cc in range(DOT_COLS):
                            var n = min(n0 + j0 + cc, n_out - 1)
                            var sw = w_scale.unsafe_load((g * n_blocks + n // blocks.n) * k_blocks + kb)
                            total[r * DOT_COLS + cc] += part[r * DOT_COLS + cc] * (sa * sw)
                comptime for r in range(DOT_ROWS):
                    comptime for cc in range(DOT_COLS):
                        if m0 + r < num_rows and j0 + cc < rows:
                            c.row(g, m0 + r).unsafe_store(n0 + j0 + cc, total[r * DOT_COLS + cc].cast[out_dtype]())
        _ = w_buf^

    sync_parallelize(slice_task, num_groups * slices)
    _ = a_q_buf^
    _ = a_scale_buf^
