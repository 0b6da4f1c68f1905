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
