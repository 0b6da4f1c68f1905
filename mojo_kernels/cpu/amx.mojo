"""Step 5's two products on AMX tiles (`tdpbf16ps`), for bfloat16 caches.

`tdpbf16ps c, a, b` adds to the float32 tile `c [16 x 16]` the products of
the bf16 tile `a [16 x 32]` with `b`, a `[32 x 16]` bf16 matrix stored in
pairs (row `p` of the tile holds, for each of the 16 columns, the values of
rows `2p` and `2p + 1`): each product exact, summed in float32, the op's
rounding points (`pymla/reference.py`). Every tile here is configured as 16
rows of 64 bytes, the most AMX has.

* Scores, transposed: `S^T [keys x rows] = K Q^T`. The `a` tiles are 16 keys
  by 32 values read in place from the paged cache (one `tileloadd` with the
  row stride) when the 16 keys lie in one page and the key dim is a multiple
  of 32; otherwise they are gathered into a staging buffer first. The `b`
  tiles are the task's query rows in pairs (`pack_queries`), packed once per
  task. A 32-key tile takes two key tiles against two 16-row blocks: four
  accumulators, two key tiles, two query tiles, the eight tile registers.
  The accumulators are stored and transposed into the `[rows x keys]`
  scores the shared softmax update reads.
* `O = O * correction + P V`: the `a` tiles are the probabilities rounded
  to bf16 (16 rows by the tile's 32 keys), the `b` tiles the tile's value
  rows interleaved in key pairs (`pack_values`, once per key tile, shared by
  every row block), and the accumulators are loaded from and stored back to
  `O` itself, after the rows whose maximum moved are rescaled.

Key tiles start at multiples of 32 of the request's positions, so with a
page size that is a multiple of 16 every 16-key half lies in one page. Keys
of a tile outside the task's range are masked by the softmax update; their
value rows are packed as zeros (a slot past the request's tokens may hold
any bits, and `0 * NaN` is NaN).

The tile operations go through `TileUnit`: `AmxTiles` is the unit itself;
`tests/cpu/amx_check.mojo` brings an emulation of the same instructions, so
the layouts are checked on CPUs without AMX too. Linux hands a process the
tile registers only on request (`amx_permitted`, before the first tile
instruction of a call).
"""

from std.ffi import external_call
from std.math import min
from std.sys import llvm_intrinsic, prefetch
from std.sys.info import CompilationTarget

from ..common import FPtr, ceil_div
from .bf16 import NEXT_TILE_PREFETCH, BF16Ptr

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
comptime AMX_KEY_TILE = 2 * TILE_ROWS
"""Keys per tile: two score tiles, one depth step of P V."""

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
            var stack = List[SIMD[DType.uint8, 64]](length=1, fill=config)
            llvm_intrinsic["llvm.x86.ldtilecfg", NoneType](stack.unsafe_ptr())
            _ = stack^

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


