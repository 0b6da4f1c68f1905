"""What the three attention kernels share: one launch's parameters and one block's place in the work.

`AttentionParams` is the one argument of `attention_fma_kernel`,
`attention_mma_kernel` and `attention_wgmma_kernel`. `AttentionBlock` is
the block setup they share: which request, rows and key partition a block
takes (`locate`, from the split-KV schedule of `schedule.mojo` when the keys are split), each row's mask data (`row_meta`), the cache row of a key
(`key_row`), the keys any of its rows needs (`widen_keys`), and its results:
normalized into `raw` where the block holds all of its request's keys (no
split, or the request's only partition), else the partition's unnormalized
output; with a split, row statistics for `merge_kernel` too (`result_row`,
`result`, `store_stats`).

`KeyTiles` holds the key tiles of the tensor-core kernels. Their key source is
a compile-time parameter: rows of `dtype` copied with `cp.async` straight into
the tiles, or `fp8_ds_mla` rows (`fp8`, bfloat16 ops): their bytes copied with
`cp.async` into a staging area (`copy_staged`), then widened into the one
bfloat16 tile at the top of each step (`widen_staged`: e4m3 x scale, exact),
so the tensor-core products are those of the bfloat16 cache.
"""

from std.builtin.device_passable import DevicePassable
from std.memory import bitcast
from std.math import exp
from std.sys._assembly import inlined_assembly
from std.utils.numerics import neg_inf

from max.gpu import barrier, block_idx
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.memory import AddressSpace, async_copy, async_copy_commit_group, async_copy_wait_group

from ..common import FPtr, ceil_div
from ..paged_cache import FP8_SCALE_BLOCK, partition_keys
from ..spec import MaskSpec
from .addressing import attention_slots, find_slot_request, row_attention_meta, slot_start
from .params import DeviceBatch, DeviceCache, DeviceFp8Rows, GlobalPtr, KernelParams, to_global
from .pdl import launch_attributes, wait_for_producers
from .schedule import SplitSchedule

comptime SPtr[T: AnyType] = Pointer[T, MutUntrackedOrigin, address_space=AddressSpace.SHARED]
comptime PARTITION_ALIGN = 64
"""Key partitions start on multiples of this many slots (`partition_keys`): the sm90 kernels' key
block (`tma_smem.S9_KEYS`, which asserts it), so no block is copied by two partitions."""


@fieldwise_init
struct AttentionParams[dtype: DType](KernelParams):
    """Step 5 for every request of the batch: queries, paged cache, options, outputs.

    Rows are the (token, head) pairs of `q_full [T, H, key_dim]` (float32
    holding dtype values); keys are whole cache rows, values their first
    `kv_lora_rank`. Without a split (`split.active()` false) the kernels write
    `raw [T, H, R]`; with one, each task's partial rows (`schedule.mojo`) of
    `part_out [rows, R]`, `part_max` and `part_sum [rows]`, except that a
    request's only partition writes its rows normalized into `raw` (and its
    statistics, for the LSE), as FlashMLA's split kernel does.
    With an `fp8_ds_mla` cache the rows are `fp8`'s (the kernels' `fp8`
    parameter says which) and `cache` gives only `key_dim`.
    """

    var q_full: FPtr
    var cache: DeviceCache[Self.dtype]  # keys of cache.key_dim values
    var fp8: DeviceFp8Rows
    var batch: DeviceBatch
    var num_heads: Int32
    var kv_lora_rank: Int32
    var split: SplitSchedule  # grid 0: no split
    var scale: Float32
    var mask_kind: Int32
    var window: Int32
    var score_mod: Int32
    var raw: FPtr
    var part_out: FPtr
    var part_max: FPtr
    var part_sum: FPtr


