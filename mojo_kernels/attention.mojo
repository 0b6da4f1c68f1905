"""Step 5: MLA decode attention over the paged latent cache.

Keys are whole cache rows (`kv_lora_rank + rope_dim` values), values their
first `kv_lora_rank`. One task takes a request, a group of heads and a
partition of the request's keys; it converts each key once into a float32
tile shared by every (token, head) row of the task, and keeps an online
softmax per row. Partitions are then merged with their log-sum-exp.
"""

from std.math import exp, min
from std.utils.numerics import neg_inf
from max.algorithm import sync_parallelize

from .common import DPtr, FPtr, F32_WIDTH, ceil_div, scratch
from .paged_cache import PagedLatentRows, RaggedBatch

comptime KEY_TILE = 16


def alibi_slope(head: Int, num_heads: Int) -> Float32:
    """ALiBi slope of `head` (see `pymla.reference.alibi_slopes`)."""
    var n = 1
    while n * 2 <= num_heads:
        n *= 2
    if head < n:
        return Float32(2.0) ** (Float32(-8.0) * Float32(head + 1) / Float32(n))
    return Float32(2.0) ** (Float32(-8.0) * Float32(2 * (head - n) + 1) / Float32(2 * n))


comptime MASK_NULL = 0
comptime MASK_CAUSAL = 1
comptime MASK_SLIDING_WINDOW_CAUSAL = 2
comptime MASK_CHUNKED_CAUSAL = 3
comptime SCORE_MOD_NO_POS = 0
comptime SCORE_MOD_ALIBI_POS = 1


