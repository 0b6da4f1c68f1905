"""Host SIMD helpers of the CPU stages: the task runner, register-blocked dot products."""

from std.atomic import Atomic
from std.sys import llvm_intrinsic, num_physical_cores
from std.sys.info import simd_width_of
from std.utils import IndexList
from max.algorithm import sync_parallelize

from ..common import DPtr, FPtr
from ..fp8 import widen_e4m3, widen_e4m3_bf16

comptime F32_WIDTH = simd_width_of[DType.float32]()
"""Float32 lanes of one SIMD register on the host."""


comptime PARALLEL_MIN_WORK = 1 << 18
"""Below this many values touched, a stage runs in the calling thread: a
parallel dispatch and its barrier cost more than the work (tens of
microseconds on a quiet machine, milliseconds when the cores are shared)."""


@always_inline
def run_tasks[FuncType: def(Int) raises -> None](func: FuncType, count: Int, work: Int) raises:
    """`func(0) .. func(count - 1)`: in parallel, or in this thread when `work` (values the stage
    touches) is below PARALLEL_MIN_WORK. In parallel, one runtime task per core (`sync_parallelize`)
    takes the next index from a shared counter until none is left: a core that finishes early takes
    more, and the runtime creates and wakes `cores` tasks, not `count`."""
    if work < PARALLEL_MIN_WORK or count <= 1:
        for i in range(count):
            func(i)
        return
    var workers = min(count, num_physical_cores())
    var next = Atomic[Int64](0)
    var counter = Pointer(to=next).unsafe_origin_cast[MutUntrackedOrigin]()

    def worker(w: Int) raises {imm func, var counter, var count}:
        while True:
            var i = Int(counter[].fetch_add(1))
            if i >= count:
                return
            func(i)

    sync_parallelize(worker, workers)
    _ = next.load()  # the counter lives until every worker is done


comptime DOT_ROWS = 4
"""Rows of `a` per full register block of `dot_block`."""
comptime DOT_COLS = 4 if F32_WIDTH >= 16 else 2
"""Rows of `b` per full register block of `dot_block`: `DOT_ROWS x DOT_COLS` accumulators, `DOT_ROWS + 1`
operand vectors. 4 with AVX-512's 32 vector registers; 2 with AVX2's 16, where a 4 x 4 block spills: the
float32 path on this project's 2-core AMD EPYC with the kernel built for `znver3` (AVX2; scores and P V
together, COL_BLOCK), whole op from memory, batch 8, 16k, alternated: 16 heads 50.4-52.3 -> 33.4-34.1 ms,
128 heads 348-357 -> 213-220 ms (benchmarks/results/cpu-2026-12-08d-avx2-blocks)."""


comptime F32Vec = SIMD[DType.float32, F32_WIDTH]


def cast_copy[src_dtype: DType, dst_dtype: DType](src: DPtr[src_dtype], dst: DPtr[dst_dtype], count: Int):
    """`dst[i] = src[i]` cast to `dst_dtype` for `count` values, vectorized (exact for the widenings
    to float32, and for narrowing values that the narrower dtype holds)."""
    comptime W = F32_WIDTH
    var main = count - count % W
    for i in range(0, main, W):
        dst.unsafe_store(i, src.unsafe_load[width=W](i).cast[dst_dtype]())
    for i in range(main, count):
        dst.unsafe_store(i, src.unsafe_load(i).cast[dst_dtype]())


@always_inline
def dpbf16(acc: SIMD[DType.float32, 16], a: SIMD[DType.bfloat16, 32], b: SIMD[DType.bfloat16, 32]) -> SIMD[DType.float32, 16]:
    """`acc[i] + a[2i] b[2i] + a[2i+1] b[2i+1]`, products exact, sums in float32 (`vdpbf16ps`, AVX512-BF16)."""
    return llvm_intrinsic["llvm.x86.avx512bf16.dpbf16ps.512", SIMD[DType.float32, 16]](acc, a, b)


