"""Step 5 on Hopper with TMA key blocks and a producer warpgroup (sm_90a), bf16 / f16 caches, and
`fp8_ds_mla` caches for bf16 ops (`fp8`: each math warpgroup widens its keys' rows of raw TMA slots
into the bf16 stage; see `S9_FP8_STAGES`).

Same contract as `attention_wgmma_kernel` (same `AttentionParams`, outputs
and rounding points: q_full holds dtype values, scores are dtype products
summed in float32, probabilities rounded to dtype for P V, float32 row sums).

Where the 2.8x of `attention_wgmma_kernel` goes (H200, 128 heads b64 8k:
717 us, 206 TFLOP/s, against FlashMLA's 250 us, 584 TFLOP/s; one block of
256 threads per SM, 255 registers; `benchmarks/results/h200-2026-12-03-wgmma/`,
`../h200-2026-12-03-final/gpu_variants.log`). Per 64-key tile the wgmma
kernel runs, one after the other: (1) `cp.async.wait_group 0` + a block
barrier for the tile copied one step ahead; (2) every one of the 256 math
threads issues 18 16-byte `cp.async` for the next tile and looks up the page
table (integer work and issue slots taken from the math; the ncu report of
the sibling `mma.sync` kernel, `gpu_ncu_attention.log`, shows the same
kernels latency-bound: 0.35 issued per cycle, ALU the busiest pipe, 65% of
cycles with no eligible warp); (3) scores as m64 n32 k16 wgmmas (n32: the Q
operand is re-read from shared memory per 32 keys, half the reuse of n64),
waited at once; (4) masks and the row max exchanged through shared memory
with a block barrier; (5) probabilities stored to a separate P tile, another
barrier; (6) P V, waited at once. The tensor cores idle through (1), (2),
(4) and (5), and the copy of the next tile is only one step ahead (at 16
heads, memory-bound: 1.73 TB/s against FlashMLA's 4.09). FlashMLA
(`csrc/sm90/decode/dense`, its 2025-04-22 deep dive) instead: keys arrive
by TMA in 64 x 64 sub-tiles, each with its own transaction barrier, so the
score GEMM starts on the first sub-tile; one thread issues the copies; each
step takes two 64-key blocks, warpgroup w computing the scores of block w
with n = 64, the two warpgroups splitting the 512 value columns; and the
"seesaw" offsets the two warpgroups by half a step so one's softmax runs
under the other's GEMMs.

This kernel takes the first three of those (the biggest expected wins):

* Block = 64 packed (token, head) rows of one request (rows past the
  request's are zeros: 16 heads use it too) and three warpgroups: two math
  warpgroups (`S9_MATH_THREADS`) and a producer warpgroup whose first
  thread issues every copy (`KeyProducer`); the producer gives its
  registers to the math warpgroups (`setmaxnreg`).
* Keys in 64-key blocks aligned to 64 cache slots, the cache viewed as
  `[pages, page_size, key_dim]`: with pages of 64 keys or more a block lies
  in one page and each of its 9 column boxes (64 keys x 64 columns, 128-byte
  swizzle) is one TMA copy; smaller pages (8, 16, 32) take 64 / page_size
  copies per column box. Each column box completes its own mbarrier
  (`full`). Two stages (shared memory: Q 72 KiB + 2 x 72 KiB).
* Block b sits in stage b % 2, so the producer copies block b + 1 while the
  math warpgroups work on block b. Both warpgroups share the block: warpgroup
  w scores keys 32w..32w+31 (`S = Q K^T`, m64 n32 k16, started as each box
  lands); mask, scale and ALiBi; the row max exchanged with the other
  warpgroup (one named barrier); its probabilities rounded to dtype into its
  32 columns of box 8 (the rope columns, which P V does not read); a second
  named barrier; then `O_w = O_w corr + P V[:, w]` over all 64 keys
  (m64 n256 k16, V read MN-major from boxes 4w..4w+3), and the stage is
  released to the producer (`empty`).
* Keys outside the block's span (the first and last blocks of a partition)
  are masked in the scores and their value rows zeroed before P V (a stale
  row could hold NaN; each warpgroup zeros the rows of its 32 keys).

Not yet (the next steps if the device shows the tensor cores idle through the
softmax): the seesaw schedule (P kept in registers as the A operand of
`wgmma`, the warpgroups half a block apart).

Shared memory (1024-byte aligned: the swizzle atoms): `q_s` 9 boxes of
[64 rows][64 columns] (128-byte swizzle: 16-byte chunk `c` of row `r` at
`r 128 + (c ^ r % 8) 16`), `k_s` two stages of 9 such boxes, then the
mbarriers, the row max / sum exchange and the row masks.
Accumulator fragments (m64nN, f32): warp `v` of a warpgroup, lane `4 g + t`,
element `4 j + e` is row `16 v + g + 8 (e / 2)`, column `8 j + 2 t + e % 2`.
"""

from std.builtin.device_passable import DevicePassable, DeviceTypeEncoder
from std.math import exp
from std.sys import get_defined_int, size_of
from std.sys._assembly import inlined_assembly
from std.utils import IndexList, StaticTuple
from std.utils.numerics import neg_inf

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, WARP_SIZE, barrier, thread_idx
from max.gpu.compute.mma import (
    WGMMADescriptor,
    wgmma_async,
    wgmma_commit_group_sync,
    wgmma_fence_aligned,
    wgmma_wait_group_sync,
)
from max.gpu.host import DeviceBuffer, DeviceContext
from max.gpu.host.nvidia.tma import TensorMapSwizzle, TMADescriptor, create_tma_descriptor
from max.gpu.memory import AddressSpace, external_memory, fence_mbarrier_init
from max.gpu.intrinsics import warpgroup_reg_alloc, warpgroup_reg_dealloc
from max.gpu.sync import mbarrier_arrive, mbarrier_init, named_barrier

