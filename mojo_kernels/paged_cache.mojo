"""Addressing of the paged latent cache `[num_blocks, 1, num_layers, page_size, 1, head_dim]`.

Rows in the op's dtype (`PagedLatentRows`) or in the `fp8_ds_mla` format
(`Fp8LatentRows`: `head_dim` bytes per row; `pymla/cache_format.py`).
"""

from .common import DPtr, FPtr, U32Ptr, U8Ptr
from .fp8 import (
    NO_SHIFT,
    bf16_scale_shift,
    cache_block_scale,
    e4m3_bytes,
    has_zero_exponent,
    round_to_e4m3,
    widen_e4m3,
    widen_e4m3_bf16_any,
    widen_e4m3_bf16_normal,
)


@fieldwise_init
struct CacheShard(TrivialRegisterPassable):
    """Which positions of every request this rank's cache holds (context-parallel decode).

    A request's positions are dealt to `count` ranks in runs of `interleave`:
    position `p` belongs to rank `(p // interleave) % count` and sits in that
    rank's cache at local slot `local_count(p)` (the rank's positions below
    `p`). `interleave = 1` deals single tokens; an `interleave` of at least
    the longest sequence over `count` gives each rank one contiguous run.
    `count = 1` is the whole cache: every position, at its own slot. The one
    definition for the CPU and the GPU (`pymla/shard.py` mirrors it).
    """

    var rank: Int
    var count: Int
    var interleave: Int

    @staticmethod
    def whole() -> Self:
        return Self(0, 1, 1)

    def owns(self, pos: Int) -> Bool:
        return (pos // self.interleave) % self.count == self.rank

    def local_count(self, n: Int) -> Int:
        """How many of positions `0 .. n - 1` this rank holds: the local slot of position `n`."""
        if self.count == 1:
            return n
        var cycle = self.count * self.interleave
        var full = n // cycle
        var rest = n - full * cycle - self.rank * self.interleave
        return full * self.interleave + min(max(rest, 0), self.interleave)

    def position(self, slot: Int) -> Int:
        """The sequence position of local slot `slot`."""
        if self.count == 1:
            return slot
        return (slot // self.interleave) * self.count * self.interleave + self.rank * self.interleave + slot % self.interleave


@fieldwise_init
struct RaggedBatch(TrivialRegisterPassable):
    """Where each request's query tokens are and where they sit in its sequence.

    Request `b` owns query rows `[offsets[b], offsets[b + 1])`; its `i`-th new
    token sits at position `cache_lengths[b] + i`. Positions are global: with
    a `shard` of the cache, key slot `j` of this rank holds position
    `shard.position(j)` and a request has `local_keys(b)` keys here.
    """

    var offsets: U32Ptr
    var cache_lengths: U32Ptr
    var num_requests: Int
    var shard: CacheShard

    def start(self, b: Int) -> Int:
        return Int(self.offsets.unsafe_load(b))

    def stop(self, b: Int) -> Int:
        return Int(self.offsets.unsafe_load(b + 1))

    def num_tokens(self, b: Int) -> Int:
        return self.stop(b) - self.start(b)

    def cache_length(self, b: Int) -> Int:
        return Int(self.cache_lengths.unsafe_load(b))

    def visible(self, b: Int) -> Int:
        """Keys request `b` can see: its cached tokens and its new ones."""
        return self.cache_length(b) + self.num_tokens(b)

    def position(self, b: Int, t: Int) -> Int:
        """Sequence position of query row `t` of request `b`."""
        return self.cache_length(b) + t - self.start(b)

    def local_keys(self, b: Int) -> Int:
        """Key slots of request `b` in this rank's cache: its visible positions this shard holds."""
        return self.shard.local_count(self.visible(b))

    def local_key_range(self, lo: Int, hi: Int) -> Tuple[Int, Int]:
        """The local slots `[j0, j1)` of this shard's positions in `[lo, hi)`."""
        return (self.shard.local_count(lo), self.shard.local_count(hi))


@fieldwise_init
struct PageTable(TrivialRegisterPassable):
    """Where one layer's rows sit in the paged blocks: request `b`'s position `pos` is row
    `pos % page_size` of page `lookup[b * pages_per_request + pos // page_size]`; rows are
    `row_width` elements apart, pages `page_stride`, the layer at `layer_offset` in a page."""

    var lookup: U32Ptr
    var pages_per_request: Int
    var page_size: Int
    var page_stride: Int
    var layer_offset: Int
    var row_width: Int

    @always_inline
    def row_offset(self, b: Int, pos: Int) -> Int:
        """Element offset in the blocks of request `b`'s row at position `pos`."""
        var page = Int(self.lookup.unsafe_load(b * self.pages_per_request + pos // self.page_size))
        return page * self.page_stride + self.layer_offset + (pos % self.page_size) * self.row_width

    @always_inline
    def run(self, b: Int, pos: Int, end: Int) -> Tuple[Int, Int]:
        """`row_offset(b, pos)` and how many of positions `pos ..< end` share its page (rows
        `row_width` apart from there): the one walk over a run of positions, a lookup per page."""
        return (self.row_offset(b, pos), min(self.page_size - pos % self.page_size, end - pos))

    @always_inline
    def tile_rows[
        dtype: DType, tile: Int
    ](self, base: DPtr[dtype], b: Int, j0: Int, last: Int) -> Array[DPtr[dtype], tile]:
        """The rows in `base` of positions `j0 .. j0 + tile - 1`, positions past `last` at `last`'s row."""
        var first = min(j0, last)
        var count = min(tile, last + 1 - first)
        var rows = Array[DPtr[dtype], tile](fill=base)
        var c = 0
        while c < count:
            var run = self.run(b, first + c, first + count)
            for i in range(run[1]):
                rows[c + i] = base.unsafe_offset(run[0] + i * self.row_width)
            c += run[1]
        for i in range(count, tile):
            rows[i] = rows[count - 1]
        return rows^


@fieldwise_init
struct PagedLatentRows[dtype: DType](TrivialRegisterPassable):
    """The rows of one layer of the paged cache, one per (request, position)."""

    var blocks: DPtr[Self.dtype]
    var lookup_table: U32Ptr
    var pages_per_request: Int
    var page_size: Int
    var page_stride: Int
    var layer_offset: Int
    var head_dim: Int

    @staticmethod
    def create(
        blocks: DPtr[Self.dtype],
        lookup_table: U32Ptr,
        pages_per_request: Int,
        num_layers: Int,
        page_size: Int,
        head_dim: Int,
        layer: Int,
    ) -> Self:
        return Self(
            blocks,
            lookup_table,
            pages_per_request,
            page_size,
            num_layers * page_size * head_dim,
            layer * page_size * head_dim,
            head_dim,
        )

    def pages(self) -> PageTable:
        return PageTable(
            self.lookup_table, self.pages_per_request, self.page_size, self.page_stride, self.layer_offset, self.head_dim
        )

    def row(self, b: Int, pos: Int) -> DPtr[Self.dtype]:
        """The `head_dim` values of request `b` at sequence position `pos`."""
        return self.blocks.unsafe_offset(self.pages().row_offset(b, pos))

    def tile_rows[tile: Int](self, b: Int, j0: Int, last: Int) -> Array[DPtr[Self.dtype], tile]:
        """The rows of positions `j0 .. j0 + tile - 1`, those past `last` at `last`'s (`PageTable.tile_rows`)."""
        return self.pages().tile_rows[Self.dtype, tile](self.blocks, b, j0, last)


comptime FP8_SCALE_BLOCK = 128
"""Latent values per float32 scale in an `fp8_ds_mla` row."""


@fieldwise_init
struct Fp8LatentRows(TrivialRegisterPassable):
    """One layer's rows in the `fp8_ds_mla` format (`pymla/cache_format.py`), or none.

    A row is `row_bytes` bytes: `kv_lora_rank` e4m3 latent values, one
    float32 scale per 128 of them, `rope_dim` bfloat16 rope values. Its
    values are `e4m3 * scale` (exactly bfloat16 values for the power-of-two
    scales pymla writes; other scales' products are read rounded to bfloat16)
    and the rope values.
    `active` is False when the cache holds rows in the op's dtype.
    """

    var bytes: U8Ptr
    var lookup_table: U32Ptr
    var pages_per_request: Int
    var page_size: Int
    var page_stride: Int
    var layer_offset: Int
    var row_bytes: Int
    var kv_lora_rank: Int
    var rope_dim: Int
    var active: Bool

    @staticmethod
    def absent[dtype: DType](rows: PagedLatentRows[dtype]) -> Self:
        """No fp8 rows: the cache holds `rows`, in the op's dtype."""
        return Self(rows.blocks.unsafe_bitcast[UInt8](), rows.lookup_table, 0, 1, 0, 0, 0, 0, 0, False)

    @staticmethod
    def create(
        bytes: U8Ptr,
        lookup_table: U32Ptr,
        pages_per_request: Int,
        num_layers: Int,
        page_size: Int,
        row_bytes: Int,
        layer: Int,
        kv_lora_rank: Int,
    ) -> Self:
        var scale_bytes = 4 * (kv_lora_rank // FP8_SCALE_BLOCK)
        return Self(
            bytes,
            lookup_table,
            pages_per_request,
            page_size,
            num_layers * page_size * row_bytes,
            layer * page_size * row_bytes,
            row_bytes,
            kv_lora_rank,
            (row_bytes - kv_lora_rank - scale_bytes) // 2,
            True,
        )

    def pages(self) -> PageTable:
        return PageTable(
            self.lookup_table, self.pages_per_request, self.page_size, self.page_stride, self.layer_offset, self.row_bytes
        )

    def row(self, b: Int, pos: Int) -> U8Ptr:
        """The `row_bytes` bytes of request `b` at sequence position `pos`."""
        return self.bytes.unsafe_offset(self.pages().row_offset(b, pos))

    def tile_rows[tile: Int](self, b: Int, j0: Int, last: Int) -> Array[U8Ptr, tile]:
        """The rows of positions `j0 .. j0 + tile - 1`, those past `last` at `last`'s (`PageTable.tile_rows`)."""
        return self.pages().tile_rows[DType.uint8, tile](self.bytes, b, j0, last)

    def scales(self, row: U8Ptr) -> FPtr:
        return row.unsafe_offset(self.kv_lora_rank).unsafe_bitcast[Float32]()

    def rope(self, row: U8Ptr) -> DPtr[DType.bfloat16]:
        return row.unsafe_offset(self.kv_lora_rank + 4 * (self.kv_lora_rank // FP8_SCALE_BLOCK)).unsafe_bitcast[
            BFloat16
        ]()

    def dequantize_row[out_dtype: DType](self, b: Int, pos: Int, dst: DPtr[out_dtype]):
        """`dst[:R + Dr]` = the row's values (`e4m3 * scale` rounded to bfloat16, exact for the power-of-two scales
        pymla writes; then the rope part)."""
        self.dequantize(self.row(b, pos), dst)

    def dequantize_rows[out_dtype: DType](self, b: Int, pos: Int, count: Int, dst: DPtr[out_dtype], dst_stride: Int):
        """`dequantize_row` of positions `pos .. pos + count - 1` into rows `dst_stride` apart: one page
        table lookup per page they span (rows within a page are `row_bytes` apart)."""
        var pages = self.pages()
        var c = 0
        while c < count:
            var run = pages.run(b, pos + c, pos + count)
            for i in range(run[1]):
                self.dequantize(self.bytes.unsafe_offset(run[0] + i * self.row_bytes), dst.unsafe_offset((c + i) * dst_stride))
            c += run[1]

    @always_inline
    def dequantize[out_dtype: DType](self, row: U8Ptr, dst: DPtr[out_dtype]):
        """`dst[:R + Dr]` = the values of the row at `row`."""
        comptime W = 16
        var scales = self.scales(row)
        for block in range(self.kv_lora_rank // FP8_SCALE_BLOCK):
            var s = scales.unsafe_load(block)
            comptime if out_dtype == DType.bfloat16:
                var k = bf16_scale_shift(s)
                if k != NO_SHIFT:  # the scales of the rule: bit arithmetic, 64 values a step
                    comptime HALF = FP8_SCALE_BLOCK // 2
                    var base = block * FP8_SCALE_BLOCK
                    var lo = row.unsafe_load[width=HALF](base)
                    var hi = row.unsafe_load[width=HALF](base + HALF)
                    var out = dst.unsafe_bitcast[BFloat16]()
                    if has_zero_exponent[HALF](lo) or has_zero_exponent[HALF](hi):  # one test per block: rare
                        out.unsafe_store(base, widen_e4m3_bf16_any[HALF](lo, k))
                        out.unsafe_store(base + HALF, widen_e4m3_bf16_any[HALF](hi, k))
                    else:
                        out.unsafe_store(base, widen_e4m3_bf16_normal[HALF](lo, k))
                        out.unsafe_store(base + HALF, widen_e4m3_bf16_normal[HALF](hi, k))
                    continue
            comptime for i in range(0, FP8_SCALE_BLOCK, W):
                var at = block * FP8_SCALE_BLOCK + i
                # Rounded to bfloat16 for every reader (exact for a power-of-two scale; other scales' products
                # round, as the GPU kernels' `dequantize8` and the reference's `dequantize_rows` round them).
                var value = (widen_e4m3[W](row.unsafe_load[width=W](at)) * s).cast[DType.bfloat16]()
                dst.unsafe_store(at, value.cast[out_dtype]())
        var rope = self.rope(row)
        var d = 0
        while d + W <= self.rope_dim:
            dst.unsafe_store(self.kv_lora_rank + d, rope.unsafe_load[width=W](d).cast[out_dtype]())
            d += W
        while d < self.rope_dim:
            dst.unsafe_store(self.kv_lora_rank + d, rope.unsafe_load(d).cast[out_dtype]())
            d += 1

    def store_row[src_dtype: DType](self, b: Int, pos: Int, src: DPtr[src_dtype]):
        """Quantizes `src[:R + Dr]` (bfloat16 values) into the row: per 128 latent values the scale
        `fp8.cache_block_scale(amax)` and `e4m3_rne(x / scale)` (exact division, no saturation); the rope part as bfloat16.
        """
        comptime W = 16
        var row = self.row(b, pos)
        var scales = self.scales(row)
        for block in range(self.kv_lora_rank // FP8_SCALE_BLOCK):
            var base = block * FP8_SCALE_BLOCK
            var amax = SIMD[DType.float32, W](0)
            comptime for i in range(0, FP8_SCALE_BLOCK, W):
                amax = max(amax, abs(src.unsafe_load[width=W](base + i).cast[DType.float32]()))
            var s = cache_block_scale(amax.reduce_max())
            scales.unsafe_store(block, s)
            comptime for i in range(0, FP8_SCALE_BLOCK, W):
                var x = src.unsafe_load[width=W](base + i).cast[DType.float32]()
                row.unsafe_store(base + i, e4m3_bytes[W](round_to_e4m3[W](x / s)))
        var rope = self.rope(row)
        for d in range(self.rope_dim):
            rope.unsafe_store(d, src.unsafe_load(self.kv_lora_rank + d).cast[DType.bfloat16]())


comptime MIN_KEYS_PER_PARTITION = 256
"""Step 5 splits a request's keys no finer than this (a partition's setup and merge cost more below)."""


@always_inline
def partition_keys(part: Int, num_partitions: Int, visible: Int, align: Int = 1) -> Tuple[Int, Int]:
    """Half-open key range `[k0, k1)` of partition `part` of a request's `visible` keys.

    The one definition of step 5's split-KV partitions, for every CPU and GPU
    attention kernel (the merge weighs a partition that saw no key by 0).
    Partitions are consecutive runs of `ceil(visible / num_partitions)` keys,
    rounded up to a multiple of `align` (the GPU's key block: every partition
    but the last then starts and ends on a block boundary, so no block is
    loaded by two partitions); when a partition count exceeds what the keys
    fill, the high partitions are empty: `k0 == k1 == visible`, never a start
    past the request's last key. Each request's count comes from `partitions_by_work`.
    """
    var part_len = (visible + num_partitions - 1) // num_partitions
    part_len = (part_len + align - 1) // align * align
    var k0 = min(part * part_len, visible)
    return (k0, min(k0 + part_len, visible))


@always_inline
def partitions_by_work(keys: Int, work: Int, total_work: Int, target_tasks: Int, groups: Int, round_up: Bool) -> Int:
    """Key partitions of one request: its share of `target_tasks` by `work` of the batch's `total_work`.

    The request runs as `groups` tasks per partition (head groups on the CPU,
    row slots on the GPU), so it gets `work target / (total groups)`
    partitions, rounded up (`round_up`: the CPU, whose workers take tasks as
    they come) or down (the GPU, whose grid should stay within one wave of
    blocks), at least one, and none shorter than MIN_KEYS_PER_PARTITION keys
    (`keys` of them in all). The one rule of the CPU plan (`cpu/pipeline.plan_attention`)
    and the GPU schedule (`gpu/schedule.mojo`).
    """
    if total_work <= 0 or groups <= 0:
        return 1
    var num = work * target_tasks
    var den = total_work * groups
    var share = (num + den - 1) // den if round_up else num // den
    return max(1, min(share, (keys + MIN_KEYS_PER_PARTITION - 1) // MIN_KEYS_PER_PARTITION))
