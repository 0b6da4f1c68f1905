"""Step 5's two products on the AVX512-BF16 unit (`vdpbf16ps`), for bfloat16 caches.

`vdpbf16ps` multiplies pairs of bf16 values exactly and adds both products to
a float32 lane: "products of dtype values summed in float32", the op's
rounding points (`pymla/reference.py`), at twice the multiply rate of float32
FMAs and without widening the keys first. Both kernels read the cache rows
in place through one pointer per key of the tile.

* Scores `S[r, j] = <q[r], K[j]>`: a `4 x 4` block of (row, key) dot products
  keeps 16 accumulators of 16 lanes over 32-value steps of the key dim and
  sums the lanes once at the end.
* `O[r] = O[r] * corr[r] + sum_j P[r, j] V[j]`: keys are taken in pairs,
  `(V[j, c], V[j + 1, c])` interleaved so that one `vdpbf16ps` with the
  broadcast pair `(P[r, j], P[r, j + 1])` adds both keys to 16 columns.

Which path runs is chosen per call (`cpu_pipeline.cpu_path`).
"""

from std.memory import bitcast
from std.sys import llvm_intrinsic
from std.sys.info import CompilationTarget

from .common import FPtr

comptime HAS_AVX512_BF16 = CompilationTarget._has_feature["avx512bf16"]()
"""Whether the CPU the op is compiled for (MAX compiles it on the machine that runs it) has the unit."""

comptime BF16Ptr = Pointer[BFloat16, MutUntrackedOrigin]
comptime F32x16 = SIMD[DType.float32, 16]
comptime BF16x32 = SIMD[DType.bfloat16, 32]
comptime STEP = 32  # bf16 values per 512-bit register
comptime SCORE_ROWS = 4  # register block of the scores: rows x keys
comptime SCORE_KEYS = 4
comptime PV_ROWS = 4  # register block of P V: rows x 16-column groups
comptime PV_GROUPS = 4


@always_inline
def dpbf16(acc: F32x16, a: BF16x32, b: BF16x32) -> F32x16:
    """`acc[i] + a[2i] b[2i] + a[2i+1] b[2i+1]`, products exact, sums in float32."""
    return llvm_intrinsic["llvm.x86.avx512bf16.dpbf16ps.512", F32x16](acc, a, b)


def tile_scores_bf16[
    tile: Int
](q: BF16Ptr, keys: Array[BF16Ptr, tile], scores: FPtr, num_rows: Int, key_dim: Int):
    """`scores[r, j] = <q[r], keys[j]>` for `num_rows` (a multiple of SCORE_ROWS) rows of `q [rows, key_dim]`."""
    comptime assert tile % SCORE_KEYS == 0
    var main = key_dim - key_dim % STEP
    for r0 in range(0, num_rows, SCORE_ROWS):
        comptime for j0 in range(0, tile, SCORE_KEYS):
            var acc = Array[F32x16, SCORE_ROWS * SCORE_KEYS](fill=F32x16(0))
            for d in range(0, main, STEP):
                var qv = Array[BF16x32, SCORE_ROWS](fill=BF16x32(0))
                comptime for r in range(SCORE_ROWS):
                    qv[r] = q.unsafe_load[width=STEP]((r0 + r) * key_dim + d)
                comptime for c in range(SCORE_KEYS):
                    var kv = keys[j0 + c].unsafe_load[width=STEP](d)
                    comptime for r in range(SCORE_ROWS):
                        acc[r * SCORE_KEYS + c] = dpbf16(acc[r * SCORE_KEYS + c], qv[r], kv)
            comptime for r in range(SCORE_ROWS):
                comptime for c in range(SCORE_KEYS):
                    var s = acc[r * SCORE_KEYS + c].reduce_add()
                    for d in range(main, key_dim):
                        s += q.unsafe_load((r0 + r) * key_dim + d).cast[DType.float32]() * keys[
                            j0 + c
                        ].unsafe_load(d).cast[DType.float32]()
                    scores.unsafe_store((r0 + r) * tile + j0 + c, s)


def accumulate_values_bf16[
    tile: Int
](probs: FPtr, keys: Array[BF16Ptr, tile], acc_out: FPtr, correction: FPtr, num_rows: Int, rank: Int):
    """`acc_out[r] = acc_out[r] * correction[r] + sum_j probs[r, j] keys[j][:rank]`.

    `probs [rows, tile]` hold bf16 values (the probabilities rounded for P V);
    `num_rows` is a multiple of PV_ROWS.
    """
    comptime assert tile % 2 == 0
    comptime SPAN = 16 * PV_GROUPS
    comptime PAIRS = tile // 2
    var main = rank - rank % SPAN
    for r0 in range(0, num_rows, PV_ROWS):
        # Each row's probabilities as bf16 pairs (P[r, 2p], P[r, 2p + 1]), one 32-bit word per pair.
        var pairs = Array[SIMD[DType.int32, PAIRS], PV_ROWS](fill=SIMD[DType.int32, PAIRS](0))
        comptime for r in range(PV_ROWS):
            var p = probs.unsafe_load[width=tile]((r0 + r) * tile).cast[DType.bfloat16]()
            pairs[r] = bitcast[DType.int32, PAIRS](p)
        var c0 = 0
        while c0 < main:
            var acc = Array[F32x16, PV_ROWS * PV_GROUPS](fill=F32x16(0))
            comptime for r in range(PV_ROWS):
                var corr = correction.unsafe_load(r0 + r)
                comptime for g in range(PV_GROUPS):
                    acc[r * PV_GROUPS + g] = acc_out.unsafe_load[width=16]((r0 + r) * rank + c0 + 16 * g) * corr
            comptime for p in range(PAIRS):
                var vv = Array[BF16x32, PV_GROUPS](fill=BF16x32(0))
                comptime for g in range(PV_GROUPS):
                    var a = keys[2 * p].unsafe_load[width=16](c0 + 16 * g)
                    var b = keys[2 * p + 1].unsafe_load[width=16](c0 + 16 * g)
                    vv[g] = a.interleave(b)
                comptime for r in range(PV_ROWS):
                    var pb = bitcast[DType.bfloat16, STEP](SIMD[DType.int32, 16](pairs[r][p]))
                    comptime for g in range(PV_GROUPS):
                        acc[r * PV_GROUPS + g] = dpbf16(acc[r * PV_GROUPS + g], pb, vv[g])
            comptime for r in range(PV_ROWS):
                comptime for g in range(PV_GROUPS):
                    acc_out.unsafe_store((r0 + r) * rank + c0 + 16 * g, acc[r * PV_GROUPS + g])
            c0 += SPAN
        # Columns past the last whole span (a kv_lora_rank that is not a multiple of 64).
        for r in range(r0, r0 + PV_ROWS):
            for c in range(main, rank):
                var acc = acc_out.unsafe_load(r * rank + c) * correction.unsafe_load(r)
                for j in range(tile):
                    acc += probs.unsafe_load(r * tile + j) * keys[j].unsafe_load(c).cast[DType.float32]()
                acc_out.unsafe_store(r * rank + c, acc)