from ..common import U32Ptr
from ..paged_cache import Fp8LatentRows, PagedLatentRows
from .attention_block import AttentionBlock, AttentionParams, RowMasks, SPtr, dequantize8, fence_async_proxy, rescale_row
from .attention_wgmma import quad_max, quad_sum
from .params import GPtr, to_global
from .projection_mma import QuantizedRows
from ..fp8 import activation_scale, e4m3_as_f16
from .pdl import allow_dependents, wait_for_producers

comptime S9_ROWS = 64  # rows per block: the M of one wgmma
comptime S9_KEYS = 64  # keys per block: one TMA box's rows
comptime S9_BOX_COLS = 64  # columns per TMA box (128 bytes of bf16 / f16: one swizzle atom row)
comptime S9_KEY_DIM = 576  # DeepSeek: 512 + 64
comptime S9_BOXES = S9_KEY_DIM // S9_BOX_COLS  # 9 boxes per key block; box 8 = the rope columns
comptime S9_VALUE_COLS = 256  # value columns per math warpgroup
comptime S9_WG = 128
comptime S9_MATH_THREADS = 2 * S9_WG
comptime S9_THREADS = 3 * S9_WG  # two math warpgroups, one producer
# Registers per thread at launch: ptxas gives a kernel with `setmaxnreg` the most that `.maxntid`
# allows (65536 / 384, rounded down to 8: 168), and the block's register pool is that many per
# thread, not the 65536 of the SM. `setmaxnreg.inc` waits until the pool holds what it asks for,
# so the math warpgroups' increase must fit in what the producer releases (128 x 48 + 256 x 232
# = 65536 > 384 x 168 = 64512 hung every block on the H200, 2026-12-05). CUTLASS's split: 40 / 232.
comptime S9_LAUNCH_REGS = (65536 // S9_THREADS) // 8 * 8
comptime S9_PRODUCER_REGS = 40
comptime S9_MATH_REGS = 232
comptime S9_QUANT_BLOCK = 128  # step 6's K block the epilogue quantizes rows in (`TmaAttentionParams.quant`)
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
comptime S9_ROPE_COL = S9_RAW_BOXES * 128 + 16  # byte column of the rope part in a 656-byte row
# Named barriers of the two math warpgroups (0 is `barrier()`).
comptime BAR_MAX = 1
comptime BAR_P = 2
comptime BAR_SUM = 3
comptime BAR_WIDEN = 4  # fp8, + the math warpgroup: its threads done widening its rows of a block
# Debugging builds (`mojo build -D PYMLA_SM90_WATCHDOG_MS=2000`, scripts/build_devbin.sh's smoke
# binary): an mbarrier wait longer than this many milliseconds traps (the launch fails instead of
# hanging). No message: a `print` here is a call, for which ptxas drops `setmaxnreg` (C7507) and
# spills 4 KB, so the debugging build would not run the product's register split. Named barriers
# and `setmaxnreg.inc` wait in hardware: no watchdog can cover them. 0 (the product): none.
comptime S9_WATCHDOG_MS = get_defined_int["PYMLA_SM90_WATCHDOG_MS", 0]()


def box_rows(page_size: Int) -> Int:
    """Rows of one TMA box: a page's rows, at most a key block's 64."""
    return min(page_size, S9_KEYS)


def sm90_supported[dtype: DType](key_dim: Int, kv_lora_rank: Int, page_size: Int) -> Bool:
    """Whether `attention_sm90_kernel` handles these sizes.

    Pages: a multiple of 64 keys (a 64-key block in one page, one box), or a
    divisor of 64 of at least 8 rows (a box lands 1024-byte aligned, as the
    128-byte swizzle needs).
    """
    comptime if dtype != DType.bfloat16 and dtype != DType.float16:
        return False
    var pages_ok = page_size > 0 and (page_size % S9_KEYS == 0 or (page_size % 8 == 0 and S9_KEYS % page_size == 0))
    return key_dim == S9_KEY_DIM and kv_lora_rank == 2 * S9_VALUE_COLS and pages_ok


def attention_sm90_smem_bytes[fp8: Bool = False]() -> Int:
    """Dynamic shared memory of `attention_sm90_kernel`: Q, the key stages (`fp8`: one, and the raw slots),
    barriers, row tables."""
    return SmemPlan[fp8].END


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


@always_inline
def smem_u32[T: AnyType](ptr: SPtr[T]) -> UInt32:
    """A shared-memory pointer as the 32-bit address PTX takes."""
    return UInt32(Int(ptr))


@always_inline
def tma_load_box(dst: UInt32, desc: Int, bar: UInt32, col: UInt32, row: UInt32, page: UInt32):
    """Starts the TMA copy of the box at (page, row, col) into shared address `dst`; completes on mbarrier `bar`'s
    transaction count."""
    inlined_assembly[
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [$0], [$1, {$2, $3, $4}], [$5];",
        NoneType,
        constraints="r,l,r,r,r,r,~{memory}",
        has_side_effect=True,
    ](dst, UInt64(desc), col, row, page, bar)


@always_inline
def arrive_expect_tx(bar: UInt32, bytes: UInt32):
    """The producer's arrival on mbarrier `bar`, expecting `bytes` more bytes of TMA copies in this phase."""
    inlined_assembly[
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", NoneType, constraints="r,r,~{memory}", has_side_effect=True
    ](bar, bytes)


@always_inline
def opaque(x: UInt32) -> UInt32:
    """`x`, opaque to the optimizer: shared addresses re-derived inside the loop, so the wgmma
    descriptors built from them are not all hoisted out of it and held in registers."""
    return inlined_assembly["mov.b32 $0, $1;", UInt32, constraints="=r,r", has_side_effect=True](x)


@always_inline
def globaltimer_ns() -> UInt64:
    """The GPU's global nanosecond timer."""
    return inlined_assembly["mov.u64 $0, %globaltimer;", UInt64, constraints="=l", has_side_effect=True]()


@always_inline
def try_wait_parity(bar: UInt32, parity: UInt32) -> Bool:
    """Whether the phase of parity `parity` of the mbarrier at shared address `bar` has completed."""
    var done = inlined_assembly[
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; selp.u32 $0, 1, 0, p; }",
        UInt32,
        constraints="=r,r,r,~{memory}",
        has_side_effect=True,
    ](bar, parity)
    return done != 0


