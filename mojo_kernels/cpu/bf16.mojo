"""Step 5's two products on the AVX512-BF16 unit (`vdpbf16ps`), for bfloat16 caches.

`vdpbf16ps` multiplies pairs of bf16 values exactly and adds both products to
a float32 lane: "products of dtype values summed in float32", the op's
rounding points (`pymla/reference.py`), at twice the multiply rate of float32
FMAs and without widening the keys first. Both kernels read the cache rows
in place through one pointer per key of the tile.

* Scores `S[r, j] = <q[r], K[j]>`: a `4 x 4` block of (row, key) dot products
  keeps 16 accumulators of 16 lanes over 32-value steps of the key dim; one
  transposing tree (`sum_lanes_of_16`) sums all 16 at the end.
  While it scores a tile it prefetches the next tile's rows, one 64-byte
  line per key load, the tile's key blocks dealt over its row blocks: pages
  are scattered, so the hardware prefetcher cannot run ahead across them,
  and at 16 heads a key row gets too little arithmetic to hide a miss.
* `O[r] = O[r] * corr[r] + sum_j P[r, j] V[j]`: keys are taken in pairs whose
  values are interleaved within 128-bit lanes (`interleave_pairs`), so
  one `vdpbf16ps` with the broadcast pair `(P[r, j], P[r, j + 1])` adds both
  keys to 16 columns; `8 x 32`-column register blocks. The accumulators keep
  each 32-column chunk in a fixed permuted order, restored once per task.

Which path runs is chosen per call (`cpu_pipeline.attention_path`,
`PYMLA_CPU_PATH`); on CPUs with AMX, `auto` takes the AMX tiles
(`cpu/amx.mojo`) instead.
"""

from std.memory import bitcast
from std.sys import PrefetchOptions, prefetch
from std.sys.info import CompilationTarget
from std.utils import IndexList

from ..common import FPtr
from .simd import dpbf16, sum_lanes_of_16

comptime HAS_AVX512_BF16 = CompilationTarget._has_feature["avx512bf16"]()
"""Whether the CPU the op is compiled for (MAX compiles it on the machine that runs it) has the unit."""

comptime BF16Ptr = Pointer[BFloat16, MutUntrackedOrigin]
comptime F32x16 = SIMD[DType.float32, 16]
comptime BF16x32 = SIMD[DType.bfloat16, 32]
comptime STEP = 32  # bf16 values per 512-bit register
comptime SCORE_ROWS = 4  # register block of the scores: rows x keys
comptime SCORE_KEYS = 4
comptime PV_ROWS = 8  # register block of P V: rows x 32 columns
comptime PV_ROWS_TAIL = 4  # rows of the last block (task rows are padded to a multiple of 4)
comptime NEXT_TILE_PREFETCH = PrefetchOptions().for_read().low_locality().to_data_cache()
"""How the scores prefetch the next tile's key rows: toward L2 (`prefetcht2`); into L1
(`prefetcht0`) measured slower, the next tile evicting the current one."""


@fieldwise_init
struct TileScores[tile: Int](Movable):
    """What the scores of one key tile read and write: the bf16 queries `q [rows, key_dim]`, the
    tile's key rows, the next tile's (prefetched on the way) and `scores [rows, tile]` (float32)."""

    var q: BF16Ptr
    var keys: Array[BF16Ptr, Self.tile]
    var next_keys: Array[BF16Ptr, Self.tile]
    var scores: FPtr
    var key_dim: Int


