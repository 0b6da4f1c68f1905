"""Step 5: MLA decode attention over the paged latent cache.

Keys are whole cache rows (`kv_lora_rank + rope_dim` values), values their
first `kv_lora_rank`. One task takes a request, a group of heads and a
partition of the request's keys. Its rows are the (token, head) pairs of the
request and group; every key tile is shared by all rows, so the cache is read
once per head group. Per tile:

- scores: `S = Q K^T`;
- online softmax per row in float32, one SIMD vector over the tile's keys;
  the row sums take the float32 probabilities, P V gets them rounded to dtype;
- `O = O * correction + P V`.

Three paths compute the products (`attend_tiles_f32`, `attend_tiles_bf16`,
`attend_tiles_amx`; PATH_*): the tile widened to float32 once, with the
register-blocked `dot_block` of `cpu/simd.mojo` and `ROW_BLOCK x COL_BLOCK`
FMA blocks (every dtype, every CPU); or, for bfloat16 caches on CPUs with
AVX512-BF16, `vdpbf16ps` on the cache rows in place (`cpu/bf16.mojo`),
`BF16_KEY_TILE` keys per tile, the next tile's rows prefetched while one is
scored; or, on CPUs with AMX, `tdpbf16ps` on 16-key tiles loaded in place
from the cache (`cpu/amx_attention.mojo`), `AMX_KEY_TILE` keys per tile, rows padded
to 16. All sum the same products in float32.

This file holds the three tile paths and the task loop (`attend_partitions`);
a task's rows and their online softmax are `cpu/online_softmax.mojo`.
Partitions are merged with their log-sum-exp at the end (`cpu/merge.mojo`),
which also gives each row's LSE (the op's optional `lse`).

An `fp8_ds_mla` cache (`Fp8LatentRows`) is read through `CacheKeys`: the f32
path dequantizes its keys straight into the float32 tile, the AVX512-BF16
path into a bfloat16 staging tile (two, alternating, as the next tile is
prepared while one is scored), the AMX path into its 16-key staging blocks
(`key_block`); the values are exact bfloat16 values, so the products are
those of a bfloat16 cache holding them. With a shard of the cache
(`RaggedBatch.shard`, context-parallel decode) keys are the shard's slots:
the partitions split its slots, the mask's position ranges map to slot
ranges, and ALiBi takes each slot's sequence position.
"""

from std.math import min
from std.sys import size_of

from ..common import DPtr, FPtr, ceil_div
from ..paged_cache import CacheShard, Fp8LatentRows, PagedLatentRows, RaggedBatch, partition_keys
from ..spec import SCORE_MOD_ALIBI_POS, MaskSpec, alibi_slope
from .amx import TILE_DEPTH, TILE_ROWS, AmxTiles, TileUnit
from .amx_attention import (
    AMX_KEY_TILE,
    AMX_TUNING,
    KEY_BLOCKS,
    AmxScratch,
    AmxTuning,
    KeyRows,
    NextTile,
    accumulate_values_amx,
    gather_keys,
    interleave_value_columns,
    pack_queries,
    tile_scores_amx,
)
from .bf16 import (
    BF16Ptr,
    HAS_AVX512_BF16,
    TileScores,
    accumulate_values_bf16,
    tile_scores_bf16,
    unpermute_value_columns,
)
from .merge import AttentionShape, PartialResults
from .scratch import Scratch
from .online_softmax import BF16_KEY_TILE, COL_BLOCK, KEY_TILE, ROW_BLOCK, TaskRows, softmax_update
from .simd import DOT_COLS, DOT_ROWS, F32_WIDTH, cast_copy, dot_block, run_tasks

comptime PATH_F32 = 0
"""Keys widened to float32, float32 FMAs (every dtype, every CPU)."""
comptime PATH_AVX512BF16 = 1
"""bf16 products on the AVX512-BF16 unit (`cpu/bf16.mojo`), bfloat16 caches."""
comptime PATH_AMX = 2
"""bf16 products on AMX tiles (`cpu/amx_attention.mojo`), bfloat16 caches."""