@always_inline
def trap():
    """Ends the kernel with an error (the launch fails: `illegal instruction` on the host's next sync)."""
    inlined_assembly["trap;", NoneType, constraints="", has_side_effect=True]()


@always_inline
def mbar_wait_u32(bar: UInt32, parity: UInt32):
    """Spins until the phase of parity `parity` of the mbarrier at shared address `bar` has completed."""
    comptime if S9_WATCHDOG_MS > 0:
        if try_wait_parity(bar, parity):
            return
        var t0 = globaltimer_ns()
        while not try_wait_parity(bar, parity):
            if globaltimer_ns() - t0 > UInt64(S9_WATCHDOG_MS) * 1_000_000:
                trap()
    else:
        while not try_wait_parity(bar, parity):
            pass


@always_inline
def mbar_wait(bar: SPtr[Int64], parity: Int):
    """Spins until the phase of parity `parity` of mbarrier `bar` has completed."""
    mbar_wait_u32(smem_u32(bar), UInt32(parity))


@always_inline
def sw128_desc[dtype: DType](addr: UInt32, lbo: Int, sbo: Int) -> WGMMADescriptor[dtype]:
    """A wgmma descriptor of a 128-byte-swizzled operand at shared address `addr` (byte offsets `lbo`, `sbo`).

    K-major (Q, K, P): `sbo` = 1024 (8 rows of 128 bytes), `lbo` unused; a k16
    step inside a box adds 32 bytes to the start. MN-major (V): `lbo` = the
    stride between 64-column boxes, `sbo` = 1024 (8 keys).
    """
    var v = Int64((Int(addr) & 0x3FFFF) >> 4) | (Int64(lbo >> 4) << 16) | (Int64(sbo >> 4) << 32) | (Int64(1) << 62)
    return WGMMADescriptor[dtype](v)


