"""Shared memory and parameters of the TMA attention kernels (`attention_sm90.mojo`: 64 rows per block,
`attention_narrow.mojo`: 16): the key block geometry (64 keys x 9 boxes of 64 columns), the launch's
parameter struct with the cache's TMA descriptors, the shared-memory plan and the partition's key blocks."""

from std.builtin.device_passable import DevicePassable, DeviceTypeEncoder
from std.utils import IndexList

from max.gpu import WARP_SIZE
from max.gpu.host import DeviceBuffer, DeviceContext
from max.gpu.host.nvidia.tma import TensorMapSwizzle, TMADescriptor, create_tma_descriptor
from max.gpu.memory import fence_mbarrier_init
from max.gpu.sync import mbarrier_init, named_barrier

from ..paged_cache import Fp8LatentRows, PagedLatentRows
from .attention_block import PARTITION_ALIGN, AttentionParams, RowMasks, SPtr
from .hopper import smem_u32
from .params import GPtr, to_global
from .projection_mma import QuantizedRows

comptime S9_ROWS = 64  # rows per block: the M of one wgmma
comptime S9_KEYS = 64  # keys per block: one TMA box's rows
comptime S9_BOX_COLS = 64  # columns per TMA box (128 bytes of bf16 / f16: one swizzle atom row)
comptime S9_KEY_DIM = 576  # DeepSeek: 512 + 64
comptime S9_BOXES = S9_KEY_DIM // S9_BOX_COLS  # 9 boxes per key block; box 8 = the rope columns
comptime S9_VALUE_COLS = 256  # value columns per math warpgroup
comptime S9_WG = 128
comptime S9_MATH_THREADS = 2 * S9_WG
comptime S9_THREADS = 3 * S9_WG  # two math warpgroups, one producer
comptime S9_BOX_BYTES = S9_KEYS * S9_BOX_COLS * 2
comptime S9_BLOCK_BYTES = S9_BOXES * S9_BOX_BYTES
comptime S9_STAGES = 2
# An `fp8_ds_mla` cache (the kernel's `fp8`): each 64-key block's rows arrive by TMA as bytes in one of
# two raw slots (4 latent boxes of 64 keys x 128 e4m3 bytes, 128-byte swizzle, and each key's 4 float32
# scales), and the producer thread copies the rope part, bf16 already, straight into box 8 of the one
# bf16 stage (`S9_FP8_STAGES`: 72 KiB + 2 x 33 KiB of raw slots fit where two bf16 stages did). Each
# math warpgroup widens its 32 keys' rows (`dequantize8`) into boxes 0-7 before it scores them
# (`widen_raw_rows`): the producer warpgroup widening whole blocks alone (H100, 2026-12-05) held the
# 16-head fp8 decode to 1.09 TB/s of fp8 rows, slower than the bf16 cache, since the one stage
# serializes the widening with the math.
comptime S9_FP8_STAGES = 1
comptime S9_RAW_BOXES = 4  # 128 latent bytes of a key each: two bf16 boxes
comptime S9_RAW_BOX_BYTES = S9_KEYS * 128
comptime S9_SCALE_BYTES = S9_KEYS * 16  # 4 float32 scales per key
comptime S9_RAW_BYTES = S9_RAW_BOXES * S9_RAW_BOX_BYTES + S9_SCALE_BYTES  # 33 KiB: 1024-byte aligned
comptime S9_RAW_SLOTS = 2
# The narrow kernel's (attention_narrow.mojo) raw slots also hold the block's rope box (`SmemPlan.ROPE_IN_RAW`):
# it lands with the block's bytes instead of on a copy issued once the scores before released the stage's box 8
# (H100, 16 h b8 8k, 3 slots without the rope: the math warps' second-longest wait, 6% of the stall samples,
# was that copy). Two such slots fit beside its exchange buffers, not three (1 KiB over). Whole op on fp8 rows,
# H100, alternated with three slots without the rope: 16 h b8 8k 56.0 -> 53.5 us, b64 8k 190.1 -> 181.9 us
# (benchmarks/results/h100-2026-12-07b-rope-in-raw).
comptime N9_RAW_SLOTS = 2
comptime S9_ROPE_COL = S9_RAW_BOXES * 128 + 16  # byte column of the rope part in a 656-byte row


