"""What the three attention kernels share: one launch's parameters and one block's place in the work.

`AttentionParams` is the one argument of `attention_fma_kernel`,
`attention_mma_kernel` and `attention_wgmma_kernel`. `AttentionBlock` is
the block setup they share: which request, rows and key partition a block
takes (`locate`, from the split-KV schedule of `schedule.mojo` when the keys are split), each row's mask data (`row_meta`), the cache row of a key
(`key_row`), the keys any of its rows needs (`widen_keys`), and its results:
normalized into `raw` without a split, else the partition's unnormalized
output and row statistics for `merge_kernel` (`result_row`, `store_stats`).
"""

from std.builtin.device_passable import DevicePassable
from std.math import exp
from std.sys._assembly import inlined_assembly
from std.utils.numerics import neg_inf

from max.gpu import barrier, block_idx
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.memory import AddressSpace, async_copy_wait_group

from ..common import FPtr
from ..paged_cache import partition_keys
from ..spec import MaskSpec
from .addressing import attention_slots, find_slot_request, row_attention_meta, slot_start
from .params import DeviceBatch, DeviceCache, KernelParams
from .pdl import launch_attributes, wait_for_producers
from .schedule import SplitSchedule

comptime SPtr[T: AnyType] = Pointer[T, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


@fieldwise_init
struct AttentionParams[dtype: DType](KernelParams):
    """Step 5 for every request of the batch: queries, paged cache, options, outputs.

    Rows are the (token, head) pairs of `q_full [T, H, key_dim]` (float32
    holding dtype values); keys are whole cache rows, values their first
    `kv_lora_rank`. Without a split (`split.active()` false) the kernels write
    `raw [T, H, R]`; with one, each task's partial rows (`schedule.mojo`) of
    `part_out [rows, R]`, `part_max` and `part_sum [rows]`.
    """

    var q_full: FPtr
    var cache: DeviceCache[Self.dtype]  # keys of cache.key_dim values
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
    with a split, row `row`'s partial row is `partial0 + row`.

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
                return Self(0, 0, 0, 0, 0, 0, 0, 0, 0)
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
        var keys = partition_keys(part, parts, p.batch.shard().local_count(visible))
        return Self(
            b, o0, row0, o1 * heads, block_idx.x * rows_per_block - row0, cache_length, visible, keys[0], keys[1]
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
    def tile_row[dtype: DType, //](self, p: AttentionParams[dtype], key: Int, key_end: Int) -> Int64:
        """`key_row(key)`, or -1 (a zero row) from `key_end` on."""
        if key >= key_end:
            return -1
        return Int64(self.key_row(p, key))

    @always_inline
    def result_row[dtype: DType, //](self, p: AttentionParams[dtype], row: Int) -> FPtr:
        """Where row `row`'s (`t H + h`) output goes: its row of `raw` without a split, else its partial row of `part_out`."""
        var rank = Int(p.kv_lora_rank)
        if not p.split.active():
            return p.raw.unsafe_offset(row * rank)
        return p.part_out.unsafe_offset((self.partial0 + row) * rank)

    @staticmethod
    @always_inline
    def result[
        dtype: DType, width: Int
    ](p: AttentionParams[dtype], v: SIMD[DType.float32, width], inv_l: Float32) -> SIMD[DType.float32, width]:
        """The stored value of output `v`: `rnd(v inv_l)` without a split (normalized, in dtype), else `v` (merged later)."""
        if not p.split.active():
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


@fieldwise_init
struct KeyTiles[dtype: DType, kt: Int](TrivialRegisterPassable):
    """Double-buffered key tiles of `kt` keys over keys `[j0, end)`: tile `j0` in `k_s[cur]` while the next is copied.

    `rowoff [2][kt]` (shared) holds each buffer's cache rows. Thread `tid < kt`
    looks up the cache row of key `tid` of a tile one tile ahead of its copy,
    in a register (`ahead`), so the lookup-table load is not waited for at the
    barrier. The kernel starts each copy (`copy_key_tile*`): the first of `rowoff[0]`'s rows into
    `k_s0`, then at each step `next_rows()` into `next_keys()`.
    """

    var rowoff: SPtr[Int64]
    var k_s0: SPtr[Scalar[Self.dtype]]
    var k_s1: SPtr[Scalar[Self.dtype]]
    var ahead: Int64
    var j0: Int
    var end: Int
    var cur: Int
    var has_next: Bool

    def __init__(out self, rowoff: SPtr[Int64], k_s0: SPtr[Scalar[Self.dtype]], k_s1: SPtr[Scalar[Self.dtype]], keys: Tuple[Int, Int]):
        self = Self(rowoff, k_s0, k_s1, Int64(-1), keys[0], keys[1], 0, False)

    @always_inline
    def start(mut self, blk: AttentionBlock, p: AttentionParams[Self.dtype], tid: Int):
        """The rows of the first tile in `rowoff[0]`, the second's in `ahead`; then a barrier."""
        if tid < Self.kt:
            self.rowoff.unsafe_store(tid, blk.tile_row(p, self.j0 + tid, self.end))
        if tid < Self.kt:
            self.ahead = blk.tile_row(p, self.j0 + Self.kt + tid, self.end)
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

    @always_inline
    def wait[fence: Bool](mut self, tid: Int) -> SPtr[Scalar[Self.dtype]]:
        """At the top of tile `j0`'s step: the next tile's rows into `next_rows()`, then waits for
        this tile's copy and the block (`fence`: also orders shared writes before wgmma reads); this tile's keys."""
        self.has_next = self.j0 + Self.kt < self.end
        var nxt = self.next_rows()
        if tid < Self.kt:
            nxt.unsafe_store(tid, self.ahead)
        async_copy_wait_group(0)
        comptime if fence:
            fence_async_proxy()
        barrier()
        return self.k_s0 if self.cur == 0 else self.k_s1

    @always_inline
    def look_ahead(mut self, blk: AttentionBlock, p: AttentionParams[Self.dtype], tid: Int):
        """Once the copy of the next tile has started: the rows of the tile after it."""
        if tid < Self.kt:
            self.ahead = blk.tile_row(p, self.j0 + 2 * Self.kt + tid, self.end)

    @always_inline
    def advance(mut self):
        self.j0 += Self.kt
        self.cur = 1 - self.cur


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
