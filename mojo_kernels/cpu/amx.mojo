"""The AMX tile unit: eight tile registers, `tdpbf16ps`, and what steps 3, 5 and 6 share on it.

`tdpbf16ps c, a, b` adds to the float32 tile `c [16 x 16]` the products of
the bf16 tile `a [16 x 32]` with `b`, a `[32 x 16]` bf16 matrix stored in
pairs (row `p` of the tile holds, for each of the 16 columns, the values of
rows `2p` and `2p + 1`): each product exact, summed in float32, the op's
rounding points (`pymla/reference.py`). Every tile here is configured as 16
rows of 64 bytes, the most AMX has.

The tile operations go through `TileUnit`: `AmxTiles` is the unit itself;
`tests/cpu/check_common.mojo` brings an emulation of the same instructions,
so the layouts are checked on CPUs without AMX too. Linux hands a process
the tile registers only on request (`amx_permitted`, before the first tile
instruction of a call). Step 5 on tiles: `cpu/amx_attention.mojo`; steps 3
and 6: `cpu/amx_matmul.mojo`.
"""

from std.ffi import external_call
from std.memory import stack_allocation
from std.sys import llvm_intrinsic
from std.sys.info import CompilationTarget

from ..common import FPtr
from .bf16 import BF16Ptr

comptime HAS_AMX = CompilationTarget._has_feature["amx-tile"]() and CompilationTarget._has_feature["amx-bf16"]()
"""Whether the CPU the op is compiled for has the AMX tile unit with bf16 dot products."""

comptime BytePtr = Pointer[UInt8, MutUntrackedOrigin]
comptime TILE_ROWS = 16
"""Rows of every tile: keys of a score tile, query rows of a row block."""
comptime TILE_PAIRS = 16
"""Value pairs per tile row (64 bytes): a depth step of `tdpbf16ps` is `2 * TILE_PAIRS` values."""
comptime TILE_DEPTH = 2 * TILE_PAIRS
comptime TILE_BYTES = TILE_PAIRS * 4
comptime TILE_ELEMENTS = TILE_ROWS * TILE_DEPTH

# The eight tile registers: four accumulators (row block i, key half or column block j: ACC + 2 i + j),
# two left operands, two right operands.
comptime ACC = 0
comptime LEFT = 4
comptime RIGHT = 6

comptime SYS_ARCH_PRCTL = 158
comptime ARCH_REQ_XCOMP_PERM = 0x1023
comptime XFEATURE_XTILEDATA = 18