def box_rows(page_size: Int) -> Int:
    """Rows of one TMA box: a page's rows, at most a key block's 64."""
    return min(page_size, S9_KEYS)


@align(64)
struct TmaAttentionParams[dtype: DType](DevicePassable, ImplicitlyCopyable):
    """`attention_sm90_kernel`'s one argument: the launch's `AttentionParams` and the TMA descriptors
    of the cache layer: `[pages, page_size, key_dim]` in boxes of `[1, box_rows, 64]` (128-byte swizzle);
    or (`create_fp8`) its `fp8_ds_mla` rows as bytes, `[pages, page_size, row_bytes]`, in boxes of
    `[1, box_rows, 128]` (`keys`, 128-byte swizzle) and `[1, box_rows, 16]` (`scales`).

    Not a `KernelParams` (the descriptor is not register-passable): the kernel
    takes it as a grid constant and hands TMA the descriptor's address in
    parameter space (`nvvm.grid_constant`), so CUDA-graph replay keeps it.
    """

    var keys: TMADescriptor
    var scales: TMADescriptor  # fp8_ds_mla rows: the scales' boxes (a dtype cache: `keys` again, unused)
    var att: AttentionParams[Self.dtype]
    # Active: rows the block holds all keys of (`AttentionBlock.normalized`) go out quantized for step 6
    # (`store_quantized_rows`; K blocks of S9_QUANT_BLOCK) instead of into `raw`, the merge skips them.
    var quant: QuantizedRows
    var attention_output: GPtr[Self.dtype]  # [rows, R]: with `quant` active and has_attention_output
    var has_attention_output: Int32

    comptime device_type: AnyType = Self

    def __init__(out self, keys: TMADescriptor, scales: TMADescriptor, att: AttentionParams[Self.dtype]):
        self.keys = keys
        self.scales = scales
        self.att = att
        self.quant = QuantizedRows.none(to_global(att.raw))
        self.attention_output = to_global(att.raw).unsafe_bitcast[Scalar[Self.dtype]]()
        self.has_attention_output = 0

    def quantizing(
        self, quant: QuantizedRows, attention_output: GPtr[Self.dtype], has_attention_output: Bool
    ) -> Self:
        """These parameters with the epilogue quantizing one-partition rows into `quant` (active, K blocks
        of S9_QUANT_BLOCK) and, with `has_attention_output`, storing them as dtype."""
        var out = self
        out.quant = quant
        out.attention_output = attention_output
        out.has_attention_output = Int32(1 if has_attention_output else 0)
        return out

    @staticmethod
    def create(ctx: DeviceContext, cache: PagedLatentRows[Self.dtype], att: AttentionParams[Self.dtype]) raises -> Self:
        """The descriptor of `cache`'s layer (its blocks from `layer_offset`) around `att`."""
        comptime MAX_PAGES = 1 << 24  # a bound, not a size: boxes are addressed by the lookup table's pages
        var view = DeviceBuffer[Self.dtype](
            ctx, cache.blocks.unsafe_offset(cache.layer_offset), MAX_PAGES * cache.page_stride, owning=False
        )
        var desc = create_tma_descriptor[Self.dtype, 3, TensorMapSwizzle.SWIZZLE_128B](
            view,
            IndexList[3](MAX_PAGES, cache.page_size, cache.head_dim),
            IndexList[3](cache.page_stride, cache.head_dim, 1),
            IndexList[3](1, box_rows(cache.page_size), S9_BOX_COLS),
        )
        return Self(desc, desc, att)

    @staticmethod
    def create_fp8(ctx: DeviceContext, rows: Fp8LatentRows, att: AttentionParams[Self.dtype]) raises -> Self:
        """The descriptors of `rows`' layer (`fp8_ds_mla`, as bytes from `layer_offset`) around `att`."""
        comptime MAX_PAGES = 1 << 24  # as `create`'s
        var view = DeviceBuffer[DType.uint8](
            ctx, rows.bytes.unsafe_offset(rows.layer_offset), MAX_PAGES * rows.page_stride, owning=False
        )
        var dims = IndexList[3](MAX_PAGES, rows.page_size, rows.row_bytes)
        var strides = IndexList[3](rows.page_stride, rows.row_bytes, 1)
        var latent = create_tma_descriptor[DType.uint8, 3, TensorMapSwizzle.SWIZZLE_128B](
            view, dims, strides, IndexList[3](1, box_rows(rows.page_size), 128)
        )
        var scales = create_tma_descriptor[DType.uint8, 3, TensorMapSwizzle.SWIZZLE_NONE](
            view, dims, strides, IndexList[3](1, box_rows(rows.page_size), 16)
        )
        return Self(latent, scales, att)

    def _to_device_type(self, mut encoder: Some[DeviceTypeEncoder], target: MutOpaquePointer[_]):
        encoder.encode(self, target)

    @staticmethod
    def get_type_name() -> String:
        return "pymla.TmaAttentionParams"



