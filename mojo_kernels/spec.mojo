"""The op's shared vocabulary: mask and score-mod codes, ALiBi, the scale granularity, the RoPE pair.

Target-neutral: the CPU stages (`cpu/`) and the GPU kernels (`gpu/`) read the
options through these, and `pymla/args.py` holds the same codes on the
Python side (a test compares them).
"""


comptime MASK_NULL = 0
comptime MASK_CAUSAL = 1
comptime MASK_SLIDING_WINDOW_CAUSAL = 2
comptime MASK_CHUNKED_CAUSAL = 3
comptime SCORE_MOD_NO_POS = 0
comptime SCORE_MOD_ALIBI_POS = 1


def alibi_slope(head: Int, num_heads: Int) -> Float32:
    """ALiBi slope of `head` (see `pymla.reference.alibi_slopes`)."""
    var n = 1
    while n * 2 <= num_heads:
        n *= 2
    if head < n:
        return Float32(2.0) ** (Float32(-8.0) * Float32(head + 1) / Float32(n))
    return Float32(2.0) ** (Float32(-8.0) * Float32(2 * (head - n) + 1) / Float32(2 * n))


@fieldwise_init
struct MaskSpec(TrivialRegisterPassable):
    """Mask variant (one of the MASK_* codes) and its window or chunk size.

    Shared by the CPU stages and the GPU kernels (`gpu/addressing.row_attention_meta`).
    """

    var kind: Int
    var window: Int

    def key_range(self, position: Int, visible: Int) -> Tuple[Int, Int]:
        """Half-open range of key positions a query at `position` attends to."""
        if self.kind == MASK_NULL:
            return (0, visible)
        if self.kind == MASK_SLIDING_WINDOW_CAUSAL:
            return (max(0, position - self.window + 1), position + 1)
        if self.kind == MASK_CHUNKED_CAUSAL and self.window > 0:
            return ((position // self.window) * self.window, position + 1)
        return (0, position + 1)


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


@always_inline
def rope_pair[
    w: Int = 1
](x0: SIMD[DType.float32, w], x1: SIMD[DType.float32, w], c: SIMD[DType.float32, w], s: SIMD[DType.float32, w]) -> Tuple[
    SIMD[DType.float32, w], SIMD[DType.float32, w]
]:
    """Interleaved RoPE pairs (`w` of them, one per lane) rotated by `(cos, sin) = (c, s)`: `(x0 c - x1 s, x0 s + x1 c)`."""
    return (x0 * c - x1 * s, x0 * s + x1 * c)