@fieldwise_init
struct CacheKeys[dtype: DType](TrivialRegisterPassable):
    """Where a task reads its keys: the cache rows of `dtype` in place, or `fp8_ds_mla` rows
    (when `fp8.active`), dequantized exactly (`Fp8LatentRows.dequantize_rows`)."""

    var rows: PagedLatentRows[Self.dtype]
    var fp8: Fp8LatentRows

    def tile[tile: Int](self, b: Int, j0: Int, k_hi: Int, staging: BF16Ptr, key_dim: Int) -> Array[BF16Ptr, tile]:
        """`tile_rows` of keys `j0 ..`: in place, or fp8 rows dequantized into `staging [tile, key_dim]`."""
        if not self.fp8.active:
            return tile_rows[Self.dtype, tile](self.rows, b, j0, k_hi)
        var count = max(min(tile, k_hi - j0), 1)
        self.fp8.dequantize_rows[DType.bfloat16](b, j0, count, staging, key_dim)
        var keys = Array[BF16Ptr, tile](fill=staging.unsafe_offset((count - 1) * key_dim))
        for c in range(count):
            keys[c] = staging.unsafe_offset(c * key_dim)
        return keys^

    def next_tile(self, b: Int, j1: Int, k_hi: Int) -> NextTile:
        """What the AMX scores prefetch of the tile from key slot `j1` (a multiple of AMX_KEY_TILE): its stored
        rows, and each 16-key block's bytes as one run where every block lies in one page (pages a multiple of 16)."""
        var rows = self.stored_rows[AMX_KEY_TILE](b, min(j1, k_hi - 1), k_hi)
        var page_size = self.fp8.page_size if self.fp8.active else self.rows.page_size
        var row_bytes = self.fp8.row_bytes if self.fp8.active else self.rows.head_dim * size_of[Self.dtype]()
        var runs = j1 < k_hi and page_size % TILE_ROWS == 0
        return NextTile(rows^, ceil_div(TILE_ROWS * row_bytes, 64) if runs else 0)

    def stored_rows[tile: Int](self, b: Int, j0: Int, k_hi: Int) -> Array[BF16Ptr, tile]:
        """Where the stored rows of keys `j0 ..` start (bf16 rows, or fp8 bytes), as `tile_rows`: what to prefetch."""
        if not self.fp8.active:
            return tile_rows[Self.dtype, tile](self.rows, b, j0, k_hi)
        return as_bf16_rows(self.fp8.tile_rows[tile](b, j0, k_hi - 1))


def load_key_tile[
    dtype: DType
](keys: CacheKeys[dtype], b: Int, j0: Int, j1: Int, tile: FPtr, key_dim: Int):
    """Widens cache rows `j0 .. j1 - 1` of request `b` into the first rows of `tile [KEY_TILE, key_dim]`."""
    comptime W = F32_WIDTH
    if keys.fp8.active:
        keys.fp8.dequantize_rows[DType.float32](b, j0, j1 - j0, tile, key_dim)
        return
    for j in range(j0, j1):
        var dst = tile.unsafe_offset((j - j0) * key_dim)
        var src = keys.rows.row(b, j)
        var k = 0
        while k + W <= key_dim:
            dst.unsafe_store(k, src.unsafe_load[width=W](k).cast[DType.float32]())
            k += W
        while k < key_dim:
            dst.unsafe_store(k, src.unsafe_load(k).cast[DType.float32]())
            k += 1


def tile_scores(q: FPtr, tile: FPtr, scores: FPtr, num_rows: Int, key_dim: Int):
    """`scores[r, j] = <q[r], tile[j]>` for `num_rows` (a multiple of ROW_BLOCK) rows and KEY_TILE keys."""
    for r0 in range(0, num_rows, DOT_ROWS):
        for j0 in range(0, KEY_TILE, DOT_COLS):
            var dots = dot_block[DOT_ROWS, DOT_COLS](
                q.unsafe_offset(r0 * key_dim), key_dim, tile.unsafe_offset(j0 * key_dim), key_dim, key_dim
            )
            comptime for r in range(DOT_ROWS):
                comptime for j in range(DOT_COLS):
                    scores.unsafe_store((r0 + r) * KEY_TILE + j0 + j, dots[r * DOT_COLS + j])