@fieldwise_init
struct SmemPlan[fp8: Bool, rows: Int = S9_ROWS](TrivialRegisterPassable):
    """Where things live in the dynamic shared memory (see the module docstring; `fp8`: one key stage,
    then the raw slots). `rows`: the block's rows, Q's rows per box (64 here; 16 in the narrow
    kernel, `attention_narrow.mojo`, whose exchange buffers follow `END`)."""

    var base: SPtr[UInt8]

    comptime STAGES = S9_FP8_STAGES if Self.fp8 else S9_STAGES
    comptime RAW_SLOTS = S9_RAW_SLOTS if Self.rows == S9_ROWS else N9_RAW_SLOTS
    # fp8, narrow: each raw slot holds its block's rope box after the scales (`rope`; the stage's box 8 is
    # unused); the 64-row kernel keeps the rope in box 8, where its P goes after the scores.
    comptime ROPE_IN_RAW = Self.fp8 and Self.rows != S9_ROWS
    comptime RAW_BYTES = S9_RAW_BYTES + (S9_BOX_BYTES if Self.ROPE_IN_RAW else 0)
    comptime Q_BOX_BYTES = Self.rows * 128  # one Q box: the block's rows x 64 columns
    comptime Q = 0
    comptime K = S9_BOXES * Self.Q_BOX_BYTES
    comptime RAW = Self.K + Self.STAGES * S9_BLOCK_BYTES
    comptime BARS = Self.RAW + (Self.RAW_SLOTS * Self.RAW_BYTES if Self.fp8 else 0)
    comptime N_FULL = Self.STAGES * S9_BOXES
    comptime RAW_FULL = Self.BARS + 8 * (Self.N_FULL + Self.STAGES)
    comptime RAW_EMPTY = Self.RAW_FULL + 8 * Self.RAW_SLOTS
    comptime XMAX = Self.RAW_EMPTY + 8 * Self.RAW_SLOTS
    # Per math warpgroup a value per row; narrow: per warpgroup, block parity and warp a value per row.
    comptime ROW_VALUES = S9_ROWS if Self.rows == S9_ROWS else 2 * 4 * Self.rows
    comptime XSUM = Self.XMAX + 2 * Self.ROW_VALUES * 4
    comptime MASKS = Self.XSUM + 2 * Self.ROW_VALUES * 4
    comptime END = Self.MASKS + 4 * Self.rows * 4

    @always_inline
    def q_u32(self) -> UInt32:
        return smem_u32(self.base)

    @always_inline
    def stage(self, s: Int) -> SPtr[UInt8]:
        """Key block of stage `s`: 9 boxes of 64 keys x 64 columns."""
        return self.base.unsafe_offset(Self.K + s * S9_BLOCK_BYTES)

    @always_inline
    def raw(self, slot: Int) -> SPtr[UInt8]:
        """`fp8`: raw slot `slot`, a block's latent boxes (64 keys x 128 bytes each), then its scales
        (`ROPE_IN_RAW`: then its rope box, `rope`)."""
        return self.base.unsafe_offset(Self.RAW + slot * Self.RAW_BYTES)

    @always_inline
    def rope(self, slot: Int) -> SPtr[UInt8]:
        """`ROPE_IN_RAW`: the rope box of raw slot `slot`'s block (64 keys x 64 bf16, as a stage's box 8)."""
        return self.raw(slot).unsafe_offset(S9_RAW_BYTES)

    @always_inline
    def full(self, s: Int, box: Int) -> SPtr[Int64]:
        """Barrier of box `box` of stage `s`: one arrival, the producer's expect_tx (`fp8`: box 8 alone, the
        rope part; the math warpgroups widen boxes 0-7 themselves)."""
        return self.base.unsafe_offset(Self.BARS + 8 * (s * S9_BOXES + box)).unsafe_bitcast[Int64]()

    @always_inline
    def empty(self, s: Int) -> SPtr[Int64]:
        """Release barrier of stage `s`: one arrival per math warp once its P V on the stage is done (the
        narrow kernel on fp8 rows: once its scores are, `produce_fp8_keys`)."""
        return self.base.unsafe_offset(Self.BARS + 8 * (Self.N_FULL + s)).unsafe_bitcast[Int64]()

    @always_inline
    def raw_full(self, slot: Int) -> SPtr[Int64]:
        """`fp8`: transaction barrier of raw slot `slot` (one arrival: the producer's expect_tx)."""
        return self.base.unsafe_offset(Self.RAW_FULL + 8 * slot).unsafe_bitcast[Int64]()

    @always_inline
    def raw_empty(self, slot: Int) -> SPtr[Int64]:
        """`fp8`: release barrier of raw slot `slot`: one arrival per math warp once its warpgroup has widened it
        (`ROPE_IN_RAW`: and scored its rope box)."""
        return self.base.unsafe_offset(Self.RAW_EMPTY + 8 * slot).unsafe_bitcast[Int64]()

    @always_inline
    def xmax(self) -> SPtr[Float32]:
        return self.base.unsafe_offset(Self.XMAX).unsafe_bitcast[Float32]()

    @always_inline
    def xsum(self) -> SPtr[Float32]:
        return self.base.unsafe_offset(Self.XSUM).unsafe_bitcast[Float32]()

    @always_inline
    def masks(self) -> RowMasks:
        var at = self.base.unsafe_offset(Self.MASKS)
        return RowMasks(
            at.unsafe_bitcast[Int32](),
            at.unsafe_offset(Self.rows * 4).unsafe_bitcast[Int32](),
            at.unsafe_offset(2 * Self.rows * 4).unsafe_bitcast[Int32](),
            at.unsafe_offset(3 * Self.rows * 4).unsafe_bitcast[Float32](),
        )

    def init_barriers(self):
        """One thread: the stage barriers, then the fence that shows them to the async proxy."""
        for st in range(Self.STAGES):
            for box in range(S9_BOXES):
                mbarrier_init(self.full(st, box), 1)
            mbarrier_init(self.empty(st), Int32(S9_MATH_THREADS // WARP_SIZE))
        comptime if Self.fp8:
            for slot in range(Self.RAW_SLOTS):
                mbarrier_init(self.raw_full(slot), 1)
                mbarrier_init(self.raw_empty(slot), Int32(S9_MATH_THREADS // WARP_SIZE))
        fence_mbarrier_init()


@fieldwise_init
struct KeyBlocks(TrivialRegisterPassable):
    """The partition's keys `[lo, hi)` in 64-key blocks aligned to 64 slots from `first`; block `b` in stage `b % 2`."""

    var lo: Int
    var hi: Int
    var first: Int

    @staticmethod
    @always_inline
    def of(span: Tuple[Int, Int]) -> Self:
        comptime assert PARTITION_ALIGN % S9_KEYS == 0, "a partition's keys are whole blocks"
        return Self(span[0], span[1], (span[0] // S9_KEYS) * S9_KEYS)

    @always_inline
    def count(self) -> Int:
        if self.hi <= self.lo:
            return 0
        return (self.hi - self.first + S9_KEYS - 1) // S9_KEYS

    @always_inline
    def start(self, b: Int) -> Int:
        """First key of block `b`."""
        return self.first + b * S9_KEYS

    @always_inline
    def copies(self, b: Int, rows: UInt32) -> UInt32:
        """Copies of `rows` keys that block `b` takes: those that start before the partition's last key
        (the rest of the stage keeps stale rows: masked and zeroed by the math warpgroups)."""
        return min(UInt32(S9_KEYS), UInt32(self.hi) - UInt32(self.start(b)) + rows - 1) // rows

    @always_inline
    def partial(self, b: Int) -> Bool:
        """Whether some key of block `b` is outside `[lo, hi)`."""
        var k = self.start(b)
        return k < self.lo or k + S9_KEYS > self.hi


@always_inline
def wg_barrier[base: Int32](wg: Int):
    """Named barrier `base + wg` of one math warpgroup (a barrier id known at compile time: a computed
    one reserves all 16)."""
    if wg == 0:
        named_barrier[S9_WG](base)
    else:
        named_barrier[S9_WG](base + 1)
