"""Conversions fp8 e4m3fn <-> float32, vectorized and exact (the rounding of `pymla/quant.py`)."""

from std.memory import bitcast
from std.sys.info import simd_width_of

comptime F32_WIDTH = simd_width_of[DType.float32]()

comptime FP8_MAX: Float32 = 448.0
comptime F32V = SIMD[DType.float32, F32_WIDTH]


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