def accumulate_values(probs: FPtr, tile: FPtr, acc_out: FPtr, correction: FPtr, num_rows: Int, key_dim: Int, rank: Int):
    """`acc_out[r] = acc_out[r] * correction[r] + sum_j probs[r, j] * tile[j, :rank]` (values = first `rank` columns)."""
    comptime W = F32_WIDTH
    comptime SPAN = COL_BLOCK * W
    var main = rank - rank % SPAN
    for r0 in range(0, num_rows, ROW_BLOCK):
        var c0 = 0
        while c0 < rank:
            var width = SPAN if c0 < main else W
            if c0 >= main and c0 + W > rank:
                # Scalar tail of a rank that is not a multiple of the vector width.
                for r in range(ROW_BLOCK):
                    var row = acc_out.unsafe_offset((r0 + r) * rank)
                    for c in range(c0, rank):
                        var acc = row.unsafe_load(c) * correction.unsafe_load(r0 + r)
                        for j in range(KEY_TILE):
                            acc += probs.unsafe_load((r0 + r) * KEY_TILE + j) * tile.unsafe_load(j * key_dim + c)
                        row.unsafe_store(c, acc)
                break
            if width == SPAN:
                var acc = Array[SIMD[DType.float32, W], ROW_BLOCK * COL_BLOCK](fill=SIMD[DType.float32, W](0))
                comptime for r in range(ROW_BLOCK):
                    var corr = correction.unsafe_load(r0 + r)
                    comptime for c in range(COL_BLOCK):
                        acc[r * COL_BLOCK + c] = acc_out.unsafe_load[width=W]((r0 + r) * rank + c0 + c * W) * corr
                for j in range(KEY_TILE):
                    var vv = Array[SIMD[DType.float32, W], COL_BLOCK](fill=SIMD[DType.float32, W](0))
                    comptime for c in range(COL_BLOCK):
                        vv[c] = tile.unsafe_load[width=W](j * key_dim + c0 + c * W)
                    comptime for r in range(ROW_BLOCK):
                        var p = SIMD[DType.float32, W](probs.unsafe_load((r0 + r) * KEY_TILE + j))
                        comptime for c in range(COL_BLOCK):
                            acc[r * COL_BLOCK + c] += p * vv[c]
                comptime for r in range(ROW_BLOCK):
                    comptime for c in range(COL_BLOCK):
                        acc_out.unsafe_store((r0 + r) * rank + c0 + c * W, acc[r * COL_BLOCK + c])
            else:
                comptime for r in range(ROW_BLOCK):
                    var acc = acc_out.unsafe_load[width=W]((r0 + r) * rank + c0) * correction.unsafe_load(r0 + r)
                    for j in range(KEY_TILE):
                        acc += probs.unsafe_load((r0 + r) * KEY_TILE + j) * tile.unsafe_load[width=W](j * key_dim + c0)
                    acc_out.unsafe_store((r0 + r) * rank + c0, acc)
            c0 += width


def attend_tiles_f32[
    dtype: DType
](
    mut rows: TaskRows, mut mem: Scratch, keys: CacheKeys[dtype], b: Int, k_lo: Int, k_hi: Int, scale: Float32,
    shard: CacheShard,
    key_dim: Int, rank: Int,
):
    """The task's keys `k_lo .. k_hi - 1`, tile by tile, widened to float32 once per tile."""
    var tile = mem.take[DType.float32](KEY_TILE * key_dim)
    var j0 = k_lo
    while j0 < k_hi:
        var j1 = min(j0 + KEY_TILE, k_hi)
        load_key_tile[dtype](keys, b, j0, j1, tile, key_dim)
        tile_scores(rows.q_buf, tile, rows.scores_buf, rows.padded, key_dim)
        softmax_update[dtype, KEY_TILE](rows, j0, j1 - j0, scale, shard)
        accumulate_values(
            rows.scores_buf, tile, rows.out_buf, rows.correction(), rows.padded, key_dim, rank
        )
        j0 = j1


def tile_rows[
    dtype: DType, tile: Int
](cache: PagedLatentRows[dtype], b: Int, j0: Int, k_hi: Int) -> Array[BF16Ptr, tile]:
    """Pointers to the cache rows of keys `j0 .. j0 + tile - 1` of request `b`; keys from `k_hi` on point at key `k_hi - 1`."""
    return as_bf16_rows(cache.tile_rows[tile](b, j0, k_hi - 1))


