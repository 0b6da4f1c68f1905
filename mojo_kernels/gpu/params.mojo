"""What every kernel parameter struct shares: the `DevicePassable` bit copy, the batch, the paged cache.

A launch takes one parameter struct (FlashMLA's `Flash_fwd_mla_params`
style): plain pointers and fixed-width scalars (`Int` is not
`DevicePassable` in this Mojo), passed by bit copy (`KernelParams`).
`DeviceBatch`, `DeviceCache` and `DeviceFp8Rows` are the device forms of the
root's `RaggedBatch`, `PagedLatentRows` and `Fp8LatentRows`, fields of the
structs that need them.

Pointers a kernel reads or writes through are global memory: a kernel's
loose pointer arguments are known to be global, a struct's fields are not
(the compiler emits generic loads and stores for them unless it can split the
struct), so the parameter structs of the merge, store, FMA projection, q rope
and q / output step kernels hold `GlobalPtr`s (`to_global` on the host), and
`DeviceBatch` hands out its pointers as global ones. `AttentionParams`,
`DeviceCache` and `CacheRowsParams` keep generic pointers, as their kernels
had them before the structs; the attention kernels cast the cache blocks
(`to_global`) for their `cp.async` copies.
"""

from std.builtin.device_passable import DevicePassable, DeviceTypeEncoder

from max.gpu.memory import AddressSpace

from ..common import DPtr, FPtr, U8Ptr, U32Ptr
from ..paged_cache import FP8_SCALE_BLOCK, CacheShard, Fp8LatentRows, PagedLatentRows, PageTable, RaggedBatch
from .addressing import find_request


comptime GlobalPtr[T: AnyType] = Pointer[T, MutUntrackedOrigin, address_space=AddressSpace.GLOBAL]
"""An untracked pointer into global memory."""

comptime GPtr[dtype: DType] = GlobalPtr[Scalar[dtype]]
comptime GFPtr = GlobalPtr[Float32]


@always_inline
def to_global[T: AnyType](p: Pointer[T, MutUntrackedOrigin]) -> GlobalPtr[T]:
    """`p`, a device pointer, as a pointer into global memory (on the host: the same address)."""
    return p.unsafe_address_space_cast[AddressSpace.GLOBAL]()


trait KernelParams(DevicePassable, TrivialRegisterPassable):
    """A kernel's one parameter struct, passed to the device by bit copy."""

    comptime device_type: AnyType = Self

    def _to_device_type(self, mut encoder: Some[DeviceTypeEncoder], target: MutOpaquePointer[_]):
        encoder.encode(self, target)

    @staticmethod
    def get_type_name() -> String:
        return "pymla.KernelParams"


@fieldwise_init
struct DeviceBatch(TrivialRegisterPassable):
    """`RaggedBatch` on the device: request `b` owns query rows `[offsets[b], offsets[b + 1])`.

    Positions are global; the cache holds the positions of its shard (`shard()`, `CacheShard`).
    """

    var offsets: U32Ptr
    var cache_lengths: U32Ptr
    var num_requests: Int32
    var shard_rank: Int32
    var num_shards: Int32
    var shard_interleave: Int32

    @staticmethod
    def of(batch: RaggedBatch) -> Self:
        return Self(
            batch.offsets, batch.cache_lengths, Int32(batch.num_requests), Int32(batch.shard.rank),
            Int32(batch.shard.count), Int32(batch.shard.interleave),
        )

    @always_inline
    def shard(self) -> CacheShard:
        """Which positions the cache holds, at which slots."""
        return CacheShard(Int(self.shard_rank), Int(self.num_shards), Int(self.shard_interleave))

    @always_inline
    def request(self, t: Int) -> Int:
        """The request owning query row `t`."""
        return find_request(to_global(self.offsets), Int(self.num_requests), t)

    @always_inline
    def position(self, b: Int, t: Int) -> Int:
        """Sequence position of query row `t` of request `b`."""
        return Int(to_global(self.cache_lengths).unsafe_load(b)) + t - Int(to_global(self.offsets).unsafe_load(b))

    @always_inline
    def token_position(self, t: Int) -> Int:
        """Sequence position of query row `t`."""
        return self.position(self.request(t), t)


@fieldwise_init
struct DeviceCache[dtype: DType](TrivialRegisterPassable):
    """`PagedLatentRows` on the device: one layer's rows of `key_dim` values, one per (request, position)."""

    var blocks: DPtr[Self.dtype]
    var lookup: U32Ptr
    var pages_per_request: Int32
    var page_size: Int32
    var page_stride: Int64
    var layer_offset: Int64
    var key_dim: Int32

    @staticmethod
    def of(cache: PagedLatentRows[Self.dtype]) -> Self:
        return Self(
            cache.blocks,
            cache.lookup_table,
            Int32(cache.pages_per_request),
            Int32(cache.page_size),
            Int64(cache.page_stride),
            Int64(cache.layer_offset),
            Int32(cache.head_dim),
        )

    @always_inline
    def row_offset(self, b: Int, pos: Int) -> Int:
        """Element offset in `blocks` of request `b`'s row at position `pos`."""
        return PageTable(
            self.lookup, Int(self.pages_per_request), Int(self.page_size), Int(self.page_stride),
            Int(self.layer_offset), Int(self.key_dim),
        ).row_offset(b, pos)


@fieldwise_init
struct DeviceFp8Rows(TrivialRegisterPassable):
    """`Fp8LatentRows` on the device: one layer's `fp8_ds_mla` rows, or none (`active` 0).

    `rows` addresses them as a cache of bytes (`key_dim` = the row's bytes). A
    row: `kv_lora_rank` e4m3 bytes, one float32 scale per 128 of them
    (`scales`), `rope_dim` bfloat16 values (`rope`); `pymla/cache_format.py`.
    """

    var rows: DeviceCache[DType.uint8]
    var kv_lora_rank: Int32
    var rope_dim: Int32
    var active: Int32

    @staticmethod
    def of(fp8: Fp8LatentRows) -> Self:
        var rows = DeviceCache[DType.uint8](
            fp8.bytes, fp8.lookup_table, Int32(fp8.pages_per_request), Int32(fp8.page_size),
            Int64(fp8.page_stride), Int64(fp8.layer_offset), Int32(fp8.row_bytes),
        )
        return Self(rows, Int32(fp8.kv_lora_rank), Int32(fp8.rope_dim), Int32(1 if fp8.active else 0))

    @always_inline
    def row_bytes(self) -> Int:
        return Int(self.rows.key_dim)

    @always_inline
    def row(self, b: Int, pos: Int) -> U8Ptr:
        """The bytes of request `b`'s row at position `pos`."""
        return self.rows.blocks.unsafe_offset(self.rows.row_offset(b, pos))

    @always_inline
    def scales(self, row: U8Ptr) -> FPtr:
        """The row's float32 scales: one per 128 latent values."""
        return row.unsafe_offset(Int(self.kv_lora_rank)).unsafe_bitcast[Float32]()

    @always_inline
    def rope(self, row: U8Ptr) -> DPtr[DType.bfloat16]:
        """The row's bfloat16 rope values."""
        var rank = Int(self.kv_lora_rank)
        return row.unsafe_offset(rank + 4 * (rank // FP8_SCALE_BLOCK)).unsafe_bitcast[BFloat16]()
