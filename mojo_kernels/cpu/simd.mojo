"""Host SIMD helpers of the CPU stages: scratch pointers, the task runner, register-blocked dot products."""

from std.sys.info import simd_width_of
from max.algorithm import sync_parallelize

from ..common import DPtr, FPtr

comptime F32_WIDTH = simd_width_of[DType.float32]()
"""Float32 lanes of one SIMD register on the host."""


def scratch(mut buffer: List[Float32]) -> FPtr:
    """An untracked pointer into a float32 scratch list (the list keeps ownership)."""
    return buffer.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()


def scratch_of[dtype: DType](mut buffer: List[Scalar[dtype]]) -> DPtr[dtype]:
    """An untracked pointer into a scratch list of `dtype` (the list keeps ownership)."""
    return buffer.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()


comptime PARALLEL_MIN_WORK = 1 << 18
"""Below this many values touched, a stage runs in the calling thread: a
parallel dispatch and its barrier cost more than the work (tens of
microseconds on a quiet machine, milliseconds when the cores are shared)."""


@always_inline
def run_tasks[FuncType: def(Int) raises -> None](func: FuncType, count: Int, work: Int) raises:
    """`func(0) .. func(count - 1)`: in parallel (`sync_parallelize`), or in
    this thread when `work` (values the stage touches) is below PARALLEL_MIN_WORK."""
    if work < PARALLEL_MIN_WORK or count <= 1:
        for i in range(count):
            func(i)
    else:
        sync_parallelize(func, count)


comptime DOT_ROWS = 4
"""Rows of `a` per full register block of `dot_block`."""
comptime DOT_COLS = 4
"""Rows of `b` per full register block of `dot_block`."""


comptime F32Vec = SIMD[DType.float32, F32_WIDTH]


@always_inline
def dot_lanes[
    rows: Int, cols: Int
](a: FPtr, a_stride: Int, b: FPtr, b_stride: Int, depth: Int) -> Array[F32Vec, rows * cols]:
    """Lane-wise partial sums of `<a[r, :depth], b[c, :depth]>` for a `rows x cols` block.

    The micro-kernel of the float32 attention scores and of the fp8 matmuls
    (on weights widened once per call): each step loads
    `rows + cols` vectors and does `rows * cols` FMAs in registers. A tail of
    `depth` past the last whole vector is added into lane 0. Summing the
    lanes (`reduce_add`) gives the dot products.
    """
    comptime W = F32_WIDTH
    var acc = Array[F32Vec, rows * cols](fill=F32Vec(0))
    var main = depth - depth % W
    for d in range(0, main, W):
        var av = Array[F32Vec, rows](fill=F32Vec(0))
        comptime for r in range(rows):
            av[r] = a.unsafe_load[width=W](r * a_stride + d)
        comptime for c in range(cols):
            var bv = b.unsafe_load[width=W](c * b_stride + d)
            comptime for r in range(rows):
                acc[r * cols + c] += av[r] * bv
    for d in range(main, depth):
        comptime for r in range(rows):
            comptime for c in range(cols):
                acc[r * cols + c][0] += a.unsafe_load(r * a_stride + d) * b.unsafe_load(c * b_stride + d)
    return acc^


@always_inline
def sum_lanes_of_16(v: Array[SIMD[DType.float32, 16], 16]) -> SIMD[DType.float32, 16]:
    """`out[i] = v[i].reduce_add()`: a transposing tree of 15 adds (8 + 4 + 2 + 1 vectors).

    Level by level, pairs of vectors are split into their even and odd
    blocks of 8, 4, 2, 1 lanes and added, so that each output vector holds
    the partial sums of twice as many inputs in half as many lanes.
    """
    var l8 = Array[SIMD[DType.float32, 16], 8](fill=SIMD[DType.float32, 16](0))
    comptime for i in range(8):
        var x = v[2 * i]
        var y = v[2 * i + 1]
        l8[i] = x.shuffle[0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23](y) + x.shuffle[
            8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
        ](y)
    var l4 = Array[SIMD[DType.float32, 16], 4](fill=SIMD[DType.float32, 16](0))
    comptime for i in range(4):
        var x = l8[2 * i]
        var y = l8[2 * i + 1]
        l4[i] = x.shuffle[0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27](y) + x.shuffle[
            4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
        ](y)
    var l2 = Array[SIMD[DType.float32, 16], 2](fill=SIMD[DType.float32, 16](0))
    comptime for i in range(2):
        var x = l4[2 * i]
        var y = l4[2 * i + 1]
        l2[i] = x.shuffle[0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29](y) + x.shuffle[
            2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
        ](y)
    var x = l2[0]
    var y = l2[1]
    return x.shuffle[0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30](y) + x.shuffle[
        1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
    ](y)


@always_inline
def dot_block[
    rows: Int, cols: Int
](a: FPtr, a_stride: Int, b: FPtr, b_stride: Int, depth: Int) -> Array[Float32, rows * cols]:
    """`dots[r * cols + c] = <a[r, :depth], b[c, :depth]>` for a `rows x cols` block (see `dot_lanes`)."""
    var acc = dot_lanes[rows, cols](a, a_stride, b, b_stride, depth)
    return sum_lanes(acc)


@always_inline
def sum_lanes[n: Int](v: Array[F32Vec, n]) -> Array[Float32, n]:
    """`out[i] = v[i].reduce_add()`; 16 vectors of 16 lanes through `sum_lanes_of_16`."""
    var out = Array[Float32, n](fill=0)
    comptime if n == 16 and F32_WIDTH == 16:
        var w = Array[SIMD[DType.float32, 16], 16](fill=SIMD[DType.float32, 16](0))
        comptime for i in range(16):
            w[i] = rebind[SIMD[DType.float32, 16]](v[i])
        var sums = sum_lanes_of_16(w)
        comptime for i in range(16):
            out[i] = sums[i]
    else:
        comptime for i in range(n):
            out[i] = v[i].reduce_add()
    return out^