def as_bf16_rows[dtype: DType, tile: Int](rows: Array[DPtr[dtype], tile]) -> Array[BF16Ptr, tile]:
    """`rows` as bfloat16 pointers (the tile paths' currency; bf16 rows as they are, others to prefetch)."""
    var keys = Array[BF16Ptr, tile](fill=rows[0].unsafe_bitcast[BFloat16]())
    comptime for c in range(tile):
        keys[c] = rows[c].unsafe_bitcast[BFloat16]()
    return keys^


def attend_tiles_bf16[
    dtype: DType
](
    mut rows: TaskRows, mut mem: Scratch, keys: CacheKeys[dtype], b: Int, k_lo: Int, k_hi: Int, scale: Float32,
    shard: CacheShard,
    key_dim: Int, rank: Int,
):
    """The task's keys tile by tile on the AVX512-BF16 unit, reading the bf16 cache rows in place.

    Keys past the tile's end point at its last key: their probabilities are 0.
    While a tile is scored, the next tile's rows are prefetched (fp8 rows:
    dequantized into the other of two staging tiles).
    """
    comptime tile = BF16_KEY_TILE
    if k_lo >= k_hi:
        return
    var q = mem.take[DType.bfloat16](rows.padded * key_dim)
    cast_copy(rows.q_buf, q, rows.num_rows * key_dim)  # exact: q_full holds bf16 values
    var probs = mem.take[DType.bfloat16](rows.padded * tile)
    var staging = mem.take[DType.bfloat16](2 * tile * key_dim if keys.fp8.active else 0)
    # What the scores prefetch: the rows read next, in place (bf16 rows: the next tile's) or by the
    # dequantization (fp8 rows: the tile after the next, which is dequantized before this one is scored).
    var ahead = tile if keys.fp8.active else 0
    var slot = 0
    var first = keys.tile[tile](b, k_lo, k_hi, staging, key_dim)
    var scoring = TileScores[tile](q, first.copy(), first^, rows.scores_buf, key_dim)
    var j0 = k_lo
    while j0 < k_hi:
        var j1 = min(j0 + tile, k_hi)
        slot = 1 - slot
        var upcoming = keys.tile[tile](b, min(j1, k_hi - 1), k_hi, staging.unsafe_offset(slot * tile * key_dim), key_dim)
        scoring.next_keys = keys.stored_rows[tile](b, min(j1 + ahead, k_hi - 1), k_hi)
        tile_scores_bf16(scoring, rows.padded)
        softmax_update[dtype, tile](rows, j0, j1 - j0, scale, shard)
        accumulate_values_bf16[tile](
            rows.scores_buf, probs, scoring.keys, rows.out_buf, rows.correction(), rows.padded, rank
        )
        scoring.keys = upcoming^
        j0 = j1
    unpermute_value_columns(rows.out_buf, rows.num_rows, rank)


def key_block[
    dtype: DType
](
    keys: CacheKeys[dtype],
    b: Int,
    j0: Int,
    k_lo: Int,
    k_hi: Int,
    staging: BF16Ptr,
    key_dim: Int,
    padded_dim: Int,
    whole: Bool,
) -> KeyRows:
    """Keys `j0 .. j0 + 15` of request `b` for a tile load: bfloat16 rows in place when they lie in one
    page and the key dim is whole depth steps, else copied into `staging [16, padded_dim]` (fp8 rows
    dequantized; zeros for keys outside `[k_lo, k_hi)` and past `key_dim`).

    Keys of an in-place block outside `[k_lo, k_hi)` are rows of the same page: their scores are
    masked, but their values may hold any bits; with `whole` (values read in place too) such a block
    is copied.
    """
    var first = max(j0, k_lo)
    var last = min(j0 + TILE_ROWS, k_hi)
    if first >= last:
        return KeyRows(staging, padded_dim)  # no key of the task: every score masked, every value zero
    if keys.fp8.active:
        for j in range(TILE_ROWS):
            if j0 + j < first or j0 + j >= last:
                var dst = staging.unsafe_offset(j * padded_dim)
                for d in range(key_dim):
                    dst.unsafe_store(d, BFloat16(0))
        # past key_dim: zeros, never written
        keys.fp8.dequantize_rows[DType.bfloat16](b, first, last - first, staging.unsafe_offset((first - j0) * padded_dim), padded_dim)
        return KeyRows(staging, padded_dim)
    var cache = rebind[PagedLatentRows[DType.bfloat16]](keys.rows)
    var all_valid = first == j0 and last == j0 + TILE_ROWS
    var one_page = j0 // cache.page_size == (j0 + TILE_ROWS - 1) // cache.page_size
    if key_dim == padded_dim and one_page and (all_valid or not whole):
        return KeyRows(cache.row(b, j0), key_dim)
    var rows = Array[BF16Ptr, TILE_ROWS](fill=cache.row(b, first))
    var valid = Array[Bool, TILE_ROWS](fill=False)
    for j in range(TILE_ROWS):
        if j0 + j >= k_lo and j0 + j < k_hi:
            rows[j] = cache.row(b, j0 + j)
            valid[j] = True
    return gather_keys(rows, valid, staging, key_dim, padded_dim)