@always_inline
def score_row_block[tile: Int](args: TileScores[tile], r0: Int, row_blocks: Int):
    """Rows `r0 .. r0 + SCORE_ROWS - 1` of `tile_scores_bf16`.

    Each key block of the tile is prefetched by one row block, the key
    blocks dealt round-robin over the row blocks: while this block loads a
    64-byte step of key `j`, it prefetches the same step of `next_keys[j]`,
    so the next tile streams in spread over the whole tile's dot products.
    """
    var q = args.q
    var scores = args.scores
    var key_dim = args.key_dim
    ref keys = args.keys
    ref next_keys = args.next_keys
    var main = key_dim - key_dim % STEP
    var block = r0 // SCORE_ROWS
    comptime for j0 in range(0, tile, SCORE_KEYS):
        var acc = Array[F32x16, SCORE_ROWS * SCORE_KEYS](fill=F32x16(0))
        var prefetching = (j0 // SCORE_KEYS) % row_blocks == block
        for d in range(0, main, STEP):
            var qv = Array[BF16x32, SCORE_ROWS](fill=BF16x32(0))
            comptime for r in range(SCORE_ROWS):
                qv[r] = q.unsafe_load[width=STEP]((r0 + r) * key_dim + d)
            comptime for c in range(SCORE_KEYS):
                if prefetching:
                    prefetch[NEXT_TILE_PREFETCH](next_keys[j0 + c].unsafe_offset(d))
                var kv = keys[j0 + c].unsafe_load[width=STEP](d)
                comptime for r in range(SCORE_ROWS):
                    acc[r * SCORE_KEYS + c] = dpbf16(acc[r * SCORE_KEYS + c], qv[r], kv)
        var dots = sum_lanes_of_16(acc)  # lane r * SCORE_KEYS + c
        for d in range(main, key_dim):  # key_dim past the last whole step
            comptime for r in range(SCORE_ROWS):
                comptime for c in range(SCORE_KEYS):
                    dots[r * SCORE_KEYS + c] += q.unsafe_load((r0 + r) * key_dim + d).cast[
                        DType.float32
                    ]() * keys[j0 + c].unsafe_load(d).cast[DType.float32]()
        comptime for r in range(SCORE_ROWS):
            scores.unsafe_store((r0 + r) * tile + j0, dots.slice[SCORE_KEYS, offset=r * SCORE_KEYS]())


def tile_scores_bf16[tile: Int](args: TileScores[tile], num_rows: Int):
    """`scores[r, j] = <q[r], keys[j]>` for `num_rows` (a multiple of SCORE_ROWS) rows of `q [rows, key_dim]`.

    Prefetches the rows of `next_keys` (the next tile) on the way.
    """
    comptime assert tile % SCORE_KEYS == 0
    comptime assert SCORE_ROWS * SCORE_KEYS == 16
    var row_blocks = num_rows // SCORE_ROWS
    for r0 in range(0, num_rows, SCORE_ROWS):
        score_row_block[tile](args, r0, row_blocks)


def pair_mask[half: Int]() -> IndexList[32]:
    """Shuffle mask over the 64 lanes of `a` then `b`: `(a[8L + 4 half + i], b[8L + 4 half + i])` for `i < 4`
    in each 128-bit lane `L`."""
    var mask = IndexList[32]()
    for k in range(32):
        mask[k] = 8 * (k // 8) + 4 * half + (k % 8) // 2 + 32 * (k % 2)
    return mask


@always_inline
def interleave_pairs[half: Int](a: BF16x32, b: BF16x32) -> BF16x32:
    """Two keys' values in pairs within 128-bit lanes: half 0 the low four of each lane's eight (`vpunpcklwd`),
    half 1 the high four (`vpunpckhwd`)."""
    return a.shuffle[pair_mask[half]()](b)


def stored_column(m: Int) -> Int:
    """The value column held at offset `m < 32` of a 32-column chunk of the P V accumulators.

    `interleave_pairs[0]` feeds offsets 0-15 (lane `4L + i` <- column `8L + i`),
    `interleave_pairs[1]` offsets 16-31 (column `8L + 4 + i`).
    """
    var k = m % 16
    return 8 * (k // 4) + k % 4 + (4 if m >= 16 else 0)


def unpermute_mask() -> IndexList[32]:
    """`mask[j]`: the offset `m` of a 32-column chunk that holds column `j` (`stored_column(m) == j`)."""
    var mask = IndexList[32]()
    for m in range(32):
        mask[stored_column(m)] = m
    return mask


def unpermute_value_columns(rows: FPtr, num_rows: Int, rank: Int):
    """Puts the columns of `rows [num_rows, rank]` kept by `accumulate_values_bf16` back in order
    (one two-register shuffle per 32-column chunk)."""
    var main = rank - rank % STEP
    for r in range(num_rows):
        var row = rows.unsafe_offset(r * rank)
        for c in range(0, main, STEP):
            var chunk = row.unsafe_load[width=STEP](c)
            row.unsafe_store(c, chunk.shuffle[unpermute_mask()](chunk))


@always_inline
def values_row_block[
    tile: Int, rows: Int
](
    r0: Int,
    probs: FPtr,
    words: Pointer[Int32, MutUntrackedOrigin],
    keys: Array[BF16Ptr, tile],
    acc_out: FPtr,
    correction: FPtr,
    rank: Int,
):
    """Rows `r0 .. r0 + rows - 1` of `accumulate_values_bf16`: `rows x 2` accumulators per 32 columns."""
    comptime PAIRS = tile // 2
    var main = rank - rank % STEP
    var c0 = 0
    while c0 < main:
        var acc = Array[F32x16, rows * 2](fill=F32x16(0))
        comptime for r in range(rows):
            var corr = correction.unsafe_load(r0 + r)
            comptime for g in range(2):
                acc[r * 2 + g] = acc_out.unsafe_load[width=16]((r0 + r) * rank + c0 + 16 * g) * corr
        comptime for p in range(PAIRS):
            var a = keys[2 * p].unsafe_load[width=STEP](c0)
            var b = keys[2 * p + 1].unsafe_load[width=STEP](c0)
            var lo = interleave_pairs[0](a, b)
            var hi = interleave_pairs[1](a, b)
            comptime for r in range(rows):
                var pb = bitcast[DType.bfloat16, STEP](SIMD[DType.int32, 16](words.unsafe_load((r0 + r) * PAIRS + p)))
                acc[r * 2] = dpbf16(acc[r * 2], pb, lo)
                acc[r * 2 + 1] = dpbf16(acc[r * 2 + 1], pb, hi)
        comptime for r in range(rows):
            comptime for g in range(2):
                acc_out.unsafe_store((r0 + r) * rank + c0 + 16 * g, acc[r * 2 + g])
        c0 += STEP
    # Columns past the last whole chunk (a kv_lora_rank that is not a multiple of 32), in order.
    for r in range(r0, r0 + rows):
        for c in range(main, rank):
            var acc = acc_out.unsafe_load(r * rank + c) * correction.unsafe_load(r)
            for j in range(tile):
                acc += probs.unsafe_load(r * tile + j) * keys[j].unsafe_load(c).cast[DType.float32]()
            acc_out.unsafe_store(r * rank + c, acc)


def accumulate_values_bf16[
    tile: Int
](
    probs: FPtr,
    probs_bf16: BF16Ptr,
    keys: Array[BF16Ptr, tile],
    acc_out: FPtr,
    correction: FPtr,
    num_rows: Int,
    rank: Int,
):
    """`acc_out[r] = acc_out[r] * correction[r] + sum_j probs[r, j] keys[j][:rank]`, columns permuted.

    `probs [rows, tile]` hold bf16 values (the probabilities rounded for P V);
    `probs_bf16 [rows, tile]` is scratch for them as bf16; `num_rows` is a
    multiple of PV_ROWS_TAIL. Keys are taken in pairs: `interleave_pairs`
    [0] and [1] interleave two keys' values within 128-bit lanes, so one
    `vdpbf16ps` with the broadcast probability pair `(P[r, 2p], P[r, 2p + 1])`
    (one 32-bit word from memory, an embedded broadcast) adds both keys to 16
    columns. The columns of each 32-column chunk of `acc_out` are therefore
    kept in the order of `stored_column`; `unpermute_value_columns` restores
    it once, after the last tile.
    """
    comptime assert tile % 2 == 0
    for r in range(num_rows):
        probs_bf16.unsafe_store(r * tile, probs.unsafe_load[width=tile](r * tile).cast[DType.bfloat16]())
    var words = probs_bf16.unsafe_bitcast[Int32]()  # word r * (tile / 2) + p: (P[r, 2p], P[r, 2p + 1])
    var r0 = 0
    while r0 + PV_ROWS <= num_rows:
        values_row_block[tile, PV_ROWS](r0, probs, words, keys, acc_out, correction, rank)
        r0 += PV_ROWS
    while r0 < num_rows:
        values_row_block[tile, PV_ROWS_TAIL](r0, probs, words, keys, acc_out, correction, rank)
        r0 += PV_ROWS_TAIL