@fieldwise_init
struct AttentionBlock(TrivialRegisterPassable):
    """One block's request `request`, rows `[row0, row_end)` (`t H + h`) and keys `[k0, k1)`;
    with a split, row `row`'s partial row is `partial0 + row`. `normalized`: the block holds all of
    its request's keys (no split, or the request's only partition) and writes its rows normalized
    into `raw`; the merge then only reads them (`merge_kernel`).

    Keys are the cache's slots: with a shard of the cache (`DeviceBatch.shard`),
    slot `j` holds position `shard.position(j)`; the key ranges of `row_meta` are slots.

    Its methods take the launch's `AttentionParams`: kernel parameters stay in
    parameter space, where the compiler reloads them instead of holding them
    in registers (holding them made the wgmma kernel spill 10x more).
    """

    var request: Int
    var first_token: Int  # the request's first query row (input_row_offsets[b])
    var row0: Int
    var row_end: Int
    var partial0: Int
    var cache_length: Int
    var visible: Int  # the request's positions: cached and new
    var k0: Int
    var k1: Int
    var normalized: Bool

    @staticmethod
    @always_inline
    def locate[dtype: DType, //, rows_per_block: Int](p: AttentionParams[dtype]) -> Self:
        """Block `block_idx.x`: task `block_idx.x` of the split schedule (`split.active()`), else row slot
        `block_idx.x` of the grid `attention_slots(T, H, B, rows_per_block)` with all of its request's keys."""
        var heads = Int(p.num_heads)
        var b: Int
        var slot: Int
        var part = 0
        var parts = 1
        if p.split.active():
            wait_for_producers()  # the q step's launch may build the schedule (pdl.mojo; else a no-op)
            var task = p.split.task(block_idx.x)
            if task[0] < 0:  # past the schedule's tasks: no rows
                return Self(0, 0, 0, 0, 0, 0, 0, 0, 0, True)
            b = Int(task[0])
            slot = Int(task[1])
            part = Int(task[2])
            parts = Int(task[3])
        else:
            b = find_slot_request(p.batch.offsets, Int(p.batch.num_requests), heads, rows_per_block, block_idx.x)
            slot = block_idx.x - slot_start(p.batch.offsets, b, heads, rows_per_block)
        var o0 = Int(p.batch.offsets.unsafe_load(b))
        var o1 = Int(p.batch.offsets.unsafe_load(b + 1))
        var row0 = o0 * heads + slot * rows_per_block
        var cache_length = Int(p.batch.cache_lengths.unsafe_load(b))
        var visible = cache_length + o1 - o0  # positions (the mask's)
        var keys = partition_keys(part, parts, p.batch.shard().local_count(visible), PARTITION_ALIGN)
        return Self(
            b, o0, row0, o1 * heads, block_idx.x * rows_per_block - row0, cache_length, visible, keys[0], keys[1],
            parts == 1,
        )

    @always_inline
    def has_rows(self) -> Bool:
        """Whether the block has rows (a request's last slot may have none)."""
        return self.row0 < self.row_end

    @always_inline
    def exits_empty(self) -> Bool:
        """Whether the block has no rows and exits; such a block still waits for the kernels
        ahead of it first (with PDL every block of a dependent launch waits, pdl.mojo)."""
        if self.has_rows():
            return False
        wait_for_producers()
        return True

    @always_inline
    def row_meta[dtype: DType, //](self, p: AttentionParams[dtype], r: Int) -> Tuple[Int, Int, Int, Float32]:
        """Key slots `[lo, hi)`, position and ALiBi slope of block row `r`; zeros past the request's rows.

        ALiBi takes the key's slot for its position: the whole cache only (a shard with ALiBi is refused).
        """
        if self.row0 + r >= self.row_end:
            return (0, 0, 0, Float32(0))
        var meta = row_attention_meta(
            self.row0 + r, Int(p.num_heads), self.cache_length, self.first_token, self.visible,
            MaskSpec(Int(p.mask_kind), Int(p.window)), Int(p.score_mod),
        )
        var shard = p.batch.shard()
        return (shard.local_count(meta[0]), shard.local_count(meta[1]), meta[2], meta[3])

    @always_inline
    def widen_keys(self, span: Tuple[Int, Int], lo: Int, hi: Int) -> Tuple[Int, Int]:
        """`span` grown by a row's keys `[lo, hi)` within the partition; start from `(k1, k0)`."""
        if lo >= hi:
            return span
        return (min(span[0], max(lo, self.k0)), max(span[1], min(hi, self.k1)))

    @always_inline
    def key_row[dtype: DType, //](self, p: AttentionParams[dtype], key: Int) -> Int:
        """Element offset in the cache blocks of the request's key `key`."""
        return p.cache.row_offset(self.request, key)

    @always_inline
    def tile_row[dtype: DType, //, fp8: Bool](self, p: AttentionParams[dtype], key: Int, key_end: Int) -> Int64:
        """`key_row(key)` (`fp8`: the byte offset of its `fp8_ds_mla` row), or -1 (a zero row) from `key_end` on."""
        if key >= key_end:
            return -1
        comptime if fp8:
            return Int64(p.fp8.rows.row_offset(self.request, key))
        return Int64(self.key_row(p, key))

    @always_inline
    def result_row[dtype: DType, //](self, p: AttentionParams[dtype], row: Int) -> FPtr:
        """Where row `row`'s (`t H + h`) output goes: its row of `raw` (`normalized`), else its partial row of `part_out`."""
        var rank = Int(p.kv_lora_rank)
        if self.normalized:
            return p.raw.unsafe_offset(row * rank)
        return p.part_out.unsafe_offset((self.partial0 + row) * rank)

    @always_inline
    def result[
        dtype: DType, width: Int
    ](self, v: SIMD[DType.float32, width], inv_l: Float32) -> SIMD[DType.float32, width]:
        """The stored value of output `v`: `rnd(v inv_l)` (`normalized`: in dtype), else `v` (merged later)."""
        if self.normalized:
            return (v * inv_l).cast[dtype]().cast[DType.float32]()
        return v

    @staticmethod
    @always_inline
    def inverse_sum(l: Float32) -> Float32:
        """`1 / l`, 0 for a row that saw no key (its output is 0)."""
        return Float32(1) / l if l > 0 else Float32(0)

    @always_inline
    def store_stats[dtype: DType, //](self, p: AttentionParams[dtype], row: Int, m: Float32, l: Float32):
        """Row `row`'s running max and sum of this partition, for `merge_kernel` (with a split)."""
        if p.split.active() and row < self.row_end:
            p.part_max.unsafe_store(self.partial0 + row, m)
            p.part_sum.unsafe_store(self.partial0 + row, l)


@always_inline
def rescale_row(m_old: Float32, m_new: Float32) -> Tuple[Float32, Float32]:
    """A row's online-softmax step to the running max `m_new` from `m_old`: the correction of its sums
    `exp(m_old - m_new)`, and the shift its scores take before `exp` (`m_new`; 0 with a correction of 1
    for a row masked so far, whose scores are all -inf: exp(-inf) = 0 everywhere)."""
    if m_new == neg_inf[DType.float32]():
        return (Float32(1), Float32(0))
    return (exp(m_old - m_new), m_new)


@fieldwise_init
struct RowMasks(TrivialRegisterPassable):
    """The block rows' mask data in shared memory (`row_meta`): key range `[lo, hi)`, position, ALiBi slope."""

    var lo: SPtr[Int32]
    var hi: SPtr[Int32]
    var pos: SPtr[Int32]
    var slope: SPtr[Float32]

    @always_inline
    def store[dtype: DType, //](self, blk: AttentionBlock, p: AttentionParams[dtype], r: Int):
        """Block row `r`'s mask data (one thread per row)."""
        var meta = blk.row_meta(p, r)
        self.lo.unsafe_store(r, Int32(meta[0]))
        self.hi.unsafe_store(r, Int32(meta[1]))
        self.pos.unsafe_store(r, Int32(meta[2]))
        self.slope.unsafe_store(r, meta[3])

    @always_inline
    def key_span(self, blk: AttentionBlock, rows: Int) -> Tuple[Int, Int]:
        """The keys `[lo, hi)` of the partition that any of the block's `rows` rows needs (after a barrier)."""
        var span = (blk.k1, blk.k0)
        for r in range(rows):
            span = blk.widen_keys(span, Int(self.lo.unsafe_load(r)), Int(self.hi.unsafe_load(r)))
        return span


@fieldwise_init
struct SoftmaxRows(TrivialRegisterPassable):
    """The block rows' online softmax in shared memory: running max `m`, sum `l`, last correction; their masks."""

    var m: SPtr[Float32]
    var l: SPtr[Float32]
    var corr: SPtr[Float32]
    var masks: RowMasks

    @staticmethod
    @always_inline
    def carve(base: SPtr[UInt8], off: Int, rows: Int) -> Self:
        """Seven tables of `rows` 4-byte values from `base + off`: m, l, corr, slope, lo, hi, pos."""
        var at = base.unsafe_offset(off)
        var masks = RowMasks(
            at.unsafe_offset(4 * rows * 4).unsafe_bitcast[Int32](),
            at.unsafe_offset(5 * rows * 4).unsafe_bitcast[Int32](),
            at.unsafe_offset(6 * rows * 4).unsafe_bitcast[Int32](),
            at.unsafe_offset(3 * rows * 4).unsafe_bitcast[Float32](),
        )
        return Self(
            at.unsafe_bitcast[Float32](),
            at.unsafe_offset(rows * 4).unsafe_bitcast[Float32](),
            at.unsafe_offset(2 * rows * 4).unsafe_bitcast[Float32](),
            masks,
        )

    @always_inline
    def start[dtype: DType, //](self, blk: AttentionBlock, p: AttentionParams[dtype], r: Int):
        """Block row `r`'s mask data and empty softmax state (one thread per row)."""
        self.masks.store(blk, p, r)
        self.m.unsafe_store(r, neg_inf[DType.float32]())
        self.l.unsafe_store(r, Float32(0))
        self.corr.unsafe_store(r, Float32(1))


@always_inline
def fence_async_proxy():
    """Orders this thread's generic-proxy shared-memory writes before wgmma's (async proxy) reads."""
    inlined_assembly["fence.proxy.async.shared::cta;", NoneType, constraints="~{memory}", has_side_effect=True]()


@always_inline
def opaque(x: Int) -> Int:
    """`x` through an empty `asm volatile` move: the optimizer cannot treat it, or what is derived
    from it, as loop-invariant (so values derived from it are not held in registers across a loop),
    nor move what is derived from it above the branch it is taken in (`WidenedBox.store`)."""
    return Int(inlined_assembly["mov.b64 $0, $1;", Int64, constraints="=l,l", has_side_effect=True](Int64(x)))


@always_inline
def opaque_shared[T: AnyType](p: SPtr[T]) -> SPtr[T]:
    """`p` through `opaque`."""
    return SPtr[T](unsafe_from_address=opaque(Int(p)))


@always_inline
def fp8_row_bytes(kv_lora_rank: Int, rope_dim: Int) -> Int:
    """Bytes of an `fp8_ds_mla` row: the e4m3 latent, its float32 scales, the bfloat16 rope part."""
    return kv_lora_rank + 4 * (kv_lora_rank // FP8_SCALE_BLOCK) + 2 * rope_dim


@always_inline
def fp8_staging_stride(row_bytes: Int) -> Int:
    """Bytes per staged `fp8_ds_mla` row: the row, rounded up to 16 bytes."""
    return ceil_div(row_bytes, 16) * 16


@always_inline
def key_tile_bytes[dtype: DType](kt: Int, key_bytes: Int, fp8_row_bytes: Int, stages: Int = 1) -> Int:
    """Shared memory of a kernel's key tiles (`key_bytes` per key of one buffer, 16-byte aligned):
    two buffers of `dtype` keys, or (`fp8_row_bytes > 0`) one bfloat16 buffer and `stages` stagings
    of `kt` fp8 rows (`KeyTiles.stages`)."""
    var buffer = ceil_div(kt * key_bytes, 16) * 16
    if fp8_row_bytes > 0:
        return buffer + stages * kt * fp8_staging_stride(fp8_row_bytes)
    return 2 * buffer


@fieldwise_init
struct KeyTiles[
    dtype: DType,
    kt: Int,
    fp8: Bool = False,
    core_layout: Bool = False,
    dims: Tuple[Int, Int] = (0, 0),
    stages: Int = 1,
](TrivialRegisterPassable):
    """Double-buffered key tiles of `kt` keys over keys `[j0, end)`: tile `j0` in `k_s[cur]` while the next is copied.

    `rowoff [2][kt]` (shared) holds each buffer's cache rows. Thread `tid < kt`
    looks up the cache row of key `tid` of a tile one tile ahead of its copy,
    in a register (`ahead`), so the lookup-table load is not waited for at the
    barrier. The kernel starts each copy (`copy_key_tile*`): the first of `rowoff[0]`'s rows into
    `k_s0`, then at each step `next_rows()` into `next_keys()`.

    `fp8`: the keys are `fp8_ds_mla` rows (`p.fp8`, byte offsets in `rowoff`),
    copied into a staging area (rows of `fp8_staging_stride` bytes) and widened
    by `wait` into `k_s0` (`k_s1` is the same buffer). With one staging
    (`stages` 1) the kernel starts each copy with `copy_staged` after `wait`,
    whose second barrier frees the staging. With two (`stages` 2, tile `j0`
    staged in slot `cur`), `wait` itself starts the next tile's copy into the
    other slot before it widens this one, so the copy overlaps the widening
    too (`COPIES_IN_WAIT`; the kernel's loop then starts none). The tile layout: rows of `stride` elements, or
    (`core_layout`) wgmma's core matrices of 8 rows x 16 bytes. `dims`:
    (kv_lora_rank, rope_dim) when the kernel knows them at compile time.
    """

    var rowoff: SPtr[Int64]
    var k_s0: SPtr[Scalar[Self.dtype]]
    var k_s1: SPtr[Scalar[Self.dtype]]
    var staging: SPtr[UInt8]
    var stride: Int  # elements per key row of a tile (row layout)
    var ahead: Int64
    var j0: Int
    var end: Int
    var cur: Int
    var has_next: Bool

    def __init__(
        out self,
        rowoff: SPtr[Int64],
        k_s0: SPtr[Scalar[Self.dtype]],
        k_s1: SPtr[Scalar[Self.dtype]],
        keys: Tuple[Int, Int],
        staging: SPtr[UInt8],
        stride: Int,
    ):
        self = Self(rowoff, k_s0, k_s1, staging, stride, Int64(-1), keys[0], keys[1], 0, False)

    @always_inline
    def start(mut self, blk: AttentionBlock, p: AttentionParams[Self.dtype], tid: Int):
        """The rows of the first tile in `rowoff[0]`, the second's in `ahead`; then a barrier."""
        if tid < Self.kt:
            self.rowoff.unsafe_store(tid, blk.tile_row[Self.fp8](p, self.j0 + tid, self.end))
        if tid < Self.kt:
            self.ahead = blk.tile_row[Self.fp8](p, self.j0 + Self.kt + tid, self.end)
        barrier()

    @always_inline
    def more(self) -> Bool:
        return self.j0 < self.end

    @always_inline
    def first_is_old(self, blk: AttentionBlock, p: AttentionParams[Self.dtype]) -> Bool:
        """Whether the first tile's keys are all rows cached before this call (slots below the request's
        cache length): steps 1-2 rewrite only the new tokens' rows, so with PDL (pdl.mojo) this tile
        may be copied before `wait_for_producers`."""
        return min(self.j0 + Self.kt, self.end) <= p.batch.shard().local_count(blk.cache_length)

    @always_inline
    def next_rows(self) -> SPtr[Int64]:
        """The cache rows of the next tile's buffer."""
        return self.rowoff.unsafe_offset((1 - self.cur) * Self.kt)

    @always_inline
    def next_keys(self) -> SPtr[Scalar[Self.dtype]]:
        """The next tile's buffer."""
        return self.k_s1 if self.cur == 0 else self.k_s0

    comptime COPIES_IN_WAIT = Self.fp8 and Self.stages == 2
    """Whether `wait` starts the next tile's copy (and its look-ahead) itself."""

    @always_inline
    def wait[
        fence: Bool, threads: Int
    ](mut self, blk: AttentionBlock, p: AttentionParams[Self.dtype], tid: Int) -> SPtr[Scalar[Self.dtype]]:
        """At the top of tile `j0`'s step: the next tile's rows into `next_rows()`, then waits for
        this tile's copy and the block (`fence`: also orders shared writes before wgmma reads); this tile's keys.
        `fp8`: widens the staged tile into the keys between two barriers (`COPIES_IN_WAIT`: after
        starting the next tile's copy into the other staging slot)."""
        comptime assert Self.stages == 1 or (Self.fp8 and Self.stages == 2), "two stagings are for fp8 rows"
        self.has_next = self.j0 + Self.kt < self.end
        var nxt = self.next_rows()
        if tid < Self.kt:
            nxt.unsafe_store(tid, self.ahead)
        async_copy_wait_group(0)
        comptime if Self.fp8:
            barrier()  # the staged rows are in; the previous tile's products are done; `nxt` is written
            comptime if Self.COPIES_IN_WAIT:
                # The other slot held the previous tile, widened before the last step's second barrier.
                if self.has_next:
                    self.copy_staged[threads](p, nxt, tid, 1 - self.cur)
                    self.look_ahead(blk, p, tid)
            self.widen_staged[threads](p, tid)
        comptime if fence:
            fence_async_proxy()
        barrier()
        comptime if Self.fp8:
            # One buffer: hidden from the optimizer, else it hoists every address (and wgmma
            # descriptor) derived from it out of the loop (80 registers held: spills).
            return opaque_shared(self.k_s0)
        return self.k_s0 if self.cur == 0 else self.k_s1

    @always_inline
    def staged(self, slot: Int, row_bytes: Int) -> SPtr[UInt8]:
        """Staging slot `slot` (0 with one staging) for rows of `row_bytes` bytes."""
        comptime if Self.stages == 1:
            return self.staging
        return self.staging.unsafe_offset(slot * Self.kt * fp8_staging_stride(row_bytes))

    @always_inline
    def copy_staged[threads: Int](self, p: AttentionParams[Self.dtype], rows: SPtr[Int64], tid: Int, slot: Int = 0):
        """`fp8`: starts the copy of the `fp8_ds_mla` rows at byte offsets `rows [kt]` (-1: zeros)
        into staging slot `slot`; one commit group. 16-byte copies when rows are 16-byte multiples, else 4."""
        var src = to_global(p.fp8.rows.blocks)
        comptime if Self.dims[0] > 0:
            comptime row_bytes = fp8_row_bytes(Self.dims[0], Self.dims[1])
            comptime vec = 16 if row_bytes % 16 == 0 else 4
            copy_rows_async[Self.kt, threads, vec](src, rows, self.staged(slot, row_bytes), tid, row_bytes)
            async_copy_commit_group()
            return
        var row_bytes = opaque(p.fp8.row_bytes())  # its divisions here, not held across the loop
        if row_bytes % 16 == 0:
            copy_rows_async[Self.kt, threads, 16](src, rows, self.staged(slot, row_bytes), tid, row_bytes)
        else:
            copy_rows_async[Self.kt, threads, 4](src, rows, self.staged(slot, row_bytes), tid, row_bytes)
        async_copy_commit_group()

    @always_inline
    def widen_staged[threads: Int](self, p: AttentionParams[Self.dtype], tid: Int):
        """The staged `fp8_ds_mla` rows as `dtype` (bfloat16) keys in `k_s0`, in 8-value chunks:
        latent chunks `e4m3 x scale` (exact in bfloat16: `pymla/cache_format.py`), then the rope part.
        With `dims` (kv_lora_rank, rope_dim) known at compile time (`Self.dims[0] > 0`), those."""
        var rank = opaque(Int(p.fp8.kv_lora_rank))  # as `copy_staged`'s row_bytes
        var rope = Int(p.fp8.rope_dim)
        comptime if Self.dims[0] > 0:
            rank = Self.dims[0]
            rope = Self.dims[1]
        var chunks = (rank + rope) // 8  # per key
        var srow = fp8_staging_stride(fp8_row_bytes(rank, rope))
        var staging = self.staged(self.cur, fp8_row_bytes(rank, rope))
        comptime if Self.core_layout:  # lanes 8 apart fill one core matrix: linear stores
            var v = tid
            while v < Self.kt * chunks:
                var r = (v // (8 * chunks)) * 8 + v % 8
                var c = (v // 8) % chunks
                self.k_s0.unsafe_offset(v * 8).unsafe_store[alignment=16](
                    0, widen_chunk[Self.dtype](staging.unsafe_offset(r * srow), c, rank)
                )
                v += threads
        else:  # consecutive threads: consecutive chunks of a row (stepped without divisions)
            var r = tid // chunks
            var c = tid % chunks
            var step_r = threads // chunks
            var step_c = threads % chunks
            while r < Self.kt:
                self.k_s0.unsafe_offset(r * self.stride + c * 8).unsafe_store[alignment=16](
                    0, widen_chunk[Self.dtype](staging.unsafe_offset(r * srow), c, rank)
                )
                r += step_r
                c += step_c
                if c >= chunks:
                    c -= chunks
                    r += 1

    @always_inline
    def look_ahead(mut self, blk: AttentionBlock, p: AttentionParams[Self.dtype], tid: Int):
        """Once the copy of the next tile has started: the rows of the tile after it."""
        if tid < Self.kt:
            self.ahead = blk.tile_row[Self.fp8](p, self.j0 + 2 * Self.kt + tid, self.end)

    @always_inline
    def advance(mut self):
        self.j0 += Self.kt
        self.cur = 1 - self.cur


@always_inline
def dequantize8[dtype: DType](e4m3: SIMD[DType.uint8, 8], scale: Float32) -> SIMD[dtype, 8]:
    """Eight e4m3 bytes of an `fp8_ds_mla` row times their block's scale, as `dtype` (exact in bfloat16:
    `pymla/cache_format.py`). The bytes widen on the hardware (`cvt.rn.f16x2.e4m3x2`, then f16 -> f32:
    exact, about half the instructions of `fp8.widen_e4m3`'s integer path); the product in float32
    rounded to `dtype`, as the CPU's `Fp8LatentRows.dequantize_row`."""
    return (bitcast[DType.float8_e4m3fn, 8](e4m3).cast[DType.float32]() * scale).cast[dtype]()


@always_inline
def widen_chunk[dtype: DType](row: SPtr[UInt8], c: Int, rank: Int) -> SIMD[dtype, 8]:
    """Values `8 c .. 8 c + 7` of the staged `fp8_ds_mla` row `row` (`rank` latent values) as `dtype`:
    `dequantize8`, or the rope part's bfloat16 values."""
    if 8 * c < rank:
        var e4m3 = row.unsafe_offset(8 * c).unsafe_load[width=8, alignment=8](0)
        var scale = row.unsafe_offset(rank + 4 * (8 * c // FP8_SCALE_BLOCK)).unsafe_bitcast[Float32]().unsafe_load[alignment=4](0)
        return dequantize8[dtype](e4m3, scale)
    var rope_at = rank + 4 * (rank // FP8_SCALE_BLOCK)
    return row.unsafe_offset(rope_at + 2 * (8 * c - rank)).unsafe_bitcast[BFloat16]().unsafe_load[width=8, alignment=4](0).cast[dtype]()


@always_inline
def copy_rows_async[
    kt: Int, threads: Int, vec: Int
](src: GlobalPtr[UInt8], rows: SPtr[Int64], staging: SPtr[UInt8], tid: Int, row_bytes: Int):
    """Starts `cp.async` copies of `vec` bytes: row `r` (byte offset `rows[r]`, -1: zeros) to
    `staging + r fp8_staging_stride(row_bytes)`; thread `tid` takes vectors `tid, tid + threads, ..`."""
    var per_row = row_bytes // vec
    var srow = fp8_staging_stride(row_bytes)
    var r = tid // per_row
    var c = tid % per_row
    var step_r = threads // per_row
    var step_c = threads % per_row
    while r < kt:
        var ro = Int(rows.unsafe_load(r))
        async_copy[vec, fill=UInt8(0)](
            src.unsafe_offset(max(ro, 0) + c * vec),
            staging.unsafe_offset(r * srow + c * vec),
            src_size=Int32(vec) if ro >= 0 else Int32(0),
        )
        r += step_r
        c += step_c
        if c >= per_row:
            c -= per_row
            r += 1


def attention_grid[dtype: DType](p: AttentionParams[dtype], num_tokens: Int, rows_per_block: Int) -> Int:
    """Blocks of an attention launch: the split schedule's grid (`p.split`), else one per row slot
    (`attention_slots`)."""
    if p.split.active():
        return Int(p.split.grid)
    return attention_slots(num_tokens, Int(p.num_heads), Int(p.batch.num_requests), rows_per_block)


def enqueue_attention[
    dtype: DType, //, kernel: def(AttentionParams[dtype]) thin -> None, rows_per_block: Int
](
    ctx: DeviceContext,
    p: AttentionParams[dtype],
    num_tokens: Int,
    block_threads: Int,
    smem_bytes: Int,
    pdl: Bool,
) raises:
    """Launches one attention kernel on `p` (`enqueue_attention_with`)."""
    enqueue_attention_with[kernel, rows_per_block](ctx, p, p, num_tokens, block_threads, smem_bytes, pdl)


def enqueue_attention_with[
    dtype: DType, P: DevicePassable, //, kernel: def(P) thin -> None, rows_per_block: Int
](
    ctx: DeviceContext,
    params: P,
    p: AttentionParams[dtype],
    num_tokens: Int,
    block_threads: Int,
    smem_bytes: Int,
    pdl: Bool,
) raises:
    """Launches one attention kernel on `params` (which hold `p`, as the TMA kernel's do): grid
    `attention_grid`, `smem_bytes` of dynamic shared memory; with `pdl`, programmatic dependent
    launch after the q step (pdl.mojo)."""
    ctx.enqueue_function[kernel](
        params,
        grid_dim=attention_grid(p, num_tokens, rows_per_block),
        block_dim=block_threads,
        shared_mem_bytes=smem_bytes,
        func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem_bytes)),
        attributes=launch_attributes(pdl),
    )
