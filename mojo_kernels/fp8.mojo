"""The fp8 e4m3fn activation scale rule and exact conversions to and from float32.

The rule of `pymla/quant.py`, written once for both targets: a block of
activations whose largest magnitude is `amax` gets the scale `amax / 448`
(1 for an all-zero block); each value is divided by it, clamped to
`[-448, 448]` and rounded to the nearest e4m3 value (ties to even). The GPU
kernels divide by a `Divisor` (one reciprocal per scale, the same e4m3 values)
and round with the hardware conversion; the CPU divides and rounds with
`round_to_e4m3`.
"""

from std.memory import bitcast

comptime FP8_MAX: Float32 = 448.0


@always_inline
def activation_scale(amax: Float32) -> Float32:
    """The scale of an activation block whose largest magnitude is `amax`."""
    return amax / FP8_MAX if amax > 0 else Float32(1)


@always_inline
def into_e4m3_range[w: Int](q: SIMD[DType.float32, w]) -> SIMD[DType.float32, w]:
    """`q` clamped to e4m3's range `[-448, 448]`."""
    return min(max(q, -FP8_MAX), FP8_MAX)


@always_inline
def scaled_into_range[w: Int](x: SIMD[DType.float32, w], scale: Float32) -> SIMD[DType.float32, w]:
    """`x / scale`, clamped to e4m3's range: the value that is then rounded to e4m3."""
    return into_e4m3_range[w](x / scale)


comptime DIVISOR_MIN = Float32(2.0**-92)  # `Divisor`: the range where one reciprocal serves (see there)
comptime DIVISOR_MAX = Float32(2.0**120)
comptime DIVISOR_UP = Float32(2.0**72)  # k below DIVISOR_MIN: the least float32 scale, 2^-149 / 448 = 2^-157.8, to 2^-85.8
comptime DIVISOR_DOWN = Float32(2.0**-64)  # k above DIVISOR_MAX: the greatest, 2^128 / 448 = 2^119.2, to 2^55.2
comptime DIVISOR_EXACT_FROM = Float32(2.0**-12)
"""`Divisor.quotient` equals `x / d` bit for bit for quotients of this magnitude and up (below, where a last-bit
difference can remain, every quotient rounds to a zero e4m3)."""


@fieldwise_init
struct Divisor(TrivialRegisterPassable):
    """Many float32 values divided by one `d`, each as `x / d` rounds it, with one division in all.

    `q = RN(x r)` with `r = RN(1 / d)`, then one correction by the exact residual `e = fma(q, d, -x)`:
    `RN(q - e r)` is `RN(x / d)` (Markstein's theorem) wherever `e` is a normal float32. With `d` in
    `[2^-92, 2^120]` that holds for every quotient of magnitude at least 2^-12; below it a last-bit
    difference can remain, which no rounding to e4m3 sees (those quotients round to zero). A `d`
    outside that range is brought into it by an exact power of two `k` applied to `d` and to every
    `x` (`(k x) / (k d)` is the same real number). Signed zeros come out as `x / d` gives them.
    Checked on the CPU against `x / d`: every bfloat16 `x` with `|x| <= 448 d` for 3000 scales and
    64 M random float32 `x` (178 M quotients: e4m3 bytes all equal, float32 quotients equal from
    2^-12 up). The GPU's quantizations take it: four instructions a value where `div.rn.f32` is about
    ten and a branch.
    """

    var d: Float32  # k times the divisor
    var r: Float32  # RN(1 / d)
    var k: Float32  # 1, or the power of two that brought the divisor into [DIVISOR_MIN, DIVISOR_MAX]

    @staticmethod
    @always_inline
    def of(divisor: Float32) -> Self:
        var k = Float32(1)
        if divisor < DIVISOR_MIN:
            k = DIVISOR_UP
        elif divisor > DIVISOR_MAX:
            k = DIVISOR_DOWN
        var d = divisor * k
        return Self(d, Float32(1) / d, k)

    @always_inline
    def quotient[w: Int](self, x: SIMD[DType.float32, w]) -> SIMD[DType.float32, w]:
        """`x / divisor`, rounded as the division rounds it (see the struct)."""
        var xk = x * self.k
        var q = xk * self.r
        var e = q.fma(self.d, -xk)
        return (-e).fma(SIMD[DType.float32, w](self.r), q)


