"""Hopper (sm_90a) primitives of the TMA attention kernels (`attention_sm90.mojo`, `attention_narrow.mojo`):
shared-memory addresses as PTX takes them, TMA box copies and transaction barriers, mbarrier waits
(with an optional watchdog for debugging builds), and `wgmma` descriptors of 128-byte-swizzled tiles."""

from std.sys import get_defined_int
from std.sys._assembly import inlined_assembly

from max.gpu.compute.mma import WGMMADescriptor

from .attention_block import SPtr

# Debugging builds (`mojo build -D PYMLA_SM90_WATCHDOG_MS=2000`, scripts/build_devbin.sh's smoke
# binary): an mbarrier wait longer than this many milliseconds traps (the launch fails instead of
# hanging). No message: a `print` here is a call, for which ptxas drops `setmaxnreg` (C7507) and
# spills 4 KB, so the debugging build would not run the product's register split. Named barriers
# and `setmaxnreg.inc` wait in hardware: no watchdog can cover them. 0 (the product): none.
comptime S9_WATCHDOG_MS = get_defined_int["PYMLA_SM90_WATCHDOG_MS", 0]()


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


@fieldwise_init
struct Sw128[dtype: DType, lbo: Int, sbo: Int](TrivialRegisterPassable):
    """wgmma descriptors of 128-byte-swizzled operands at byte offsets from one shared address.

    K-major (Q, K, P): `sbo` = 1024 (8 rows of 128 bytes), `lbo` unused; a k16
    step inside a box adds 32 bytes to the start. MN-major (V): `lbo` = the
    stride between 64-column boxes, `sbo` = 1024 (8 keys).

    The descriptor's low word (start address >> 4, `lbo` >> 4) is computed once
    by `of`; each tile's descriptor is one 32-bit add by `at`, the high word
    (`sbo` >> 4, the 128-byte swizzle mode) a constant.
    """

    var lo: UInt32
    comptime HI = (UInt64(Self.sbo >> 4) << 32) | (UInt64(1) << 62)

    @staticmethod
    @always_inline
    def of(addr: UInt32) -> Self:
        """The descriptors of tiles from shared address `addr` on."""
        return Self(((addr & 0x3FFFF) >> 4) | (UInt32(Self.lbo >> 4) << 16))

    @always_inline
    def at(self, offset: Int) -> WGMMADescriptor[Self.dtype]:
        """The descriptor of the tile `offset` bytes on (a multiple of 16 within shared memory, whose
        addresses fit the 14-bit field: the add cannot carry into `lbo`)."""
        return WGMMADescriptor[Self.dtype](Int64(Self.HI | UInt64(self.lo + UInt32(offset >> 4))))