def pack_queries(q: FPtr, packed: BF16Ptr, padded_rows: Int, key_dim: Int, steps: Int):
    """The right operands of the scores, per 16-row block `rb` and depth step `s` (zeros past `key_dim`):

    `packed[((rb * steps + s) * 16 + p) * 32 + 2 n + i] = q[16 rb + n, 32 s + 2 p + i]`;
    `q [padded_rows, key_dim]` holds bf16 values in float32 (exact).
    """
    for rb in range(padded_rows // TILE_ROWS):
        for s in range(steps):
            var block = packed.unsafe_offset((rb * steps + s) * TILE_ELEMENTS)
            for n in range(TILE_ROWS):
                var row = q.unsafe_offset((rb * TILE_ROWS + n) * key_dim)
                for k in range(TILE_DEPTH):
                    var d = s * TILE_DEPTH + k
                    var v = row.unsafe_load(d) if d < key_dim else Float32(0)
                    block.unsafe_store((k // 2) * TILE_DEPTH + 2 * n + k % 2, v.cast[DType.bfloat16]())


@fieldwise_init
struct KeyRows(TrivialRegisterPassable):
    """16 key rows: row `j` at `base + j * stride` (bf16 elements)."""

    var base: BF16Ptr
    var stride: Int


def gather_keys(
    rows: Array[BF16Ptr, TILE_ROWS], valid: Array[Bool, TILE_ROWS], staging: BF16Ptr, key_dim: Int, padded_dim: Int
) -> KeyRows:
    """Copies the valid key rows into `staging [16, padded_dim]`; zeros elsewhere (invalid keys, past `key_dim`)."""
    for j in range(TILE_ROWS):
        var dst = staging.unsafe_offset(j * padded_dim)
        for d in range(padded_dim):
            dst.unsafe_store(d, rows[j].unsafe_load(d) if valid[j] and d < key_dim else BFloat16(0))
    return KeyRows(staging, padded_dim)


comptime PAD = TILE_BYTES
"""Bytes added to the row stride of the packed values and of O: at rank 512 their rows would be
2 KiB apart, so a tile's 16 rows would fall into two sets of the L1 cache."""


def packed_values_stride(rank_main: Int) -> Int:
    """Elements between the rows of `pack_values`' output."""
    return 2 * rank_main + PAD // 2


def pack_values(keys: Array[KeyRows, 2], valid: Array[Bool, AMX_KEY_TILE], packed: BF16Ptr, rank_main: Int):
    """The right operands of P V: `packed[p * stride + 2 c + i] = V[2 p + i, c]` for `c < rank_main`.

    `V[j]` is key `j` of the tile (row `j % 16` of `keys[j // 16]`), zeros for keys not `valid`;
    `stride = packed_values_stride(rank_main)`. The column block `cb` of the tile is then 64 bytes
    at `packed + 32 cb`, rows `2 stride` bytes apart.
    """
    comptime W = 16
    var stride = packed_values_stride(rank_main)
    for p in range(TILE_PAIRS):
        var dst = packed.unsafe_offset(p * stride)
        var j = 2 * p
        var half = keys[j // TILE_ROWS]
        var a = half.base.unsafe_offset((j % TILE_ROWS) * half.stride)
        var b = half.base.unsafe_offset((j % TILE_ROWS + 1) * half.stride)
        var a_on = valid[j]
        var b_on = valid[j + 1]
        for c in range(0, rank_main, W):
            var va = a.unsafe_load[width=W](c) if a_on else SIMD[DType.bfloat16, W](0)
            var vb = b.unsafe_load[width=W](c) if b_on else SIMD[DType.bfloat16, W](0)
            dst.unsafe_store(2 * c, va.interleave(vb))


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


def tile_scores_amx[
    T: TileUnit
](
    mut unit: T,
    keys: Array[KeyRows, 2],
    next_keys: Array[BF16Ptr, AMX_KEY_TILE],
    q_packed: BF16Ptr,
    scores: FPtr,
    acc: FPtr,
    padded_rows: Int,
    steps: Int,
):
    """`scores [rows, 32]` of the tile's two key halves against the packed queries; `acc [4 x 256]` is scratch.

    Row blocks are taken in pairs: per depth step, two key tiles and two
    query tiles feed four `tdpbf16ps`. The first pair's depth step `s` also
    prefetches 64-byte line `s` of each row of the next tile (`next_keys`):
    pages are scattered, so the hardware prefetcher cannot run ahead across them.
    """
    var row_blocks = padded_rows // TILE_ROWS
    var k0 = as_bytes(keys[0].base, 0)
    var k1 = as_bytes(keys[1].base, 0)
    var stride0 = keys[0].stride * 2
    var stride1 = keys[1].stride * 2
    var rb = 0
    while rb < row_blocks:
        var two = rb + 1 < row_blocks
        unit.zero[ACC]()
        unit.zero[ACC + 1]()
        if two:
            unit.zero[ACC + 2]()
            unit.zero[ACC + 3]()
        for s in range(steps):
            if rb == 0:
                comptime for j in range(AMX_KEY_TILE):
                    prefetch[NEXT_TILE_PREFETCH](next_keys[j].unsafe_offset(s * TILE_DEPTH))
            unit.load[LEFT](k0.unsafe_offset(s * TILE_BYTES), stride0)
            unit.load[LEFT + 1](k1.unsafe_offset(s * TILE_BYTES), stride1)
            unit.load[RIGHT](as_bytes(q_packed, (rb * steps + s) * TILE_ELEMENTS), TILE_BYTES)
            unit.dot[ACC, LEFT, RIGHT]()
            unit.dot[ACC + 1, LEFT + 1, RIGHT]()
            if two:
                unit.load[RIGHT + 1](as_bytes(q_packed, ((rb + 1) * steps + s) * TILE_ELEMENTS), TILE_BYTES)
                unit.dot[ACC + 2, LEFT, RIGHT + 1]()
                unit.dot[ACC + 3, LEFT + 1, RIGHT + 1]()
        unit.store[ACC](f32_bytes(acc, 0), TILE_BYTES)
        unit.store[ACC + 1](f32_bytes(acc, 256), TILE_BYTES)
        transpose_into_scores(acc, scores, rb * TILE_ROWS, 0, AMX_KEY_TILE)
        transpose_into_scores(acc.unsafe_offset(256), scores, rb * TILE_ROWS, TILE_ROWS, AMX_KEY_TILE)
        if two:
            unit.store[ACC + 2](f32_bytes(acc, 512), TILE_BYTES)
            unit.store[ACC + 3](f32_bytes(acc, 768), TILE_BYTES)
            transpose_into_scores(acc.unsafe_offset(512), scores, (rb + 1) * TILE_ROWS, 0, AMX_KEY_TILE)
            transpose_into_scores(acc.unsafe_offset(768), scores, (rb + 1) * TILE_ROWS, TILE_ROWS, AMX_KEY_TILE)
        rb += 2


def accumulate_values_amx[
    T: TileUnit
](
    mut unit: T,
    probs: FPtr,
    probs_bf16: BF16Ptr,
    keys: Array[KeyRows, 2],
    valid: Array[Bool, AMX_KEY_TILE],
    v_packed: BF16Ptr,
    acc_out: FPtr,
    out_stride: Int,
    correction: FPtr,
    padded_rows: Int,
    rank: Int,
):
    """`acc_out[r] = acc_out[r] * correction[r] + sum_j probs[r, j] V[j, :rank]` over the tile's 32 keys.

    `acc_out` rows are `out_stride` floats apart (`AmxScratch.out_stride`).
    `probs [rows, 32]` hold bf16 values in float32 (the probabilities rounded
    for P V); `probs_bf16 [rows, 32]` and `v_packed` are scratch. Columns past
    the last multiple of 16 are summed in float32 here.
    """
    comptime W = 16
    var rank_main = rank - rank % W
    for r in range(padded_rows):
        probs_bf16.unsafe_store(
            r * AMX_KEY_TILE, probs.unsafe_load[width=AMX_KEY_TILE](r * AMX_KEY_TILE).cast[DType.bfloat16]()
        )
        var corr = correction.unsafe_load(r)
        if corr != 1:
            var row = acc_out.unsafe_offset(r * out_stride)
            var c = 0
            while c + W <= rank:
                row.unsafe_store(c, row.unsafe_load[width=W](c) * corr)
                c += W
            while c < rank:
                row.unsafe_store(c, row.unsafe_load(c) * corr)
                c += 1
    pack_values(keys, valid, v_packed, rank_main)
    var row_blocks = padded_rows // TILE_ROWS
    var col_blocks = rank_main // W
    var out_bytes = out_stride * 4
    var v_bytes = packed_values_stride(rank_main) * 2
    var rb = 0
    while rb < row_blocks:
        var two_rows = rb + 1 < row_blocks
        unit.load[LEFT](as_bytes(probs_bf16, rb * TILE_ROWS * AMX_KEY_TILE), TILE_BYTES)
        if two_rows:
            unit.load[LEFT + 1](as_bytes(probs_bf16, (rb + 1) * TILE_ROWS * AMX_KEY_TILE), TILE_BYTES)
        var cb = 0
        while cb < col_blocks:
            var two_cols = cb + 1 < col_blocks
            var o0 = f32_bytes(acc_out, rb * TILE_ROWS * out_stride + cb * W)
            var o1 = f32_bytes(acc_out, (rb + 1) * TILE_ROWS * out_stride + cb * W)
            unit.load[RIGHT](as_bytes(v_packed, cb * TILE_DEPTH), v_bytes)
            unit.load[ACC](o0, out_bytes)
            unit.dot[ACC, LEFT, RIGHT]()
            unit.store[ACC](o0, out_bytes)
            if two_cols:
                unit.load[RIGHT + 1](as_bytes(v_packed, (cb + 1) * TILE_DEPTH), v_bytes)
                unit.load[ACC + 1](o0.unsafe_offset(TILE_BYTES), out_bytes)
                unit.dot[ACC + 1, LEFT, RIGHT + 1]()
                unit.store[ACC + 1](o0.unsafe_offset(TILE_BYTES), out_bytes)
            if two_rows:
                unit.load[ACC + 2](o1, out_bytes)
                unit.dot[ACC + 2, LEFT + 1, RIGHT]()
                unit.store[ACC + 2](o1, out_bytes)
                if two_cols:
                    unit.load[ACC + 3](o1.unsafe_offset(TILE_BYTES), out_bytes)
                    unit.dot[ACC + 3, LEFT + 1, RIGHT + 1]()
                    unit.store[ACC + 3](o1.unsafe_offset(TILE_BYTES), out_bytes)
            cb += 2
        rb += 2
    # Columns past the last whole column block (a kv_lora_rank that is not a multiple of 16).
    for r in range(padded_rows):
        for c in range(rank_main, rank):
            var acc = acc_out.unsafe_load(r * out_stride + c)
            for j in range(AMX_KEY_TILE):
                if valid[j]:
                    var half = keys[j // TILE_ROWS]
                    var v = half.base.unsafe_load((j % TILE_ROWS) * half.stride + c).cast[DType.float32]()
                    acc += probs.unsafe_load(r * AMX_KEY_TILE + j) * v
            acc_out.unsafe_store(r * out_stride + c, acc)


struct AmxScratch(Movable):
    """A task's buffers for the AMX path: packed queries, staging for gathered keys, packed values, P, S^T,
    and O with padded rows."""

    var q_packed: List[BFloat16]  # [row blocks, steps, 16, 32]
    var staging: List[BFloat16]  # [2, 16, steps * 32]
    var v_packed: List[BFloat16]  # [16, packed_values_stride]
    var probs: List[BFloat16]  # [padded rows, 32]
    var acc: List[Float32]  # [4, 16, 16]
    var out: List[Float32]  # [padded rows, out_stride]
    var steps: Int
    var out_stride: Int

    def __init__(out self, padded_rows: Int, key_dim: Int, rank: Int):
        self.steps = ceil_div(key_dim, TILE_DEPTH)
        var padded_dim = self.steps * TILE_DEPTH
        self.q_packed = List[BFloat16](length=padded_rows * padded_dim, fill=0)
        self.staging = List[BFloat16](length=2 * TILE_ROWS * padded_dim, fill=0)
        self.v_packed = List[BFloat16](length=TILE_PAIRS * packed_values_stride(rank), fill=0)
        self.out_stride = rank + PAD // 4
        self.out = List[Float32](length=padded_rows * self.out_stride, fill=0)
        self.probs = List[BFloat16](length=padded_rows * AMX_KEY_TILE, fill=0)
        self.acc = List[Float32](length=4 * TILE_ROWS * TILE_ROWS, fill=0)


@always_inline
def untracked_bf16(mut buffer: List[BFloat16]) -> BF16Ptr:
    return buffer.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