@always_inline
def e4m3_as_f16[w: Int](x: SIMD[DType.float32, w], scale: Divisor) -> SIMD[DType.float16, w]:
    """`x` quantized with `scale` (`scaled_into_range`, its division by `Divisor`, then the hardware's
    rounding to e4m3), held in float16, where every e4m3 value is exact: the activations the GPU's
    tensor-core projections read."""
    return into_e4m3_range[w](scale.quotient[w](x)).cast[DType.float8_e4m3fn]().cast[DType.float16]()


def round_to_e4m3[w: Int](x: SIMD[DType.float32, w]) -> SIMD[DType.float32, w]:
    """The e4m3 value nearest to `x` (ties to even), as float32; `|x| <= 448`.

    Normal range (`|x| >= 2^-6`): round the float32 mantissa to 3 bits in
    integer arithmetic. Subnormal range: the e4m3 quantum is 2^-9, and adding
    then subtracting 2^14 (whose float32 ulp is 2^-9) rounds to it.
    """
    var bits = bitcast[DType.uint32, w](x)
    var sign = bits & 0x80000000
    var magnitude = bits & 0x7FFFFFFF
    var lsb = (magnitude >> 20) & 1
    var normal = bitcast[DType.float32, w]((magnitude + 0x7FFFF + lsb) & 0xFFF00000)
    var a = bitcast[DType.float32, w](magnitude)
    var subnormal = (a + 16384.0) - 16384.0
    var rounded = a.lt(0.015625).select(subnormal, normal)
    return bitcast[DType.float32, w](bitcast[DType.uint32, w](rounded) | sign)


def widen_e4m3[w: Int](bytes: SIMD[DType.uint8, w]) -> SIMD[DType.float32, w]:
    """Widens fp8 e4m3fn bytes to float32, exactly (NaN bytes are not expected in weights).

    Normal values: move exponent and mantissa into float32 position and
    rebias the exponent by 127 - 7; subnormal values are `mantissa * 2^-9`.
    """
    var b = bytes.cast[DType.uint32]()
    var magnitude = b & 0x7F
    var normal = bitcast[DType.float32, w]((magnitude << 20) + (120 << 23))
    var subnormal = (magnitude & 7).cast[DType.float32]() * 0.001953125
    var value = magnitude.lt(8).select(subnormal, normal)
    return bitcast[DType.float32, w](bitcast[DType.uint32, w](value) | ((b & 0x80) << 24))


@always_inline
def bf16_scale_shift(scale: Float32) -> Int:
    """`k` when `scale = 2^k` and every nonzero `e4m3 * scale` is a normal bfloat16 (`-120 <= k <= 119`),
    else `NO_SHIFT`: the cases `widen_e4m3_bf16` serves."""
    var bits = bitcast[DType.uint32](scale)
    if bits & 0x807FFFFF != 0:  # negative, or not a power of two (or subnormal)
        return NO_SHIFT
    var k = Int(bits >> 23) - 127
    return k if k >= -120 and k <= 119 else NO_SHIFT


comptime NO_SHIFT = 1 << 20


@always_inline
def widen_e4m3_bf16[w: Int](bytes: SIMD[DType.uint8, w], k: Int) -> SIMD[DType.bfloat16, w]:
    """`e4m3 * 2^k` as bfloat16, exactly, in 16-bit integer arithmetic (`k` from `bf16_scale_shift`).

    A normal e4m3 (exponent field `e >= 1`, mantissa `m`) is `1.m * 2^(e - 7)`:
    the bfloat16 with exponent field `e + 120 + k` and mantissa `m << 4`. The
    byte sign-extended to 16 bits and shifted left by 4 holds the sign at bit
    15 and `e, m` at bits 7..10 and 4..6 (mask `0x87F0`); adding `(120 + k) << 7`
    rebiases the exponent, which stays within 1..254 and never reaches the
    sign. Vectors with a zero or subnormal byte (`e == 0`: rare in a cache
    block scaled to its largest value) take `widen_e4m3_bf16_any`.
    """
    if has_zero_exponent[w](bytes):
        return widen_e4m3_bf16_any[w](bytes, k)
    return widen_e4m3_bf16_normal[w](bytes, k)