def attend_tiles_amx[
    dtype: DType, tiles: TileUnit, tuning: AmxTuning = AMX_TUNING
](
    mut rows: TaskRows, mut mem: Scratch, keys: CacheKeys[dtype], b: Int, k_lo: Int, k_hi: Int, scale: Float32,
    shard: CacheShard,
    key_dim: Int, rank: Int,
):
    """The task's keys on AMX tiles (`cpu/amx_attention.mojo`), key tiles aligned to multiples of AMX_KEY_TILE slots.

    `rows.padded` is a multiple of 16. Values are read in place up to
    `tuning.values_in_place_max_row_blocks` row blocks, else packed once per key tile.
    """
    comptime assert dtype == DType.bfloat16, "the AMX path serves bfloat16 caches"
    comptime tile = AMX_KEY_TILE
    if k_lo >= k_hi:
        return
    var buffers = AmxScratch(mem, rows.padded, key_dim, rank)
    var steps = buffers.steps
    var padded_dim = steps * TILE_DEPTH
    var in_place = rows.padded // TILE_ROWS <= tuning.values_in_place_max_row_blocks
    var q_packed = buffers.q_packed
    var out = buffers.out
    pack_queries(rows.q_buf, q_packed, rows.padded, key_dim, steps)
    var unit = tiles()
    unit.start()
    var j0 = k_lo - k_lo % tile
    while j0 < k_hi:
        var blocks = Array[KeyRows, KEY_BLOCKS](fill=KeyRows(q_packed, padded_dim))
        comptime for kb in range(KEY_BLOCKS):
            blocks[kb] = key_block(
                keys, b, j0 + kb * TILE_ROWS, k_lo, k_hi, buffers.staging_block(kb), key_dim, padded_dim, in_place
            )
        var valid = Array[Bool, tile](fill=False)
        comptime for j in range(tile):
            valid[j] = j0 + j >= k_lo and j0 + j < k_hi
        var next = keys.next_tile(b, j0 + tile, k_hi)
        tile_scores_amx[tiles, tuning.prefetch_line_stride, tuning.score_pairs](
            unit, blocks, next, q_packed, rows.scores_buf, buffers.acc, rows.padded, steps
        )
        softmax_update[dtype, tile](rows, j0, min(tile, k_hi - j0), scale, shard)
        accumulate_values_amx[tiles, tuning.value_pairs, tuning.prefetch_line_stride > 0](
            unit, rows.scores_buf, buffers.probs, blocks, valid,
            buffers.v_packed, out, buffers.out_stride, rows.correction(), rows.padded, rank, in_place, next,
        )
        j0 += tile
    unit.stop()
    if in_place:
        interleave_value_columns(out, rows.num_rows, buffers.out_stride, rank)
    var out_rows = rows.out_buf
    for r in range(rows.num_rows):
        for c in range(rank):
            out_rows.unsafe_store(r * rank + c, out.unsafe_load(r * buffers.out_stride + c))
    _ = buffers^