def amx_permitted() -> Bool:
    """Asks Linux for the tile registers; whether it granted them.

    Once granted, for the whole process (every thread); asking again is a
    no-op. Without the grant the first tile instruction faults. Linux
    refuses where its AMX support is off, or where a thread's signal stack
    is too small for the tile state.
    """
    return external_call["syscall", Int](SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


trait TileUnit(Defaultable, Deinitable):
    """Eight tile registers of 16 rows x 64 bytes and the instructions step 5 uses on them."""

    def start(mut self):
        """Configures all eight tiles as 16 rows x 64 bytes (`ldtilecfg`)."""
        ...

    def load[t: Int](mut self, src: BytePtr, stride: Int):
        """Tile `t` = 16 rows of 64 bytes from `src`, rows `stride` bytes apart (`tileloadd`)."""
        ...

    def store[t: Int](mut self, dst: BytePtr, stride: Int):
        """The 16 rows of tile `t` to `dst`, rows `stride` bytes apart (`tilestored`)."""
        ...

    def zero[t: Int](mut self):
        """Tile `t` = 0 (`tilezero`)."""
        ...

    def dot[c: Int, a: Int, b: Int](mut self):
        """`c[m, n] += sum_p a[m, 2p] b[p, 2n] + a[m, 2p + 1] b[p, 2n + 1]` in bf16 pairs (`tdpbf16ps`)."""
        ...

    def stop(mut self):
        """Releases the tiles (`tilerelease`)."""
        ...


struct AmxTiles(TileUnit):
    """The AMX unit. Its instructions are emitted only where the compile target has AMX
    (the op never takes this path elsewhere: `cpu_pipeline.attention_path`)."""

    def __init__(out self):
        pass

    @always_inline
    def start(mut self):
        comptime if HAS_AMX:
            # Palette 1; bytes 16..31: bytes per row of tiles 0..7 (u16); bytes 48..55: their rows.
            var config = SIMD[DType.uint8, 64](0)
            config[0] = 1
            comptime for t in range(8):
                config[16 + 2 * t] = UInt8(TILE_BYTES)
                config[48 + t] = UInt8(TILE_ROWS)
            var stack = stack_allocation[64, UInt8, alignment=64]()
            stack.unsafe_store[width=64](0, config)
            llvm_intrinsic["llvm.x86.ldtilecfg", NoneType](stack)

    @always_inline
    def load[t: Int](mut self, src: BytePtr, stride: Int):
        comptime if HAS_AMX:
            llvm_intrinsic["llvm.x86.tileloadd64", NoneType](Int8(t), src, Int64(stride))

    @always_inline
    def store[t: Int](mut self, dst: BytePtr, stride: Int):
        comptime if HAS_AMX:
            llvm_intrinsic["llvm.x86.tilestored64", NoneType](Int8(t), dst, Int64(stride))

    @always_inline
    def zero[t: Int](mut self):
        comptime if HAS_AMX:
            llvm_intrinsic["llvm.x86.tilezero", NoneType](Int8(t))

    @always_inline
    def dot[c: Int, a: Int, b: Int](mut self):
        comptime if HAS_AMX:
            llvm_intrinsic["llvm.x86.tdpbf16ps", NoneType](Int8(c), Int8(a), Int8(b))

    @always_inline
    def stop(mut self):
        comptime if HAS_AMX:
            llvm_intrinsic["llvm.x86.tilerelease", NoneType]()


@always_inline
def as_bytes(p: BF16Ptr, offset: Int) -> BytePtr:
    return p.unsafe_offset(offset).unsafe_bitcast[UInt8]()


@always_inline
def f32_bytes(p: FPtr, offset: Int) -> BytePtr:
    return p.unsafe_offset(offset).unsafe_bitcast[UInt8]()


@always_inline
def swap_blocks[b: Int](mut v: Array[SIMD[DType.float32, 16], 16]):
    """Swaps the off-diagonal `b x b` blocks of every `2b x 2b` block of the 16 x 16 matrix `v` (rows)."""
    comptime for i in range(16):
        comptime if i & b == 0:
            var x = v[i]
            var y = v[i + b]
            comptime if b == 8:
                v[i] = x.shuffle[0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23](y)
                v[i + b] = x.shuffle[8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31](y)
            elif b == 4:
                v[i] = x.shuffle[0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27](y)
                v[i + b] = x.shuffle[4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31](y)
            elif b == 2:
                v[i] = x.shuffle[0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29](y)
                v[i + b] = x.shuffle[2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31](y)
            else:
                v[i] = x.shuffle[0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30](y)
                v[i + b] = x.shuffle[1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31](y)


def transpose_into_scores(acc: FPtr, scores: FPtr, row0: Int, key0: Int, tile: Int):
    """`scores[(row0 + n) * tile + key0 + m] = acc[m * 16 + n]`: a stored `S^T` block back to `[rows x keys]`.

    Four butterfly levels of two-source shuffles (`swap_blocks` 8, 4, 2, 1).
    """
    var v = Array[SIMD[DType.float32, 16], 16](fill=SIMD[DType.float32, 16](0))
    comptime for m in range(16):
        v[m] = acc.unsafe_load[width=16](m * 16)
    swap_blocks[8](v)
    swap_blocks[4](v)
    swap_blocks[2](v)
    swap_blocks[1](v)
    comptime for n in range(16):
        scores.unsafe_store((row0 + n) * tile + key0, v[n])
