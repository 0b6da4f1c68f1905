"""What the three attention kernels share: one launch's parameters and one block's place in the work.

`AttentionParams` is the one argument of `attention_fma_kernel`,
`attention_mma_kernel` and `attention_wgmma_kernel`. `AttentionBlock` is
the block setup they share: which request, rows and key partition a block
takes (`locate`), each row's mask data (`row_meta`), the cache row of a key
(`key_row`), the keys any of its rows needs (`widen_keys`), and its results:
normalized into `raw` with one partition, else the partition's unnormalized
output and row statistics for `merge_kernel` (`store_output`, `store_stats`).
"""

from max.gpu import block_idx
from max.gpu.host import DeviceContext, FuncAttribute

from ..common import FPtr
from ..paged_cache import partition_keys
from ..spec import MaskSpec
from .addressing import attention_slots, find_slot_request, row_attention_meta, slot_start
from .params import DeviceBatch, DeviceCache, KernelParams


@fieldwise_init
struct AttentionParams[dtype: DType](KernelParams):
    """Step 5 for every request of the batch: queries, paged cache, options, outputs.

    Rows are the (token, head) pairs of `q_full [T, H, key_dim]` (float32
    holding dtype values); keys are whole cache rows, values their first
    `kv_lora_rank`. With one partition the kernels write `raw [T, H, R]`;
    with several, `part_out [P, T H, R]`, `part_max`, `part_sum [P, T H]`.
    """

    var q_full: FPtr
    var cache: DeviceCache[Self.dtype]  # keys of cache.key_dim values
    var batch: DeviceBatch
    var num_heads: Int32
    var kv_lora_rank: Int32
    var num_partitions: Int32
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
    """One block's request `request`, rows `[row0, row_end)` (`t H + h`) and keys `[k0, k1)`.

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
    var total_rows: Int  # T H
    var cache_length: Int
    var visible: Int  # the request's positions: cached and new
    var part: Int
    var k0: Int
    var k1: Int

    @staticmethod
    @always_inline
    def locate[dtype: DType, //, rows_per_block: Int](p: AttentionParams[dtype]) -> Self:
        """Block `(slot, part)` of the grid `(attention_slots(T, H, B, rows_per_block), P)`."""
        var heads = Int(p.num_heads)
        var nreq = Int(p.batch.num_requests)
        var slot = block_idx.x
        var b = find_slot_request(p.batch.offsets, nreq, heads, rows_per_block, slot)
        var o0 = Int(p.batch.offsets.unsafe_load(b))
        var o1 = Int(p.batch.offsets.unsafe_load(b + 1))
        var row0 = o0 * heads + (slot - slot_start(p.batch.offsets, b, heads, rows_per_block)) * rows_per_block
        var cache_length = Int(p.batch.cache_lengths.unsafe_load(b))
        var visible = cache_length + o1 - o0  # positions (the mask's)
        var keys = partition_keys(block_idx.y, Int(p.num_partitions), p.batch.shard().local_count(visible))
        return Self(
            b, o0, row0, o1 * heads, Int(p.batch.offsets.unsafe_load(nreq)) * heads, cache_length,
            visible, block_idx.y, keys[0], keys[1],
        )

    @always_inline
    def has_rows(self) -> Bool:
        """Whether the block has rows (a request's last slot may have none)."""
        return self.row0 < self.row_end

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
        """Where row `row`'s (`t H + h`) output goes: its row of `raw` with one partition, else of this partition's `part_out`."""
        var rank = Int(p.kv_lora_rank)
        if p.num_partitions == 1:
            return p.raw.unsafe_offset(row * rank)
        return p.part_out.unsafe_offset((self.part * self.total_rows + row) * rank)

    @staticmethod
    @always_inline
    def result[
        dtype: DType, width: Int
    ](p: AttentionParams[dtype], v: SIMD[DType.float32, width], inv_l: Float32) -> SIMD[DType.float32, width]:
        """The stored value of output `v`: `rnd(v inv_l)` with one partition (normalized, in dtype), else `v` (merged later)."""
        if p.num_partitions == 1:
            return (v * inv_l).cast[dtype]().cast[DType.float32]()
        return v

    @staticmethod
    @always_inline
    def inverse_sum(l: Float32) -> Float32:
        """`1 / l`, 0 for a row that saw no key (its output is 0)."""
        return Float32(1) / l if l > 0 else Float32(0)

    @always_inline
    def store_stats[dtype: DType, //](self, p: AttentionParams[dtype], row: Int, m: Float32, l: Float32):
        """Row `row`'s running max and sum of this partition, for `merge_kernel` (several partitions)."""
        if p.num_partitions > 1 and row < self.row_end:
            p.part_max.unsafe_store(self.part * self.total_rows + row, m)
            p.part_sum.unsafe_store(self.part * self.total_rows + row, l)


def enqueue_attention[
    dtype: DType, //, kernel: def(AttentionParams[dtype]) thin -> None, rows_per_block: Int
](
    ctx: DeviceContext,
    p: AttentionParams[dtype],
    num_tokens: Int,
    block_threads: Int,
    smem_bytes: Int,
) raises:
    """Launches one attention kernel: grid `(slots, partitions)`, `smem_bytes` of dynamic shared memory."""
    ctx.enqueue_function[kernel](
        p,
        grid_dim=(
            attention_slots(num_tokens, Int(p.num_heads), Int(p.batch.num_requests), rows_per_block),
            Int(p.num_partitions),
        ),
        block_dim=block_threads,
        shared_mem_bytes=smem_bytes,
        func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem_bytes)),
    )