@fieldwise_init
struct MaskSpec(TrivialRegisterPassable):
    """Mask variant (one of the MASK_* codes) and its window or chunk size."""

    var kind: Int
    var window: Int

    def key_range(self, position: Int, visible: Int) -> Tuple[Int, Int]:
        """Half-open range of key positions a query at `position` attends to."""
        if self.kind == MASK_NULL:
            return (0, visible)
        if self.kind == MASK_SLIDING_WINDOW_CAUSAL:
            return (max(0, position - self.window + 1), position + 1)
        if self.kind == MASK_CHUNKED_CAUSAL:
            return ((position // self.window) * self.window, position + 1)
        return (0, position + 1)


@fieldwise_init
struct AttentionShape(TrivialRegisterPassable):
    var num_tokens: Int
    var num_heads: Int
    var kv_lora_rank: Int
    var key_dim: Int
    var heads_per_group: Int
    var num_partitions: Int


@fieldwise_init
struct PartialResults(TrivialRegisterPassable):
    """Per partition, row `(t, h)`: unnormalized output, running max and sum."""

    var out: FPtr  # [P, T, H, kv_lora_rank]
    var row_max: FPtr  # [P, T, H]
    var row_sum: FPtr  # [P, T, H]


def load_key_tile[
    dtype: DType
](cache: PagedLatentRows[dtype], b: Int, j0: Int, j1: Int, tile: FPtr, key_dim: Int):
    """Widens cache rows `j0 .. j1 - 1` of request `b` into `tile [KEY_TILE, key_dim]`."""
    comptime W = F32_WIDTH
    for j in range(j0, j1):
        var src = cache.row(b, j)
        var dst = tile.unsafe_offset((j - j0) * key_dim)
        var k = 0
        while k + W <= key_dim:
            dst.unsafe_store(k, src.unsafe_load[width=W](k).cast[DType.float32]())
            k += W
        while k < key_dim:
            dst.unsafe_store(k, src.unsafe_load(k).cast[DType.float32]())
            k += 1


def attend_tile(
    q_row: FPtr,
    tile: FPtr,
    j0: Int,
    j1: Int,
    lo: Int,
    hi: Int,
    position: Int,
    slope: Float32,
    scale: Float32,
    shape: AttentionShape,
    acc_out: FPtr,
    mut row_max: Float32,
    mut row_sum: Float32,
):
    """Online-softmax update of one (token, head) row with keys `j0 .. j1 - 1`.

    Keys outside the row's range `[lo, hi)` are skipped.
    """
    var a = max(j0, lo)
    var e = min(j1, hi)
    if a >= e:
        return
    var scores = SIMD[DType.float32, KEY_TILE](neg_inf[DType.float32]())
    for j in range(a, e):
        var s = _dot(q_row, tile.unsafe_offset((j - j0) * shape.key_dim), shape.key_dim)
        scores[j - j0] = s * scale - slope * Float32(position - j)
    var new_max = max(row_max, scores.reduce_max())
    var correction = exp(row_max - new_max)
    var p = exp(scores - new_max)
    row_sum = row_sum * correction + p.reduce_add()
    row_max = new_max
    comptime W = F32_WIDTH
    var rank = shape.kv_lora_rank
    var c = 0
    while c + W <= rank:
        var acc = acc_out.unsafe_load[width=W](c) * correction
        for j in range(a, e):
            acc += p[j - j0] * tile.unsafe_load[width=W]((j - j0) * shape.key_dim + c)
        acc_out.unsafe_store(c, acc)
        c += W
    while c < rank:
        var acc = acc_out.unsafe_load(c) * correction
        for j in range(a, e):
            acc += p[j - j0] * tile.unsafe_load((j - j0) * shape.key_dim + c)
        acc_out.unsafe_store(c, acc)
        c += 1


def _dot(a: FPtr, b: FPtr, n: Int) -> Float32:
    comptime W = F32_WIDTH
    var acc0 = SIMD[DType.float32, W](0)
    var acc1 = SIMD[DType.float32, W](0)
    var i = 0
    while i + 2 * W <= n:
        acc0 += a.unsafe_load[width=W](i) * b.unsafe_load[width=W](i)
        acc1 += a.unsafe_load[width=W](i + W) * b.unsafe_load[width=W](i + W)
        i += 2 * W
    var s = (acc0 + acc1).reduce_add()
    while i < n:
        s += a.unsafe_load(i) * b.unsafe_load(i)
        i += 1
    return s


def attend_partitions[
    dtype: DType
](
    q_full: FPtr,
    cache: PagedLatentRows[dtype],
    batch: RaggedBatch,
    shape: AttentionShape,
    scale: Float32,
    mask: MaskSpec,
    score_mod: Int,
    partials: PartialResults,
) raises:
    """Runs every (request, head group, key partition) task into `partials`."""
    var head_groups = ceil_div(shape.num_heads, shape.heads_per_group)
    var tasks_per_request = head_groups * shape.num_partitions

    def task(i: Int) {var q_full, var cache, var batch, var shape, var scale, var mask, var score_mod, var partials, var head_groups, var tasks_per_request}:
        var b = i // tasks_per_request
        var hg = (i % tasks_per_request) // shape.num_partitions
        var part = i % shape.num_partitions
        var h0 = hg * shape.heads_per_group
        var h1 = min(h0 + shape.heads_per_group, shape.num_heads)
        var visible = batch.visible(b)
        var part_len = ceil_div(visible, shape.num_partitions)
        var k0 = part * part_len
        var k1 = min(k0 + part_len, visible)
        var t0 = batch.start(b)
        var t1 = batch.stop(b)

        # Row state starts empty; rows whose keys miss this partition stay so.
        var k_lo = k1
        var k_hi = k0
        for t in range(t0, t1):
            for h in range(h0, h1):
                var row = (part * shape.num_tokens + t) * shape.num_heads + h
                partials.row_max.unsafe_store(row, neg_inf[DType.float32]())
                partials.row_sum.unsafe_store(row, 0)
                var acc = partials.out.unsafe_offset(row * shape.kv_lora_rank)
                for c in range(shape.kv_lora_rank):
                    acc.unsafe_store(c, 0)
            var r = mask.key_range(batch.position(b, t), visible)
            k_lo = min(k_lo, max(r[0], k0))
            k_hi = max(k_hi, min(r[1], k1))

        var tile_buf = List[Float32](length=KEY_TILE * shape.key_dim, fill=0)
        var tile = scratch(tile_buf)
        var j0 = k_lo
        while j0 < k_hi:
            var j1 = min(j0 + KEY_TILE, k_hi)
            load_key_tile[dtype](cache, b, j0, j1, tile, shape.key_dim)
            for t in range(t0, t1):
                var position = batch.position(b, t)
                var r = mask.key_range(position, visible)
                for h in range(h0, h1):
                    var row = (part * shape.num_tokens + t) * shape.num_heads + h
                    var slope = Float32(0)
                    if score_mod == SCORE_MOD_ALIBI_POS:
                        slope = alibi_slope(h, shape.num_heads)
                    var m = partials.row_max.unsafe_load(row)
                    var l = partials.row_sum.unsafe_load(row)
                    attend_tile(
                        q_full.unsafe_offset((t * shape.num_heads + h) * shape.key_dim),
                        tile, j0, j1, r[0], r[1], position, slope, scale, shape,
                        partials.out.unsafe_offset(row * shape.kv_lora_rank), m, l,
                    )
                    partials.row_max.unsafe_store(row, m)
                    partials.row_sum.unsafe_store(row, l)
            j0 = j1
        _ = tile_buf^

    sync_parallelize(task, batch.num_requests * tasks_per_request)


def merge_partitions(partials: PartialResults, shape: AttentionShape, raw: FPtr) raises:
    """`raw[t, h] = sum_p exp(m_p - M) o_p / sum_p exp(m_p - M) l_p` with `M = max_p m_p`."""
    var rows = shape.num_tokens * shape.num_heads

    def row_task(row: Int) {var partials, var shape, var raw, var rows}:
        var top = neg_inf[DType.float32]()
        for p in range(shape.num_partitions):
            top = max(top, partials.row_max.unsafe_load(p * rows + row))
        var total = Float32(0)
        for p in range(shape.num_partitions):
            total += exp(partials.row_max.unsafe_load(p * rows + row) - top) * partials.row_sum.unsafe_load(p * rows + row)
        var dst = raw.unsafe_offset(row * shape.kv_lora_rank)
        for c in range(shape.kv_lora_rank):
            dst.unsafe_store(c, 0)
        for p in range(shape.num_partitions):
            var w = exp(partials.row_max.unsafe_load(p * rows + row) - top) / total
            var src = partials.out.unsafe_offset((p * rows + row) * shape.kv_lora_rank)
            for c in range(shape.kv_lora_rank):
                dst.unsafe_store(c, dst.unsafe_load(c) + w * src.unsafe_load(c))

    sync_parallelize(row_task, rows)
