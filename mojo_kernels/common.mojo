"""Pointer aliases and integer helpers shared by every target."""

from std.memory import Pointer

comptime FPtr = Pointer[Float32, MutUntrackedOrigin]
"""An untracked pointer to float32 scratch or tensor data."""

comptime DPtr[dtype: DType] = Pointer[Scalar[dtype], MutUntrackedOrigin]
"""An untracked pointer to tensor data of `dtype`."""

comptime U32Ptr = Pointer[UInt32, MutUntrackedOrigin]
comptime IPtr = Pointer[Int, MutUntrackedOrigin]
comptime U8Ptr = Pointer[UInt8, MutUntrackedOrigin]


def ceil_div(a: Int, b: Int) -> Int:
    return (a + b - 1) // b


@always_inline
def div_u32(a: Int, b: Int) -> Int:
    """`a // b` for `0 <= a < 2^32` and `0 < b < 2^32`, as a 32-bit division: an index's quotient in a
    GPU kernel, where a 64-bit division of runtime values is a subroutine call."""
    return Int(UInt32(a) // UInt32(b))


@always_inline
def ceil_div_u32(a: Int, b: Int) -> Int:
    """`ceil_div` by a 32-bit division (`div_u32`'s range)."""
    return div_u32(a + b - 1, b)