def attend_partitions[
    dtype: DType, tiles: TileUnit = AmxTiles, tuning: AmxTuning = AMX_TUNING
](
    q_full: DPtr[dtype],
    cache: PagedLatentRows[dtype],
    batch: RaggedBatch,
    shape: AttentionShape,
    scale: Float32,
    mask: MaskSpec,
    score_mod: Int,
    partials: PartialResults,
    path: Int,
    fp8: Fp8LatentRows,
) raises:
    """Runs every (request, head group, key partition) task into `partials`.

    `path` (PATH_*, chosen by `cpu_pipeline.attention_path`) takes the
    AVX512-BF16 products (`cpu/bf16.mojo`) or the AMX tiles (`cpu/amx_attention.mojo`,
    through `tiles`: the unit, or the emulation of `tests/cpu/amx_check.mojo`)
    for a bfloat16 cache; otherwise keys are widened to float32. `fp8`:
    the cache's rows in the `fp8_ds_mla` format, when active (`CacheKeys`).
    """
    var keys = CacheKeys[dtype](cache, fp8)

    def task(i: Int) {var q_full, var keys, var batch, var shape, var scale, var mask, var score_mod, var partials, var path}:
        var which = shape.task(i)
        var b = which[0]
        var part = which[2]
        var h0 = which[1] * shape.heads_per_group
        var h1 = min(h0 + shape.heads_per_group, shape.num_heads)
        var visible = batch.visible(b)  # positions: the mask's
        var part_keys = partition_keys(part, shape.partitions(b), batch.local_keys(b))  # key slots
        var k0 = part_keys[0]
        var k1 = part_keys[1]
        var t0 = batch.start(b)
        var t1 = batch.stop(b)
        var key_dim = shape.key_dim
        var rank = shape.kv_lora_rank

        # Gather the task's rows: their queries, key slots (within this partition) and slopes.
        var mem = Scratch()  # the task's buffers, kept by the pool across calls (cpu/scratch.mojo)
        var rows = TaskRows(mem, (t1 - t0) * (h1 - h0), key_dim, rank, TILE_ROWS if path == PATH_AMX else ROW_BLOCK)
        var q_rows = rows.q_buf
        var slopes = rows.slope()
        var k_lo = k1
        var k_hi = k0
        var r = 0
        for t in range(t0, t1):
            var position = batch.position(b, t)
            var span = mask.key_range(position, visible)
            var slots = batch.local_key_range(span[0], span[1])
            var lo = max(slots[0], k0)
            var hi = min(slots[1], k1)
            k_lo = min(k_lo, lo)
            k_hi = max(k_hi, hi)
            for h in range(h0, h1):
                cast_copy(q_full.unsafe_offset((t * shape.num_heads + h) * key_dim), q_rows.unsafe_offset(r * key_dim), key_dim)
                rows.meta.unsafe_store(5 * r, lo)
                rows.meta.unsafe_store(5 * r + 1, hi)
                rows.meta.unsafe_store(5 * r + 2, position)
                rows.meta.unsafe_store(5 * r + 3, t)
                rows.meta.unsafe_store(5 * r + 4, h)
                if score_mod == SCORE_MOD_ALIBI_POS:
                    slopes.unsafe_store(r, alibi_slope(h, shape.num_heads))
                r += 1

        var done = False
        comptime if dtype == DType.bfloat16:
            if path == PATH_AMX:
                attend_tiles_amx[dtype, tiles, tuning](
                    rows, mem, keys, b, k_lo, k_hi, scale, batch.shard, key_dim, rank
                )
                done = True
        comptime if dtype == DType.bfloat16 and HAS_AVX512_BF16:
            if path == PATH_AVX512BF16:
                attend_tiles_bf16[dtype](rows, mem, keys, b, k_lo, k_hi, scale, batch.shard, key_dim, rank)
                done = True
        if not done:
            attend_tiles_f32[dtype](rows, mem, keys, b, k_lo, k_hi, scale, batch.shard, key_dim, rank)

        # Hand the rows' state to the merge.
        var out_rows = rows.out_buf
        for r in range(rows.num_rows):
            var row = shape.row(b, part, rows.meta.unsafe_load(5 * r + 3), rows.meta.unsafe_load(5 * r + 4))
            partials.row_max.unsafe_store(row, rows.row_max().unsafe_load(r))
            partials.row_sum.unsafe_store(row, rows.row_sum().unsafe_load(r))
            cast_copy(out_rows.unsafe_offset(r * rank), partials.out.unsafe_offset(row * rank), rank)
        _ = rows^
        _ = mem^

    var total_keys = 0
    for b in range(batch.num_requests):
        total_keys += batch.local_keys(b)
    run_tasks(task, shape.num_tasks, total_keys * shape.num_heads * shape.key_dim)