@always_inline
def load_as[elem: DType, width: Int, stored: DType](p: DPtr[stored], i: Int) -> SIMD[elem, width]:
    """`width` values of `p` from `i` as `elem`: loaded as they are (`stored == elem`), or fp8 e4m3
    bytes (`stored` uint8) widened exactly as `fp8_matmul.widen_weight_rows` widens them."""
    comptime if stored == elem:
        return rebind[SIMD[elem, width]](p.unsafe_load[width=width](i))
    else:
        comptime assert stored == DType.uint8, "values are stored as they are read, or as fp8 e4m3 bytes"
        var bytes = rebind[SIMD[DType.uint8, width]](p.unsafe_load[width=width](i))
        comptime if elem == DType.bfloat16:
            return rebind[SIMD[elem, width]](widen_e4m3_bf16[width](bytes, 0))
        else:
            return widen_e4m3[width](bytes).cast[elem]()


@always_inline
def dot_lanes[
    rows: Int, cols: Int, elem: DType = DType.float32, b_stored: DType = elem
](
    a: DPtr[elem],
    a_stride: Int,
    b: DPtr[b_stored],
    b_stride: Int,
    depth: Int,
) -> Array[F32Vec, rows * cols]:
    """Lane-wise partial sums of `<a[r, :depth], b[c, :depth]>` for a `rows x cols` block.

    The micro-kernel of the float32 attention scores and of the fp8 matmuls:
    each step loads `rows + cols` vectors and does `rows * cols`
    multiply-adds in registers: float32 FMAs, or for `elem` bfloat16
    (AVX512-BF16 only) `vdpbf16ps` on 32 values (lane `i` adds the products
    of values `2i` and `2i + 1`). `b` holds `elem` values (the matmuls'
    weights widened once per call) or, with `b_stored` uint8, fp8 e4m3 bytes
    widened in registers as they are loaded (`load_as`). A tail of `depth`
    past the last whole step is added into lane 0. Summing the lanes
    (`reduce_add`) gives the dot products.
    """
    comptime W = F32_WIDTH
    comptime STEP = 2 * W if elem == DType.bfloat16 else W
    var acc = Array[F32Vec, rows * cols](fill=F32Vec(0))
    var main = depth - depth % STEP
    for d in range(0, main, STEP):
        var av = Array[SIMD[elem, STEP], rows](fill=SIMD[elem, STEP](0))
        comptime for r in range(rows):
            av[r] = a.unsafe_load[width=STEP](r * a_stride + d)
        comptime for c in range(cols):
            var bv = load_as[elem, STEP](b, c * b_stride + d)
            comptime for r in range(rows):
                comptime if elem == DType.bfloat16:
                    acc[r * cols + c] = rebind[F32Vec](
                        dpbf16(
                            rebind[SIMD[DType.float32, 16]](acc[r * cols + c]),
                            rebind[SIMD[DType.bfloat16, 32]](av[r]),
                            rebind[SIMD[DType.bfloat16, 32]](bv),
                        )
                    )
                else:
                    acc[r * cols + c] += rebind[F32Vec](av[r]) * rebind[F32Vec](bv)
    for d in range(main, depth):
        comptime for r in range(rows):
            comptime for c in range(cols):
                var x = a.unsafe_load(r * a_stride + d).cast[DType.float32]()
                acc[r * cols + c][0] += x * load_as[elem, 1](b, c * b_stride + d).cast[DType.float32]()
    return acc^


def half_blocks[block: Int, parity: Int]() -> IndexList[16]:
    """Shuffle mask over the 32 lanes of `x` then `y`: their even (`parity` 0) or odd (1) blocks of `block` lanes."""
    var mask = IndexList[16]()
    for i in range(16):
        mask[i] = (2 * (i // block) + parity) * block + i % block
    return mask


@always_inline
def sum_lanes_of_16(v: Array[SIMD[DType.float32, 16], 16]) -> SIMD[DType.float32, 16]:
    """`out[i] = v[i].reduce_add()`: a transposing tree of 15 adds (8 + 4 + 2 + 1 vectors).

    Level by level, pairs of vectors are split into their even and odd
    blocks of 8, 4, 2, 1 lanes and added, so that each output vector holds
    the partial sums of twice as many inputs in half as many lanes.
    """
    var level = v.copy()
    comptime for step in range(4):
        comptime block = 8 >> step  # lanes per block; also the number of vector pairs at this level
        comptime for i in range(block):  # writes vector i after reading 2i and 2i + 1 (>= i)
            var x = level[2 * i]
            var y = level[2 * i + 1]
            level[i] = x.shuffle[half_blocks[block, 0]()](y) + x.shuffle[half_blocks[block, 1]()](y)
    return level[0]


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