@always_inline
def has_zero_exponent[w: Int](bytes: SIMD[DType.uint8, w]) -> Bool:
    """Whether any byte is a zero or subnormal e4m3 (exponent field 0): `widen_e4m3_bf16_normal` serves the rest."""
    return (bytes & 0x78).eq(0).reduce_or()


@always_inline
def widen_e4m3_bf16_normal[w: Int](bytes: SIMD[DType.uint8, w], k: Int) -> SIMD[DType.bfloat16, w]:
    """`widen_e4m3_bf16` of bytes that are all normal e4m3 (`not has_zero_exponent(bytes)`): the bit arithmetic alone."""
    var extended = bitcast[DType.uint16, w](bitcast[DType.int8, w](bytes).cast[DType.int16]())
    return bitcast[DType.bfloat16, w](((extended << 4) & 0x87F0) + UInt16((120 + k) << 7))


@always_inline
def widen_e4m3_bf16_any[w: Int](bytes: SIMD[DType.uint8, w], k: Int) -> SIMD[DType.bfloat16, w]:
    """`widen_e4m3_bf16` for any bytes: a subnormal e4m3 is `m * 2^-9`, converted through float32
    (exact: 3 bits); zero stays zero."""
    var b = bytes.cast[DType.uint16]()
    var magnitude = b & 0x7F
    var normal = (magnitude << 4) + UInt16((120 + k) << 7)
    var subnormal = bitcast[DType.uint16, w]((magnitude.cast[DType.float32]() * power_of_two(k - 9)).cast[DType.bfloat16]())
    return bitcast[DType.bfloat16, w](magnitude.lt(8).select(subnormal, normal) | ((b & 0x80) << 8))


@always_inline
def power_of_two(e: Int) -> Float32:
    """`2^e` as float32, exactly, for `-149 <= e <= 127` (subnormal below -126)."""
    if e >= -126:
        return bitcast[DType.float32](UInt32(e + 127) << 23)
    return bitcast[DType.float32](UInt32(1) << UInt32(e + 149))


def cache_block_scale(amax: Float32) -> Float32:
    """The `fp8_ds_mla` cache's scale of a block of 128 latent values (`pymla/cache_format.py`).

    `2^e` for the smallest integer `e` with `amax <= 448 * 2^e`; 1 when
    `amax == 0`. With `amax = 1.m * 2^(E - 127)` (float32 fields `E`, `m`):
    `e = E - 135` when `1.m <= 1.75` (448 = 1.75 * 2^8), else `E - 134`.
    """
    if amax == 0:
        return 1
    var a = amax
    var shift = 0
    if a < Float32(1.1754943508222875e-38):  # subnormal: scale by 2^64 (exact) first
        a = a * Float32(18446744073709551616.0)
        shift = 64
    var bits = bitcast[DType.uint32](a)
    var exponent = Int((bits >> 23) & 0xFF)
    var e = exponent - 135 if (bits & 0x7FFFFF) <= 0x600000 else exponent - 134
    return power_of_two(e - shift)


def e4m3_bytes[w: Int](v: SIMD[DType.float32, w]) -> SIMD[DType.uint8, w]:
    """The e4m3fn bytes of values that are e4m3 values already (`round_to_e4m3`'s results).

    Normal values (`|v| >= 2^-6`): the float32 exponent rebiased by 127 - 7
    and the top 3 mantissa bits; subnormal values: `|v| / 2^-9`; the sign on top.
    """
    var bits = bitcast[DType.uint32, w](v)
    var sign = (bits >> 24) & 0x80
    var magnitude = bits & 0x7FFFFFFF
    var a = bitcast[DType.float32, w](magnitude)
    var normal = (((magnitude >> 23) - 120) << 3) | ((magnitude >> 20) & 7)
    var subnormal = (a * 512.0).cast[DType.uint32]()
    return (sign | a.lt(0.015625).select(subnormal, normal)).cast[DType.uint8]()