@fieldwise_init
struct SmemPlan[fp8: Bool](TrivialRegisterPassable):
    """Where things live in the dynamic shared memory (see the module docstring; `fp8`: one key stage,
    then the two raw slots)."""

    var base: SPtr[UInt8]

    comptime STAGES = S9_FP8_STAGES if Self.fp8 else S9_STAGES
    comptime Q = 0
    comptime K = S9_BLOCK_BYTES
    comptime RAW = (1 + Self.STAGES) * S9_BLOCK_BYTES
    comptime BARS = Self.RAW + (S9_RAW_SLOTS * S9_RAW_BYTES if Self.fp8 else 0)
    comptime N_FULL = Self.STAGES * S9_BOXES
    comptime RAW_FULL = Self.BARS + 8 * (Self.N_FULL + Self.STAGES)
    comptime RAW_EMPTY = Self.RAW_FULL + 8 * S9_RAW_SLOTS
    comptime XMAX = Self.RAW_EMPTY + 8 * S9_RAW_SLOTS
    comptime XSUM = Self.XMAX + 2 * S9_ROWS * 4
    comptime MASKS = Self.XSUM + 2 * S9_ROWS * 4
    comptime END = Self.MASKS + 4 * S9_ROWS * 4

    @always_inline
    def q_u32(self) -> UInt32:
        return smem_u32(self.base)

    @always_inline
    def stage(self, s: Int) -> SPtr[UInt8]:
        """Key block of stage `s`: 9 boxes of 64 keys x 64 columns."""
        return self.base.unsafe_offset(Self.K + s * S9_BLOCK_BYTES)

    @always_inline
    def raw(self, slot: Int) -> SPtr[UInt8]:
        """`fp8`: raw slot `slot`, a block's latent boxes (64 keys x 128 bytes each), then its scales."""
        return self.base.unsafe_offset(Self.RAW + slot * S9_RAW_BYTES)

    @always_inline
    def full(self, s: Int, box: Int) -> SPtr[Int64]:
        """Barrier of box `box` of stage `s`: one arrival, the producer's expect_tx (`fp8`: box 8 alone, the
        rope part; the math warpgroups widen boxes 0-7 themselves)."""
        return self.base.unsafe_offset(Self.BARS + 8 * (s * S9_BOXES + box)).unsafe_bitcast[Int64]()

    @always_inline
    def empty(self, s: Int) -> SPtr[Int64]:
        """Release barrier of stage `s`: one arrival per math warp once its P V on the stage is done."""
        return self.base.unsafe_offset(Self.BARS + 8 * (Self.N_FULL + s)).unsafe_bitcast[Int64]()

    @always_inline
    def raw_full(self, slot: Int) -> SPtr[Int64]:
        """`fp8`: transaction barrier of raw slot `slot` (one arrival: the producer's expect_tx)."""
        return self.base.unsafe_offset(Self.RAW_FULL + 8 * slot).unsafe_bitcast[Int64]()

    @always_inline
    def raw_empty(self, slot: Int) -> SPtr[Int64]:
        """`fp8`: release barrier of raw slot `slot`: one arrival per math warp once its warpgroup has widened it."""
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
            at.unsafe_offset(S9_ROWS * 4).unsafe_bitcast[Int32](),
            at.unsafe_offset(2 * S9_ROWS * 4).unsafe_bitcast[Int32](),
            at.unsafe_offset(3 * S9_ROWS * 4).unsafe_bitcast[Float32](),
        )

    def init_barriers(self):
        """One thread: the stage barriers, then the fence that shows them to the async proxy."""
        for st in range(Self.STAGES):
            for box in range(S9_BOXES):
                mbarrier_init(self.full(st, box), 1)
            mbarrier_init(self.empty(st), Int32(S9_MATH_THREADS // WARP_SIZE))
        comptime if Self.fp8:
            for slot in range(S9_RAW_SLOTS):
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
def produce_keys[
    dtype: DType
](p: AttentionParams[dtype], desc: Int, blk: AttentionBlock, sm: SmemPlan[False], keys: KeyBlocks):
    """The producer thread: block `b`'s 9 column boxes into stage `b % 2` once the stage is released.

    A column box is `box_rows(page_size)` rows of one page; a 64-key block takes
    `64 / box_rows` of them per column box (one for pages of 64 keys or more),
    `keys.copies(b)` of them. `desc`: the
    generic address of the kernel parameter's TMA descriptor (taken in the
    kernel: a copy of the parameter would not be in parameter space).

    Every box's barrier is armed with the bytes of all its copies before the
    first copy of the block starts. Runtime loops and 32-bit key arithmetic:
    this thread runs on `S9_PRODUCER_REGS` registers.
    """
    var page_size = UInt32(p.cache.page_size)
    var rows = UInt32(box_rows(Int(p.cache.page_size)))
    var lookup = p.cache.lookup.unsafe_offset(blk.request * Int(p.cache.pages_per_request))
    var stage0 = smem_u32(sm.stage(0))
    var full0 = smem_u32(sm.full(0, 0))
    var empty0 = smem_u32(sm.empty(0))
    for b in range(keys.count()):
        var s = b % S9_STAGES
        # Phase parity: a fresh barrier passes parity 1 at once (the first use of a stage waits for nothing).
        mbar_wait_u32(empty0 + UInt32(8 * s), UInt32(((b // S9_STAGES) & 1) ^ 1))
        var k = UInt32(keys.start(b))
        var parts = keys.copies(b, rows)
        var dst = stage0 + UInt32(s * S9_BLOCK_BYTES)
        var full = full0 + UInt32(8 * S9_BOXES * s)
        for box in range(S9_BOXES):
            arrive_expect_tx(full + UInt32(8 * box), parts * rows * 128)
        for q in range(parts):
            var key = k + q * rows
            var page = UInt32(lookup.unsafe_load(Int(key // page_size)))
            var row = key % page_size
            var at = dst + q * rows * 128
            for box in range(S9_BOXES):
                tma_load_box(
                    at + UInt32(box * S9_BOX_BYTES), desc, full + UInt32(8 * box), UInt32(box * S9_BOX_COLS), row, page
                )


@always_inline
def produce_fp8_keys[
    dtype: DType
](p: AttentionParams[dtype], descs: Tuple[Int, Int], blk: AttentionBlock, sm: SmemPlan[True], keys: KeyBlocks):
    """The producer thread on an `fp8_ds_mla` cache (module docstring, `fp8`).

    It keeps the raw slots two blocks ahead (`copy_raw_block`): block `b + 2` goes into
    block `b`'s slot once both math warpgroups have widened it (`raw_empty`). Per block, once
    the math warpgroups release the one stage (`empty`: P V of the block before, which also
    read P from box 8), it copies the rope part into box 8 by TMA (`descs[0]`: the 128-byte
    boxes; the rows' bytes land in the layout of a bf16 box).
    """
    var cache = p.fp8.rows
    var page_size = UInt32(cache.page_size)
    var rows = UInt32(box_rows(Int(cache.page_size)))
    var lookup = cache.lookup.unsafe_offset(blk.request * Int(cache.pages_per_request))
    var count = keys.count()
    for b in range(min(count, S9_RAW_SLOTS)):
        copy_raw_block(descs, sm, b, lookup, page_size, rows, keys)
    var rope_box = smem_u32(sm.stage(0)) + UInt32((S9_BOXES - 1) * S9_BOX_BYTES)
    var rope_full = smem_u32(sm.full(0, S9_BOXES - 1))
    for b in range(count):
        var slot = b % S9_RAW_SLOTS
        mbar_wait(sm.empty(0), ((b // S9_FP8_STAGES) & 1) ^ 1)
        var k = UInt32(keys.start(b))
        var parts = keys.copies(b, rows)
        arrive_expect_tx(rope_full, parts * rows * 128)
        for q in range(parts):
            var key = k + q * rows
            var page = UInt32(lookup.unsafe_load(Int(key // page_size)))
            tma_load_box(rope_box + q * rows * 128, descs[0], rope_full, UInt32(S9_ROPE_COL), key % page_size, page)
        if b + S9_RAW_SLOTS < count:
            mbar_wait(sm.raw_empty(slot), (b // S9_RAW_SLOTS) & 1)
            copy_raw_block(descs, sm, b + S9_RAW_SLOTS, lookup, page_size, rows, keys)


@always_inline
def copy_raw_block(
    descs: Tuple[Int, Int], sm: SmemPlan[True], b: Int, lookup: U32Ptr, page_size: UInt32, rows: UInt32,
    keys: KeyBlocks,
):
    """One thread: block `b`'s `fp8_ds_mla` bytes into raw slot `b % 2` by TMA (its latent boxes with
    `descs[0]`, its scales with `descs[1]`), all on the slot's one transaction barrier."""
    var slot = b % S9_RAW_SLOTS
    var bar = smem_u32(sm.raw_full(slot))
    var dst = smem_u32(sm.raw(slot))
    var k = UInt32(keys.start(b))
    var parts = keys.copies(b, rows)
    arrive_expect_tx(bar, parts * rows * (S9_RAW_BOXES * 128 + 16))
    for q in range(parts):
        var key = k + q * rows
        var page = UInt32(lookup.unsafe_load(Int(key // page_size)))
        var row = key % page_size
        for j in range(S9_RAW_BOXES):
            tma_load_box(dst + UInt32(j * S9_RAW_BOX_BYTES) + q * rows * 128, descs[0], bar, UInt32(j * 128), row, page)
        tma_load_box(
            dst + UInt32(S9_RAW_BOXES * S9_RAW_BOX_BYTES) + q * rows * 16, descs[1], bar, UInt32(S9_RAW_BOXES * 128), row, page
        )


@always_inline
def widen_raw_rows[dtype: DType](sm: SmemPlan[True], slot: Int, wg: Int, wt: Int):
    """Math warpgroup `wg`, thread `wt`: its 32 keys' latent bytes in raw slot `slot` times their scales
    (`dequantize8`) into boxes 0-7 of the stage, in the 128-byte swizzle of both. The thread takes
    16-byte output chunk `wt % 8` of rows `32 wg + wt / 8 + 16 i` of every box."""
    comptime ROWS_PER_THREAD = (S9_KEYS // 2) * 8 // S9_WG  # 16-byte chunks of a box per thread: 2
    var raw = sm.raw(slot)
    var scales = raw.unsafe_offset(S9_RAW_BOXES * S9_RAW_BOX_BYTES).unsafe_bitcast[Float32]()
    var stage = sm.stage(0)
    var c = wt % 8
    var r0 = wg * (S9_KEYS // 2) + wt // 8
    var swz = r0 % 8  # the rows r0 + 16 i share it
    comptime for jb in range(S9_RAW_BOXES):
        var sc = SIMD[DType.float32, ROWS_PER_THREAD](0)
        comptime for i in range(ROWS_PER_THREAD):
            sc[i] = scales.unsafe_load((r0 + 16 * i) * 4 + jb)
        comptime for half in range(2):
            comptime box = 2 * jb + half
            comptime for i in range(ROWS_PER_THREAD):
                var r = r0 + 16 * i
                var src = raw.unsafe_offset(jb * S9_RAW_BOX_BYTES + r * 128 + (((half * 4 + c // 2) ^ swz) * 16) + (c % 2) * 8)
                var v = dequantize8[dtype](src.unsafe_load[width=8, alignment=8](0), sc[i])
                stage.unsafe_offset(box * S9_BOX_BYTES + r * 128 + ((c ^ swz) * 16)).unsafe_bitcast[
                    Scalar[dtype]
                ]().unsafe_store[alignment=16](0, v)


@always_inline
def load_q[dtype: DType, fp8: Bool, //](p: AttentionParams[dtype], blk: AttentionBlock, sm: SmemPlan[fp8], tid: Int):
    """Q rows of the block into `q_s` in dtype (exact: q_full holds dtype values), zeros past the request's rows."""
    comptime CHUNKS = S9_KEY_DIM // 8  # 16-byte chunks per row
    var v = tid
    while v < S9_ROWS * CHUNKS:
        var r = v // CHUNKS
        var c = v % CHUNKS
        var x = SIMD[DType.float32, 8](0)
        if blk.row0 + r < blk.row_end:
            x = p.q_full.unsafe_offset((blk.row0 + r) * S9_KEY_DIM + c * 8).unsafe_load[width=8, alignment=16](0)
        var at = (c // 8) * S9_BOX_BYTES + r * 128 + (((c % 8) ^ (r % 8)) * 16)
        sm.base.unsafe_offset(at).unsafe_bitcast[Scalar[dtype]]().unsafe_store[alignment=16](0, x.cast[dtype]())
        v += S9_THREADS


@always_inline
def zero_outside_values[fp8: Bool, //](sm: SmemPlan[fp8], keys: KeyBlocks, b: Int, s: Int, wg: Int, wt: Int):
    """Zeros the value rows (boxes 0-7) of block `b`'s keys outside `[lo, hi)` in stage `s`: warpgroup `wg`
    the rows of its 32 keys."""
    var k0 = keys.start(b)
    comptime HALF = S9_KEYS // 2
    comptime CHUNKS = (S9_BOXES - 1) * 8  # 16-byte chunks of a row's value columns
    var v = wt
    while v < HALF * CHUNKS:
        var r = wg * HALF + v // CHUNKS
        var c = v % CHUNKS
        var key = k0 + r
        if key < keys.lo or key >= keys.hi:
            var at = (c // 8) * S9_BOX_BYTES + r * 128 + (c % 8) * 16
            sm.stage(s).unsafe_offset(at).unsafe_bitcast[UInt32]().unsafe_store[alignment=16](
                0, SIMD[DType.uint32, 4](0)
            )
        v += S9_WG


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(S9_THREADS)))
@__llvm_arg_metadata(p, `nvvm.grid_constant`)
def attention_sm90_kernel[dtype: DType, fp8: Bool = False](p: TmaAttentionParams[dtype]):
    """One block per (request, 64 rows, key partition); see the module docstring (`fp8`: the keys are
    `p.att.fp8`'s `fp8_ds_mla` rows, `TmaAttentionParams.create_fp8`).

    Grid `attention_grid` (a row slot or a task of the split schedule per block), block `S9_THREADS`
    threads, `attention_sm90_smem_bytes[fp8]()` bytes of dynamic shared memory.
    """
    comptime HALF = S9_KEYS // 2  # keys scored per warpgroup
    comptime NJ_S = HALF // 8  # score n-tiles per thread
    comptime NJ_O = S9_VALUE_COLS // 8  # value n-tiles per thread
    comptime ACC_W = S9_ROWS * S9_VALUE_COLS // S9_WG
    comptime ESZ = size_of[dtype]()
    comptime assert ESZ == 2, "bf16 / f16 boxes: 64 columns = 128 bytes"
    comptime STAGES = S9_FP8_STAGES if fp8 else S9_STAGES
    comptime assert not fp8 or dtype == DType.bfloat16, "fp8_ds_mla rows serve bfloat16 ops"
    comptime assert (
        S9_WG * S9_PRODUCER_REGS + S9_MATH_THREADS * S9_MATH_REGS <= S9_THREADS * S9_LAUNCH_REGS
    ), "setmaxnreg: the math warpgroups' registers must come from the producer's (else setmaxnreg.inc waits forever)"

    # With PDL (pdl.mojo) every thread waits for the q step (q_full, the new cache rows) at once,
    # before the role split: the producer's TMA copies and load_q read what it wrote.
    wait_for_producers()
    var tid = thread_idx.x
    var blk = AttentionBlock.locate[S9_ROWS](p.att)
    if not blk.has_rows():
        return
    var sm = SmemPlan[fp8](external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=1024]())
    var masks = sm.masks()
    if tid < S9_ROWS:
        masks.store(blk, p.att, tid)
    if tid == S9_MATH_THREADS:
        sm.init_barriers()
    load_q(p.att, blk, sm, tid)
    fence_async_proxy()
    barrier()
    var keys = KeyBlocks.of(masks.key_span(blk, S9_ROWS))

    var wg = tid // S9_WG
    if wg == 2:
        warpgroup_reg_dealloc[S9_PRODUCER_REGS]()
        if tid == S9_MATH_THREADS:
            comptime if fp8:
                produce_fp8_keys(
                    p.att, (Int(Pointer(to=p.keys)), Int(Pointer(to=p.scales))), blk, rebind[SmemPlan[True]](sm), keys
                )
            else:
                produce_keys(p.att, Int(Pointer(to=p.keys)), blk, rebind[SmemPlan[False]](sm), keys)
        return
    warpgroup_reg_alloc[S9_MATH_REGS]()

    var wt = tid % S9_WG
    var warp = wt // WARP_SIZE
    var lane = tid % WARP_SIZE
    var g = lane // 4
    var t4 = lane % 4
    var ra = 16 * warp + g
    var rb = ra + 8
    # This thread's two rows: their keys `[lo, hi)` within the partition's span, position, slope (32-bit: registers).
    var lo_a = max(masks.lo.unsafe_load(ra), Int32(keys.lo))
    var hi_a = min(masks.hi.unsafe_load(ra), Int32(keys.hi))
    var pos_a = Float32(masks.pos.unsafe_load(ra))
    var slope_a = masks.slope.unsafe_load(ra)
    var lo_b = max(masks.lo.unsafe_load(rb), Int32(keys.lo))
    var hi_b = min(masks.hi.unsafe_load(rb), Int32(keys.hi))
    var pos_b = Float32(masks.pos.unsafe_load(rb))
    var slope_b = masks.slope.unsafe_load(rb)
    var scale = p.att.scale
    var xmax_s = sm.xmax()
    var q_u = sm.q_u32()
    var stage0_u = smem_u32(sm.stage(0))

    var m_a = neg_inf[DType.float32]()
    var m_b = neg_inf[DType.float32]()
    var l_a = Float32(0)
    var l_b = Float32(0)
    var acc = SIMD[DType.float32, ACC_W](0)

    for b in range(keys.count()):
        var st = b % STAGES
        var phase = (b // STAGES) & 1
        var k0 = keys.start(b) + wg * HALF  # this warpgroup's first key
        comptime if fp8:
            # Its keys' rows widened into the stage once both warpgroups' P V of the block before is done.
            var slot = b % S9_RAW_SLOTS
            mbar_wait(sm.empty(0), (b & 1) ^ 1)
            mbar_wait(sm.raw_full(slot), (b // S9_RAW_SLOTS) & 1)
            widen_raw_rows[dtype](rebind[SmemPlan[True]](sm), slot, wg, wt)
            fence_async_proxy()
            if wg == 0:  # a barrier id known at compile time (a computed one reserves all 16)
                named_barrier[S9_WG](BAR_WIDEN)
            else:
                named_barrier[S9_WG](BAR_WIDEN + 1)
            if lane == 0:
                _ = mbarrier_arrive(sm.raw_empty(slot))

        # S = Q K^T on this warpgroup's 32 keys (rows 32 wg.. of every box), each box started as it lands.
        var s = SIMD[DType.float32, NJ_S * 4](0)
        var q_it = opaque(q_u)
        var stage_u = opaque(stage0_u + UInt32(st * S9_BLOCK_BYTES))
        var keys_u = stage_u + UInt32(wg * HALF * 128)
        comptime for box in range(S9_BOXES):
            comptime if not fp8 or box == S9_BOXES - 1:  # fp8: boxes 0-7 widened above
                mbar_wait(sm.full(st, box), phase)
            # A fence after every wait: ptxas takes the wait's spin loop for a divergent path and,
            # without one, serializes every wgmma of the kernel (C7520).
            wgmma_fence_aligned()
            comptime for kk in range(S9_BOX_COLS // 16):
                var off = UInt32(box * S9_BOX_BYTES + kk * 32)
                s = wgmma_async[64, HALF, 16, DType.float32, NJ_S * 4, a_type=dtype, b_type=dtype, layout_b="col"](
                    sw128_desc[dtype](q_it + off, 16, 1024), sw128_desc[dtype](keys_u + off, 16, 1024), s
                )
        wgmma_commit_group_sync()
        wgmma_wait_group_sync[0]()

        # Scale, ALiBi and masks; this warpgroup's row maxima, exchanged with the other's.
        var mx_a = neg_inf[DType.float32]()
        var mx_b = neg_inf[DType.float32]()
        var key0 = Int32(k0) + 2 * Int32(t4)
        comptime for j in range(NJ_S):
            comptime for e in range(4):
                var key = key0 + Int32(8 * j + e % 2)
                var x = s[4 * j + e]
                comptime if e < 2:
                    if key >= lo_a and key < hi_a:
                        x = x * scale - slope_a * (pos_a - Float32(key))
                    else:
                        x = neg_inf[DType.float32]()
                    mx_a = max(mx_a, x)
                else:
                    if key >= lo_b and key < hi_b:
                        x = x * scale - slope_b * (pos_b - Float32(key))
                    else:
                        x = neg_inf[DType.float32]()
                    mx_b = max(mx_b, x)
                s[4 * j + e] = x
        mx_a = quad_max(mx_a)
        mx_b = quad_max(mx_b)
        if t4 == 0:
            xmax_s.unsafe_store(wg * S9_ROWS + ra, mx_a)
            xmax_s.unsafe_store(wg * S9_ROWS + rb, mx_b)
        named_barrier[S9_MATH_THREADS](BAR_MAX)
        var other = (1 - wg) * S9_ROWS
        var mn_a = max(m_a, max(mx_a, xmax_s.unsafe_load(other + ra)))
        var mn_b = max(m_b, max(mx_b, xmax_s.unsafe_load(other + rb)))
        var step_a = rescale_row(m_a, mn_a)
        var step_b = rescale_row(m_b, mn_b)
        var corr_a = step_a[0]
        var corr_b = step_b[0]
        var sh_a = step_a[1]
        var sh_b = step_b[1]
        m_a = mn_a
        m_b = mn_b

        # Probabilities: float32 row sums, dtype values into this warpgroup's 32 columns of box 8
        # (K-major, swizzled: 16-byte chunk 4 wg + j of the row).
        var ps_a = Float32(0)
        var ps_b = Float32(0)
        var p_box = sm.stage(st).unsafe_offset((S9_BOXES - 1) * S9_BOX_BYTES)
        comptime for j in range(NJ_S):
            var pa = exp(SIMD[DType.float32, 2](s[4 * j], s[4 * j + 1]) - sh_a)
            var pb = exp(SIMD[DType.float32, 2](s[4 * j + 2], s[4 * j + 3]) - sh_b)
            ps_a += pa.reduce_add()
            ps_b += pb.reduce_add()
            var chunk = (HALF // 8) * wg + j
            var at_a = ra * 128 + ((chunk ^ (ra % 8)) * 16) + 4 * t4
            var at_b = rb * 128 + ((chunk ^ (rb % 8)) * 16) + 4 * t4
            p_box.unsafe_offset(at_a).unsafe_bitcast[Scalar[dtype]]().unsafe_store[alignment=4](0, pa.cast[dtype]())
            p_box.unsafe_offset(at_b).unsafe_bitcast[Scalar[dtype]]().unsafe_store[alignment=4](0, pb.cast[dtype]())
        l_a = l_a * corr_a + ps_a
        l_b = l_b * corr_b + ps_b
        if keys.partial(b):
            zero_outside_values(sm, keys, b, st, wg, wt)
        fence_async_proxy()
        named_barrier[S9_MATH_THREADS](BAR_P)  # both halves of P (and zeroed rows) written

        # O = O corr + P V on this warpgroup's 256 value columns (boxes 4 wg .. 4 wg + 3), all 64 keys.
        comptime for j in range(NJ_O):
            acc[4 * j] *= corr_a
            acc[4 * j + 1] *= corr_a
            acc[4 * j + 2] *= corr_b
            acc[4 * j + 3] *= corr_b
        wgmma_fence_aligned()
        var p_u = stage_u + UInt32((S9_BOXES - 1) * S9_BOX_BYTES)
        var v_u = stage_u + UInt32(4 * wg * S9_BOX_BYTES)
        comptime for kk in range(S9_KEYS // 16):
            acc = wgmma_async[64, S9_VALUE_COLS, 16, DType.float32, ACC_W, a_type=dtype, b_type=dtype, layout_b="row"](
                sw128_desc[dtype](p_u + UInt32(kk * 32), 16, 1024),
                sw128_desc[dtype](v_u + UInt32(kk * 16 * 128), S9_BOX_BYTES, 1024),
                acc,
            )
        wgmma_commit_group_sync()
        wgmma_wait_group_sync[0]()
        if lane == 0:
            _ = mbarrier_arrive(sm.empty(st))

    # The key loop is done: the merge may be scheduled (pdl.mojo), as late as this so that its blocks
    # never wait on SMs this kernel's blocks still need (the producer warpgroup has exited).
    allow_dependents()
    # Row sums: this thread's quad, then both warpgroups.
    var xsum_s = sm.xsum()
    l_a = quad_sum(l_a)
    l_b = quad_sum(l_b)
    if t4 == 0:
        xsum_s.unsafe_store(wg * S9_ROWS + ra, l_a)
        xsum_s.unsafe_store(wg * S9_ROWS + rb, l_b)
    named_barrier[S9_MATH_THREADS](BAR_SUM)
    l_a = xsum_s.unsafe_load(ra) + xsum_s.unsafe_load(S9_ROWS + ra)
    l_b = xsum_s.unsafe_load(rb) + xsum_s.unsafe_load(S9_ROWS + rb)
    if blk.normalized and p.quant.active != 0:
        store_quantized_rows[ACC_W, NJ_O](p, blk, acc, wg, t4, ra, l_a)
        store_quantized_rows[ACC_W, NJ_O](p, blk, acc, wg, t4, rb, l_b, second=True)
    else:
        store_rows[ACC_W, NJ_O](p.att, blk, acc, wg * S9_VALUE_COLS + 2 * t4, ra, m_a, l_a)
        store_rows[ACC_W, NJ_O](p.att, blk, acc, wg * S9_VALUE_COLS + 2 * t4, rb, m_b, l_b, second=True)
    if wg == 0 and t4 == 0:
        blk.store_stats(p.att, blk.row0 + ra, m_a, l_a)
        blk.store_stats(p.att, blk.row0 + rb, m_b, l_b)


@always_inline
def store_rows[
    dtype: DType, //, acc_w: Int, nj: Int
](
    p: AttentionParams[dtype], blk: AttentionBlock, acc: SIMD[DType.float32, acc_w], col0: Int, r: Int, m: Float32,
    l: Float32, second: Bool = False,
):
    """Block row `r`'s part of the accumulator (elements `4 j + 2 second + {0, 1}`, columns `col0 + 8 j`)
    into `raw` (one partition: normalized, in dtype) or this partition's `part_out`."""
    var row = blk.row0 + r
    if row >= blk.row_end:
        return
    var out = blk.result_row(p, row)
    var inv = AttentionBlock.inverse_sum(l)
    var e0 = 2 if second else 0
    comptime for j in range(nj):
        var v = SIMD[DType.float32, 2](acc[4 * j + e0], acc[4 * j + e0 + 1])
        out.unsafe_offset(col0 + 8 * j).unsafe_store[alignment=8](0, blk.result[dtype, 2](v, inv))


@always_inline
def store_quantized_rows[
    dtype: DType, //, acc_w: Int, nj: Int
](
    p: TmaAttentionParams[dtype], blk: AttentionBlock, acc: SIMD[DType.float32, acc_w], wg: Int, t4: Int, r: Int,
    l: Float32, second: Bool = False,
):
    """Block row `r`'s 256 columns of warpgroup `wg`, normalized (`blk.result`), quantized for step 6 as
    `merge.quantize_row` quantizes a merged row, bit for bit: per K block of S9_QUANT_BLOCK columns
    `s = activation_scale(amax)`, the values `e4m3(x / s)` as float16 into `p.quant`; with
    `has_attention_output` the row as dtype too. A quad holds 256 contiguous columns of the row
    (elements `4 j + 2 second + {0, 1}`, columns `8 j + 2 t4`), so a block's amax is a quad max."""
    comptime J_PER_BLOCK = S9_QUANT_BLOCK // 8
    var row = blk.row0 + r
    var live = row < blk.row_end  # every lane of the quad agrees (one row): the quad max runs on all
    var rank = Int(p.att.kv_lora_rank)
    var inv = AttentionBlock.inverse_sum(l)
    var e0 = 2 if second else 0
    comptime for kb in range(nj // J_PER_BLOCK):
        var vals = SIMD[DType.float32, 2 * J_PER_BLOCK](0)
        comptime for jj in range(J_PER_BLOCK):
            comptime j = kb * J_PER_BLOCK + jj
            var v = blk.result[dtype, 2](SIMD[DType.float32, 2](acc[4 * j + e0], acc[4 * j + e0 + 1]), inv)
            vals[2 * jj] = v[0]
            vals[2 * jj + 1] = v[1]
        var scale = activation_scale(quad_max(abs(vals).reduce_max()))
        if live:
            var block = (wg * S9_VALUE_COLS) // S9_QUANT_BLOCK + kb
            if t4 == 0:
                p.quant.scales.unsafe_store(row * (rank // S9_QUANT_BLOCK) + block, scale)
            comptime for jj in range(J_PER_BLOCK):
                var col = wg * S9_VALUE_COLS + 8 * (kb * J_PER_BLOCK + jj) + 2 * t4
                var v = SIMD[DType.float32, 2](vals[2 * jj], vals[2 * jj + 1])
                p.quant.values.unsafe_offset(row * rank + col).unsafe_store[alignment=4](0, e4m3_as_f16[2](v, scale))
                if p.has_attention_output != 0:
                    p.attention_output.unsafe_offset(row * rank + col).unsafe_store[alignment=2 * size_of[dtype]()](
                        0, v.cast[dtype]()
                    )
