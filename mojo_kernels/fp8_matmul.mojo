"""Steps 3 and 6: fp8 batched matmuls with block scales and dynamic activation quantization.

Both projections are `c[g, m, :] = a[g, m, :] @ w[g].T` over heads `g`, with
`w [G, N, K]` fp8 e4m3 (passed as raw bytes) and float32 scales
`w_scale [G, ceil(N / n_block), ceil(K / k_block)]`. The activations are
quantized here, one scale per `m_block x k_block` block:
`s = amax / 448` (1 when amax is 0), `a_q = fp8(clamp(a / s, -448, 448))`.
"""

from std.math import min
from max.algorithm import sync_parallelize

from .common import DPtr, FPtr, U8Ptr, F32_WIDTH, ceil_div, scratch

comptime FP8_MAX: Float32 = 448.0


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


def quantize_activations[
    dtype: DType
](
    a: StridedMatrices[dtype],
    num_groups: Int,
    num_rows: Int,
    depth: Int,
    blocks: BlockShape,
    a_q: FPtr,
    a_scale: FPtr,
) raises:
    """Quantizes `a` to fp8 values kept as float32 in `a_q [G, M, K]`, scales in `a_scale [G, MB, KB]`."""
    var m_blocks = ceil_div(num_rows, blocks.m)
    var k_blocks = ceil_div(depth, blocks.k)

    def block_row_task(i: Int) {var a, var num_rows, var depth, var blocks, var a_q, var a_scale, var m_blocks, var k_blocks}:
        var g = i // m_blocks
        var mb = i % m_blocks
        var m0 = mb * blocks.m
        var m1 = min(m0 + blocks.m, num_rows)
        for kb in range(k_blocks):
            var k0 = kb * blocks.k
            var k1 = min(k0 + blocks.k, depth)
            var amax = Float32(0)
            for m in range(m0, m1):
                var src = a.row(g, m)
                for k in range(k0, k1):
                    amax = max(amax, abs(src.unsafe_load(k).cast[DType.float32]()))
            var s = amax / FP8_MAX if amax > 0 else Float32(1)
            a_scale.unsafe_store((g * m_blocks + mb) * k_blocks + kb, s)
            for m in range(m0, m1):
                var src = a.row(g, m)
                var dst = a_q.unsafe_offset((g * num_rows + m) * depth)
                for k in range(k0, k1):
                    var x = src.unsafe_load(k).cast[DType.float32]() / s
                    x = min(max(x, -FP8_MAX), FP8_MAX)
                    dst.unsafe_store(k, x.cast[DType.float8_e4m3fn]().cast[DType.float32]())

    sync_parallelize(block_row_task, num_groups * m_blocks)


def fp8_weight_row_to_f32(w_row: U8Ptr, dst: FPtr, depth: Int):
    """Widens one row of fp8 e4m3 weight bytes to float32."""
    comptime W = F32_WIDTH
    var src = w_row.unsafe_bitcast[Float8_e4m3fn]()
    var k = 0
    while k + W <= depth:
        dst.unsafe_store(k, src.unsafe_load[width=W](k).cast[DType.float32]())
        k += W
    while k < depth:
        dst.unsafe_store(k, src.unsafe_load(k).cast[DType.float32]())
        k += 1


def dot_f32_f32(a: FPtr, b: FPtr, n: Int) -> Float32:
    comptime W = F32_WIDTH
    var acc = SIMD[DType.float32, W](0)
    var i = 0
    while i + W <= n:
        acc += a.unsafe_load[width=W](i) * b.unsafe_load[width=W](i)
        i += W
    var s = acc.reduce_add()
    while i < n:
        s += a.unsafe_load(i) * b.unsafe_load(i)
        i += 1
    return s


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

    Quantizes `a` first; each task widens a slice of weight rows once and
    reuses it for every token, so the weights are read once per call.
    """
    var m_blocks = ceil_div(num_rows, blocks.m)
    var n_blocks = ceil_div(n_out, blocks.n)
    var k_blocks = ceil_div(depth, blocks.k)
    var a_q_buf = List[Float32](length=max(num_groups * num_rows * depth, 1), fill=0)
    var a_scale_buf = List[Float32](length=max(num_groups * m_blocks * k_blocks, 1), fill=0)
    var a_q = scratch(a_q_buf)
    var a_scale = scratch(a_scale_buf)
    quantize_activations[in_dtype](a, num_groups, num_rows, depth, blocks, a_q, a_scale)

    comptime ROWS_PER_TASK = 32
    var tasks_per_group = ceil_div(n_out, ROWS_PER_TASK)

    def n_slice_task(i: Int) {var w, var w_scale, var c, var num_rows, var n_out, var depth, var blocks, var a_q, var a_scale, var m_blocks, var n_blocks, var k_blocks, var tasks_per_group}:
        var g = i // tasks_per_group
        var n0 = (i % tasks_per_group) * ROWS_PER_TASK
        var n1 = min(n0 + ROWS_PER_TASK, n_out)
        var w_row_buf = List[Float32](length=depth, fill=0)
        var w_row = scratch(w_row_buf)
        for n in range(n0, n1):
            fp8_weight_row_to_f32(w.unsafe_offset((g * n_out + n) * depth), w_row, depth)
            var sw = w_scale.unsafe_offset((g * n_blocks + n // blocks.n) * k_blocks)
            for m in range(num_rows):
                var aq_row = a_q.unsafe_offset((g * num_rows + m) * depth)
                var sa = a_scale.unsafe_offset((g * m_blocks + m // blocks.m) * k_blocks)
                var acc = Float32(0)
                for kb in range(k_blocks):
                    var k0 = kb * blocks.k
                    var k1 = min(k0 + blocks.k, depth)
                    var partial = dot_f32_f32(aq_row.unsafe_offset(k0), w_row.unsafe_offset(k0), k1 - k0)
                    acc += partial * (sa.unsafe_load(kb) * sw.unsafe_load(kb))
                c.row(g, m).unsafe_store(n, acc.cast[out_dtype]())
        _ = w_row_buf^

    sync_parallelize(n_slice_task, num_groups * tasks_per_group)
    _ = a_q_buf^
    _ = a_scale_buf^
