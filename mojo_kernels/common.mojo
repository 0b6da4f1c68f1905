"""Pointer aliases and small SIMD helpers shared by the stages."""

from std.memory import Pointer
from std.sys.info import simd_width_of

comptime FPtr = Pointer[Float32, MutUntrackedOrigin]
"""An untracked pointer to float32 scratch or tensor data."""

comptime DPtr[dtype: DType] = Pointer[Scalar[dtype], MutUntrackedOrigin]
"""An untracked pointer to tensor data of `dtype`."""

comptime U32Ptr = Pointer[UInt32, MutUntrackedOrigin]
comptime U8Ptr = Pointer[UInt8, MutUntrackedOrigin]

comptime F32_WIDTH = simd_width_of[DType.float32]()
"""Float32 lanes of one SIMD register on the host."""


def scratch(mut buffer: List[Float32]) -> FPtr:
    """An untracked pointer into a float32 scratch list (the list keeps ownership)."""
    return buffer.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()


def ceil_div(a: Int, b: Int) -> Int:
    return (a + b - 1) // b


def dot_f32[
    dtype: DType
](a: FPtr, b: DPtr[dtype], n: Int) -> Float32:
    """Sum of a[i] * b[i] in float32, b converted from `dtype`."""
    comptime W = F32_WIDTH
    var acc0 = SIMD[DType.float32, W](0)
    var acc1 = SIMD[DType.float32, W](0)
    var i = 0
    while i + 2 * W <= n:
        acc0 += a.unsafe_load[width=W](i) * b.unsafe_load[width=W](i).cast[DType.float32]()
        acc1 += a.unsafe_load[width=W](i + W) * b.unsafe_load[width=W](i + W).cast[DType.float32]()
        i += 2 * W
    while i + W <= n:
        acc0 += a.unsafe_load[width=W](i) * b.unsafe_load[width=W](i).cast[DType.float32]()
        i += W
    var s = (acc0 + acc1).reduce_add()
    while i < n:
        s += a.unsafe_load(i) * b.unsafe_load(i).cast[DType.float32]()
        i += 1
    return s


comptime DOT_ROWS = 4
"""Rows of `a` per register block of `dot_block`."""
comptime DOT_COLS = 4
"""Rows of `b` per register block of `dot_block`."""


def dot_block(
    a: FPtr, a_stride: Int, b: FPtr, b_stride: Int, depth: Int
) -> Array[Float32, DOT_ROWS * DOT_COLS]:
    """`dots[r * DOT_COLS + c] = <a[r, :depth], b[c, :depth]>` for a 4 x 4 block of rows.

    The micro-kernel of both the attention scores and the fp8 matmuls: each
    step loads 4 + 4 vectors and does 16 FMAs in registers.
    """
    comptime W = F32_WIDTH
    var acc = Array[SIMD[DType.float32, W], DOT_ROWS * DOT_COLS](fill=SIMD[DType.float32, W](0))
    var main = depth - depth % W
    for d in range(0, main, W):
        var av = Array[SIMD[DType.float32, W], DOT_ROWS](fill=SIMD[DType.float32, W](0))
        comptime for r in range(DOT_ROWS):
            av[r] = a.unsafe_load[width=W](r * a_stride + d)
        comptime for c in range(DOT_COLS):
            var bv = b.unsafe_load[width=W](c * b_stride + d)
            comptime for r in range(DOT_ROWS):
                acc[r * DOT_COLS + c] += av[r] * bv
    var dots = Array[Float32, DOT_ROWS * DOT_COLS](fill=0)
    comptime for i in range(DOT_ROWS * DOT_COLS):
        dots[i] = acc[i].reduce_add()
    for d in range(main, depth):
        comptime for r in range(DOT_ROWS):
            comptime for c in range(DOT_COLS):
                dots[r * DOT_COLS + c] += a.unsafe_load(r * a_stride + d) * b.unsafe_load(c * b_stride + d)
    return dots^
