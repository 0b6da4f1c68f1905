"""Step 5's two products on AMX tiles (`cpu/amx.mojo`), for bfloat16 caches.

A key tile is AMX_KEY_TILE keys: KEY_BLOCKS blocks of 16 keys, each a
`tileloadd` of 16 cache rows in place (the row stride is the cache's) when
the block lies in one page, else gathered into a staging buffer
(`gather_keys`; zeros for keys outside the task).

* Scores, transposed: `S^T [keys x rows] = K Q^T`. The `a` tiles are a key
  block's 16 keys by 32 values, the `b` tiles the task's query rows in pairs
  (`pack_queries`, once per task). Four accumulators per pass
  (`score_group`): one row block against four key blocks, or two row blocks
  against two; the accumulators are stored and transposed into the
  `[rows x keys]` scores the shared softmax update reads.
* `O = O * correction + P V`, in one of two layouts (`ValueLayout`):
  - values in place (`VALUES_IN_PLACE`, few row blocks): the `b` tiles are
    the key blocks themselves, 16 keys by 32 value columns. A `b` row is then
    a key, not a pair of keys, so each key block feeds two `a` tiles: the
    probabilities in the even bf16 slots (zeros in the odd ones) give the even
    value columns, in the odd slots the odd columns (`split_probabilities`).
    Twice the `tdpbf16ps` of the packed layout, but no copy of the values:
    at 16 heads the cache's bytes are the bound, not the unit.
  - values packed (many row blocks): the tile's value rows interleaved in key
    pairs once per key tile (`pack_values`), shared by every row block; the
    `a` tiles are the probabilities, 16 rows by 32 keys.
  Either way `values_2x2` keeps four accumulators, loaded from `O` and stored
  back once per key tile, and takes a left and a right tile pair per depth
  piece (a key block in place, 32 keys packed).

Probabilities are rounded to bf16 for P V (the op's rounding point). Keys
outside the task's range are masked by the softmax update; their value rows
are zeros (packed as zeros, or gathered: a slot past the request's tokens
may hold any bits, and `0 * NaN` is NaN).
"""

from std.math import min
from std.memory import bitcast
from std.sys import prefetch

from ..common import FPtr, ceil_div
from .amx import (
    ACC,
    LEFT,
    RIGHT,
    TILE_BYTES,
    TILE_DEPTH,
    TILE_ELEMENTS,
    TILE_PAIRS,
    TILE_ROWS,
    BytePtr,
    TileUnit,
    as_bytes,
    f32_bytes,
    transpose_into_scores,
)
from .bf16 import NEXT_TILE_PREFETCH, BF16Ptr
from .scratch import Scratch

comptime KEY_BLOCKS = 8
"""16-key blocks per key tile: the softmax bookkeeping and each `O` tile's load and store once per tile.
8 rather than 4 (2026-12-07, step 5 alone, batch 8, 16k, page 64, `amx_check loop`): on a 2-core AMX
guest 128 heads 27.3-29.3 -> 22.3-25.6 ms (with 8 row blocks `O` is 256 KiB, in L2, and each tile
loads and stores it once), 16 heads 7.4-8.6 -> 6.4-8.1 ms; on the H100 machine's 16-core host, five
alternated rounds, medians of the per-round ratios 0.93 (128 heads, whole op) and 0.97 (16 heads)."""
comptime AMX_KEY_TILE = KEY_BLOCKS * TILE_ROWS
comptime PACKED_PIECES = AMX_KEY_TILE // TILE_DEPTH
"""Depth steps of P V per key tile with values packed (32 keys each)."""


@fieldwise_init
struct AmxTuning(TrivialRegisterPassable):
    """The AMX path's tuning choices (data, measured by `tests/cpu/amx_check.mojo`)."""

    var values_in_place_max_row_blocks: Int
    """Up to this many 16-row blocks a task reads the values in place; more share one packed copy."""
    var prefetch_line_stride: Int
    """The score passes prefetch every this-many-th 64-byte line of their share of the next tile's rows
    (1: every line, 2: every other, the L2's adjacent-line prefetcher fetching the pair; 0: none, the
    hardware prefetchers alone, and P V prefetches nothing either; P V's share, `NextTile`, every line)."""
    var score_pairs: Bool
    """A last (or only) row block scores two key blocks at a time on two sets of tile registers, one
    per depth step parity (`score_group`'s `sets`), instead of four key blocks on one set: the tile
    loads of a step need not wait for the dots of the step before, at twice the query loads."""
    var value_pairs: Bool
    """P V with the values read in place takes one right tile at a time on two sets of tile registers,
    one per depth piece parity (`values_2x2`'s `sets`), instead of two right tiles on one set: the
    same trade for P V. (Packed values, many row blocks, keep one set: not measured better there.)"""


comptime AMX_TUNING = AmxTuning(
    values_in_place_max_row_blocks=2, prefetch_line_stride=1, score_pairs=True, value_pairs=True
)
"""The op's AMX tuning. Measured on the H100 machine's 16-core Xeon host (2026-12-05k, `amx_check loop
16 20`, step 5 alone, batch 8, 16k, 16 heads, best of 20, then with 4 key blocks a tile): one register
set 3.50 ms, `score_pairs` 2.22, `value_pairs` 1.71, both 1.65 ms.
With one set a tile load waits for the dots that read its register before (the unit does not
rename tile registers)."""


@fieldwise_init
struct KeyRows(TrivialRegisterPassable):
    """16 key rows: row `j` at `base + j * stride` (bf16 elements)."""

    var base: BF16Ptr
    var stride: Int

    @always_inline
    def tile(self, element: Int) -> BytePtr:
        """The 64 bytes of each row from `element` on, as one tile's source."""
        return as_bytes(self.base, element)

    @always_inline
    def stride_bytes(self) -> Int:
        return 2 * self.stride


def pack_queries(q: FPtr, packed: BF16Ptr, padded_rows: Int, key_dim: Int, steps: Int):
    """The right operands of the scores, per 16-row block `rb` and depth step `s` (zeros past `key_dim`):

    `packed[((rb * steps + s) * 16 + p) * 32 + 2 n + i] = q[16 rb + n, 32 s + 2 p + i]`;
    `q [padded_rows, key_dim]` holds bf16 values in float32 (exact). Each 32-value step of a
    row is 16 bf16 pairs, one 32-bit word each, written down column `n` of the block.
    """
    var words = packed.unsafe_bitcast[UInt32]()
    for rb in range(padded_rows // TILE_ROWS):
        for n in range(TILE_ROWS):
            var row = q.unsafe_offset((rb * TILE_ROWS + n) * key_dim)
            for s in range(steps):
                var step = SIMD[DType.float32, TILE_DEPTH](0)
                if (s + 1) * TILE_DEPTH <= key_dim:
                    step = row.unsafe_load[width=TILE_DEPTH](s * TILE_DEPTH)
                else:
                    for k in range(key_dim - s * TILE_DEPTH):
                        step[k] = row.unsafe_load(s * TILE_DEPTH + k)
                var pairs = bitcast[DType.uint32, TILE_PAIRS](step.cast[DType.bfloat16]())
                var block = words.unsafe_offset((rb * steps + s) * TILE_ELEMENTS // 2)
                comptime for p in range(TILE_PAIRS):
                    block.unsafe_store(p * TILE_ROWS + n, pairs[p])


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


def pack_values(keys: Array[KeyRows, KEY_BLOCKS], valid: Array[Bool, AMX_KEY_TILE], packed: BF16Ptr, rank_main: Int):
    """The right operands of P V: `packed[p * stride + 2 c + i] = V[2 p + i, c]` for `c < rank_main`.

    `V[j]` is key `j` of the tile (row `j % 16` of `keys[j // 16]`), zeros for keys not `valid`;
    `stride = packed_values_stride(rank_main)`. Depth piece `d`, column block `cb` is then the
    64 bytes at `packed + 16 d stride + 32 cb`, rows `2 stride` bytes apart.
    """
    comptime W = 16
    var stride = packed_values_stride(rank_main)
    for p in range(AMX_KEY_TILE // 2):
        var dst = packed.unsafe_offset(p * stride)
        var j = 2 * p
        var block = keys[j // TILE_ROWS]
        var a = block.base.unsafe_offset((j % TILE_ROWS) * block.stride)
        var b = block.base.unsafe_offset((j % TILE_ROWS + 1) * block.stride)
        var a_on = valid[j]
        var b_on = valid[j + 1]
        for c in range(0, rank_main, W):
            var va = a.unsafe_load[width=W](c) if a_on else SIMD[DType.bfloat16, W](0)
            var vb = b.unsafe_load[width=W](c) if b_on else SIMD[DType.bfloat16, W](0)
            dst.unsafe_store(2 * c, va.interleave(vb))


@fieldwise_init
struct NextTile(Copyable, Movable):
    """What a key tile's passes prefetch of the next one: its stored rows (`rows`) and, where each of its 16-key
    blocks lies in one page, the `lines` 64-byte lines of each block as one run from its first row (`lines` 0
    where they do not).

    With runs, the scores prefetch the first half of the next tile's key blocks and P V the second half, so
    memory stays busy through both passes (2-core AMX guest, 16 heads: 3-8% faster than the scores prefetching
    it all); without, the scores prefetch every row, line by line.
    """

    var rows: Array[BF16Ptr, AMX_KEY_TILE]
    var lines: Int

    @always_inline
    def block_start(self, kb: Int) -> BytePtr:
        return self.rows[kb * TILE_ROWS].unsafe_bitcast[UInt8]()

    @always_inline
    def in_scores(self, kb: Int) -> Bool:
        """Whether the scores prefetch key block `kb` of the next tile (else P V does)."""
        return self.lines == 0 or kb < KEY_BLOCKS // 2

    @always_inline
    def prefetch_share(self, i: Int, n: Int):
        """P V's share `i` of `n`: lines `[i p, (i + 1) p)` of each key block the scores leave (`p = ceil(lines / n)`)."""
        var per = ceil_div(self.lines, n)
        var count = min(per, self.lines - i * per)
        comptime for kb in range(KEY_BLOCKS // 2, KEY_BLOCKS):
            var at = self.block_start(kb).unsafe_offset(i * per * 64)
            for j in range(count):
                prefetch[NEXT_TILE_PREFETCH](at.unsafe_offset(j * 64))


@always_inline
def score_group[
    T: TileUnit, RB: Int, KB: Int, prefetch_line_stride: Int, sets: Int = 1
](
    mut unit: T,
    keys: Array[KeyRows, KEY_BLOCKS],
    kb0: Int,
    rb0: Int,
    next: NextTile,
    prefetch_next: Bool,
    q_packed: BF16Ptr,
    scores: FPtr,
    acc: FPtr,
    steps: Int,
):
    """Scores of row blocks `rb0 ..< rb0 + RB` against key blocks `kb0 ..< kb0 + KB` (`RB * KB = 4` accumulators,
    or with `sets = 2` one row block against two key blocks).

    Registers: accumulator `i KB + k` (tiles 0-3); with one row block the
    query tile is 4 and the key blocks take 5, 6, 7, 5; with two, keys 4, 5
    and queries 6, 7; with two sets (accumulators 0, 1), depth step parity
    `e` loads the query into 2 + e and the keys into 4 + 2 e, 5 + 2 e. With `prefetch_next` (and `next.in_scores`),
    depth step `s` also prefetches `KB * 16` lines of the next tile (every `prefetch_line_stride`-th step and line, `AmxTuning`): pages are
    scattered, so the hardware prefetcher cannot run ahead across them. Where each key block lies in one page
    (`next.lines`) the next tile's blocks `kb0 ..< kb0 + KB` in order, 16 consecutive lines of each a step
    (one address add each), else line `s` of each of their rows (`next.rows`, a row pointer loaded each).
    """
    comptime assert (sets == 1 and RB * KB == 4) or (sets == 2 and RB == 1 and KB == 2)
    comptime for a in range(RB * KB):
        unit.zero[ACC + a]()
    for s0 in range(0, steps, sets):
        comptime for e in range(sets):
            var s = s0 + e
            if s < steps:
                comptime if prefetch_line_stride > 0:
                    if prefetch_next and next.in_scores(kb0) and s % prefetch_line_stride == 0:
                        if next.lines > 0:
                            if s * TILE_ROWS < next.lines:
                                comptime for k in range(KB):
                                    var at = next.block_start(kb0 + k).unsafe_offset(s * TILE_ROWS * 64)
                                    comptime for j in range(TILE_ROWS):
                                        prefetch[NEXT_TILE_PREFETCH](at.unsafe_offset(j * prefetch_line_stride * 64))
                        else:
                            comptime for j in range(KB * TILE_ROWS):
                                prefetch[NEXT_TILE_PREFETCH](next.rows[kb0 * TILE_ROWS + j].unsafe_offset(s * TILE_DEPTH))
                comptime for i in range(RB):
                    comptime q_reg = 2 + e if sets == 2 else (4 if RB == 1 else 6 + i)
                    unit.load[q_reg](as_bytes(q_packed, ((rb0 + i) * steps + s) * TILE_ELEMENTS), TILE_BYTES)
                comptime for k in range(KB):
                    comptime k_reg = 4 + 2 * e + k if sets == 2 else (5 + k % 3 if RB == 1 else 4 + k)
                    unit.load[k_reg](keys[kb0 + k].tile(s * TILE_DEPTH), keys[kb0 + k].stride_bytes())
                    comptime for i in range(RB):
                        comptime q_reg = 2 + e if sets == 2 else (4 if RB == 1 else 6 + i)
                        unit.dot[ACC + i * KB + k, k_reg, q_reg]()
    comptime for i in range(RB):
        comptime for k in range(KB):
            unit.store[ACC + i * KB + k](f32_bytes(acc, (i * KB + k) * 256), TILE_BYTES)
            transpose_into_scores(
                acc.unsafe_offset((i * KB + k) * 256), scores, (rb0 + i) * TILE_ROWS, (kb0 + k) * TILE_ROWS,
                AMX_KEY_TILE,
            )


def tile_scores_amx[
    T: TileUnit, prefetch_line_stride: Int, score_pairs: Bool = False
](
    mut unit: T,
    keys: Array[KeyRows, KEY_BLOCKS],
    next: NextTile,
    q_packed: BF16Ptr,
    scores: FPtr,
    acc: FPtr,
    padded_rows: Int,
    steps: Int,
):
    """`scores [rows, AMX_KEY_TILE]` of the tile's key blocks against the packed queries; `acc [4 x 256]` is scratch.

    Row blocks in pairs against pairs of key blocks; a last (or only) row
    block against four key blocks at a time (`score_pairs`: two, on two sets of
    tile registers, `AmxTuning`). The passes of the first row
    blocks prefetch the next tile's blocks that `next.in_scores` names.
    """
    comptime assert KEY_BLOCKS % 4 == 0
    var row_blocks = padded_rows // TILE_ROWS
    var rb = 0
    while rb + 1 < row_blocks:
        comptime for kb0 in range(0, KEY_BLOCKS, 2):
            score_group[T, 2, 2, prefetch_line_stride](unit, keys, kb0, rb, next, rb == 0, q_packed, scores, acc, steps)
        rb += 2
    if rb < row_blocks:
        comptime if score_pairs:
            comptime for kb0 in range(0, KEY_BLOCKS, 2):
                score_group[T, 1, 2, prefetch_line_stride, 2](
                    unit, keys, kb0, rb, next, rb == 0, q_packed, scores, acc, steps
                )
        else:
            comptime for kb0 in range(0, KEY_BLOCKS, 4):
                score_group[T, 1, 4, prefetch_line_stride](unit, keys, kb0, rb, next, rb == 0, q_packed, scores, acc, steps)


@fieldwise_init
struct ValueLayout(TrivialRegisterPassable):
    """Where `values_2x2` finds its tiles for one group of four accumulators (offsets in bytes).

    Left tile `i` of depth piece `d`: `left + i * left_step + d * left_piece`,
    rows `left_stride` apart. Right tile `j` of piece `d` for column block
    `c`: `values[d].tile(32 (c + j))`. Accumulator `(i, j)`:
    `out + i * out_step + (c + j) * out_block`, rows `out_stride` apart.
    """

    var left: BytePtr
    var left_step: Int
    var left_piece: Int
    var left_stride: Int
    var out: BytePtr
    var out_step: Int
    var out_block: Int
    var out_stride: Int
    var lefts: Int  # 1 or 2 left tiles (row blocks, or parities)
    var pieces: Int


@always_inline
def values_2x2[
    T: TileUnit, sets: Int = 1
](mut unit: T, layout: ValueLayout, values: Array[KeyRows, KEY_BLOCKS], c: Int, rights: Int):
    """Accumulators `(i, j)`, `i < layout.lefts`, `j < rights`, += left `i` x right `j` over the depth pieces.

    Registers: accumulator `ACC + 2 i + j`, left tiles `LEFT + i`, right tiles `RIGHT + j` (`cpu/amx.mojo`).
    With `sets = 2` (`rights` must be 1) the depth pieces alternate between two sets of left and right
    tiles: even pieces `LEFT + i` and `RIGHT`, odd pieces tiles 1 and 3 (lefts) and 7 (right), so a
    piece's loads need not wait for the dots of the piece before.
    """
    comptime assert sets == 1 or sets == 2
    var two_left = layout.lefts == 2
    var two_right = rights == 2
    var o = layout.out.unsafe_offset(c * layout.out_block)
    var places = Array[BytePtr, 4](fill=o)
    places[1] = o.unsafe_offset(layout.out_block)
    places[2] = o.unsafe_offset(layout.out_step)
    places[3] = places[2].unsafe_offset(layout.out_block)
    var live = Array[Bool, 4](fill=True)
    live[1] = two_right
    live[2] = two_left
    live[3] = two_left and two_right
    move_accumulators[T, False](unit, places, live, layout.out_stride)
    for d0 in range(0, layout.pieces, sets):
        comptime for e in range(sets):
            comptime l0 = LEFT if e == 0 else 1
            comptime l1 = LEFT + 1 if e == 0 else 3
            comptime r0 = RIGHT if e == 0 else 7
            var d = d0 + e
            if d < layout.pieces:
                var left = layout.left.unsafe_offset(d * layout.left_piece)
                var v = values[d]
                unit.load[l0](left, layout.left_stride)
                unit.load[r0](v.tile(TILE_DEPTH * c), v.stride_bytes())
                unit.dot[ACC, l0, r0]()
                comptime if sets == 1:
                    if two_right:
                        unit.load[RIGHT + 1](v.tile(TILE_DEPTH * (c + 1)), v.stride_bytes())
                        unit.dot[ACC + 1, LEFT, RIGHT + 1]()
                if two_left:
                    unit.load[l1](left.unsafe_offset(layout.left_step), layout.left_stride)
                    unit.dot[ACC + 2, l1, r0]()
                    comptime if sets == 1:
                        if two_right:
                            unit.dot[ACC + 3, LEFT + 1, RIGHT + 1]()
    move_accumulators[T, True](unit, places, live, layout.out_stride)


@always_inline
def move_accumulators[
    T: TileUnit, store: Bool
](mut unit: T, places: Array[BytePtr, 4], live: Array[Bool, 4], stride: Int):
    """Loads (or stores) accumulator tiles `ACC + a` that are `live` from (to) `places[a]`, rows `stride` bytes apart."""
    comptime for a in range(4):
        if live[a]:
            comptime if store:
                unit.store[ACC + a](places[a], stride)
            else:
                unit.load[ACC + a](places[a], stride)


@always_inline
def value_blocks[
    T: TileUnit, //, value_pairs: Bool
](
    mut unit: T, layout: ValueLayout, values: Array[KeyRows, KEY_BLOCKS], blocks: Int, next: NextTile, prefetch_next: Bool
):
    """`values_2x2` over the `blocks` right tiles: two at a time on one register set, or (`value_pairs`) one at
    a time on two. With `prefetch_next`, each takes its share of P V's part of the next tile (`NextTile`)."""
    comptime if value_pairs:
        for c in range(blocks):
            if prefetch_next:
                next.prefetch_share(c, blocks)
            values_2x2[T, 2](unit, layout, values, c, 1)
    else:
        for c in range(0, blocks, 2):
            if prefetch_next:
                next.prefetch_share(c // 2, ceil_div(blocks, 2))
            values_2x2(unit, layout, values, c, min(2, blocks - c))


comptime SPLIT_ROW_WORDS = KEY_BLOCKS * 2 * TILE_PAIRS
"""32-bit words per row of `split_probabilities`' output: per key block, an even and an odd tile row."""


def split_probabilities(probs: FPtr, words: Pointer[UInt32, MutUntrackedOrigin], padded_rows: Int):
    """The left tiles of P V with values in place: row `r`, key block `kb`, parity `e`, word `p` holds
    `P[r, 16 kb + p]` (bf16) in its low half for `e = 0` (the even slot), in its high half for `e = 1`.

    At `words + r * SPLIT_ROW_WORDS + (2 kb + e) * 16`; the other half is zero.
    """
    for r in range(padded_rows):
        var row = words.unsafe_offset(r * SPLIT_ROW_WORDS)
        comptime for kb in range(KEY_BLOCKS):
            var p = probs.unsafe_load[width=TILE_ROWS](r * AMX_KEY_TILE + kb * TILE_ROWS).cast[DType.bfloat16]()
            var low = bitcast[DType.uint16, TILE_ROWS](p).cast[DType.uint32]()
            row.unsafe_store((2 * kb) * TILE_PAIRS, low)
            row.unsafe_store((2 * kb + 1) * TILE_PAIRS, low << 16)


def interleave_value_columns(rows: FPtr, num_rows: Int, row_stride: Int, rank: Int):
    """Puts the columns of the in-place layout back in order: each 32-column block holds its 16 even
    columns, then its 16 odd ones (one accumulator per parity)."""
    for r in range(num_rows):
        var row = rows.unsafe_offset(r * row_stride)
        for c in range(0, rank - rank % TILE_DEPTH, TILE_DEPTH):
            var even = row.unsafe_load[width=TILE_PAIRS](c)
            var odd = row.unsafe_load[width=TILE_PAIRS](c + TILE_PAIRS)
            row.unsafe_store(c, even.interleave(odd))


def accumulate_values_amx[
    T: TileUnit, value_pairs: Bool = False, prefetch: Bool = True
](
    mut unit: T,
    probs: FPtr,
    scratch: BF16Ptr,
    keys: Array[KeyRows, KEY_BLOCKS],
    valid: Array[Bool, AMX_KEY_TILE],
    v_packed: BF16Ptr,
    acc_out: FPtr,
    out_stride: Int,
    correction: FPtr,
    padded_rows: Int,
    rank: Int,
    in_place: Bool,
    next: NextTile,
):
    """`acc_out[r] = acc_out[r] * correction[r] + sum_j probs[r, j] V[j, :rank]` over the tile's keys.

    `acc_out` rows are `out_stride` floats apart (`AmxScratch.out_stride`);
    with `in_place` the columns of each 32-column block are kept as 16 even
    then 16 odd (`interleave_value_columns` restores them once per task), and
    `value_pairs` puts the right tiles on two register sets (`AmxTuning`); with `prefetch`, the first row
    blocks' products prefetch P V's part of the next tile (`next`).
    `probs [rows, AMX_KEY_TILE]` hold bf16 values in float32 (the probabilities
    rounded for P V); `scratch` (`AmxScratch.probs`) and `v_packed` are scratch.
    With `in_place` the key blocks must hold zeros for keys not `valid`.
    Columns past the last whole right tile are summed in float32 here.
    """
    comptime W = 16
    for r in range(padded_rows):
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
    var row_blocks = padded_rows // TILE_ROWS
    var out_bytes = out_stride * 4
    var block = TILE_DEPTH if in_place else TILE_PAIRS  # value columns per right tile
    var rank_main = rank - rank % block
    var blocks = rank_main // block
    var values = keys.copy()
    if in_place:
        split_probabilities(probs, scratch.unsafe_bitcast[UInt32](), padded_rows)
        for rb in range(row_blocks):
            var layout = ValueLayout(
                as_bytes(scratch, rb * TILE_ROWS * 2 * SPLIT_ROW_WORDS), TILE_BYTES, 2 * TILE_BYTES,
                4 * SPLIT_ROW_WORDS, f32_bytes(acc_out, rb * TILE_ROWS * out_stride), TILE_BYTES,
                TILE_DEPTH * 4, out_bytes, 2, KEY_BLOCKS,
            )
            value_blocks[value_pairs](unit, layout, values, blocks, next, prefetch and rb == 0)
    else:
        for r in range(padded_rows):
            scratch.unsafe_store(
                r * AMX_KEY_TILE, probs.unsafe_load[width=AMX_KEY_TILE](r * AMX_KEY_TILE).cast[DType.bfloat16]()
            )
        pack_values(keys, valid, v_packed, rank_main)
        var v_stride = packed_values_stride(rank_main)
        comptime for d in range(PACKED_PIECES):
            values[d] = KeyRows(v_packed.unsafe_offset(TILE_PAIRS * d * v_stride), v_stride)
        for rb in range(0, row_blocks, 2):
            var layout = ValueLayout(
                as_bytes(scratch, rb * TILE_ROWS * AMX_KEY_TILE), TILE_ROWS * AMX_KEY_TILE * 2, TILE_DEPTH * 2,
                AMX_KEY_TILE * 2, f32_bytes(acc_out, rb * TILE_ROWS * out_stride), TILE_ROWS * out_bytes,
                TILE_PAIRS * 4, out_bytes, min(2, row_blocks - rb), PACKED_PIECES,
            )
            value_blocks[False](unit, layout, values, blocks, next, prefetch and rb == 0)
    # Columns past the last whole right tile (a kv_lora_rank that is not a multiple of 16 or 32).
    for r in range(padded_rows):
        for c in range(rank_main, rank):
            var acc = acc_out.unsafe_load(r * out_stride + c)
            for j in range(AMX_KEY_TILE):
                if valid[j]:
                    var kb = keys[j // TILE_ROWS]
                    var v = kb.base.unsafe_load((j % TILE_ROWS) * kb.stride + c).cast[DType.float32]()
                    acc += probs.unsafe_load(r * AMX_KEY_TILE + j) * v
            acc_out.unsafe_store(r * out_stride + c, acc)


struct AmxScratch(Movable):
    """A task's buffers for the AMX path, in its `Scratch`: packed queries, staging for gathered keys,
    packed values, P, S^T, and O with padded rows."""

    var q_packed: BF16Ptr  # [row blocks, steps, 16, 32]
    var staging: BF16Ptr  # [KEY_BLOCKS, 16, steps * 32]
    var v_packed: BF16Ptr  # [AMX_KEY_TILE / 2, packed_values_stride]
    var probs: BF16Ptr  # [padded rows, AMX_KEY_TILE] packed, [padded rows, SPLIT_ROW_WORDS] words in place
    var acc: FPtr  # [4, 16, 16]
    var out: FPtr  # [padded rows, out_stride]
    var steps: Int
    var out_stride: Int

    def __init__(out self, mut mem: Scratch, padded_rows: Int, key_dim: Int, rank: Int):
        self.steps = ceil_div(key_dim, TILE_DEPTH)
        var padded_dim = self.steps * TILE_DEPTH
        self.q_packed = mem.take[DType.bfloat16](padded_rows * padded_dim)
        self.staging = mem.take[DType.bfloat16](KEY_BLOCKS * TILE_ROWS * padded_dim)
        self.v_packed = mem.take[DType.bfloat16]((AMX_KEY_TILE // 2) * packed_values_stride(rank))
        self.out_stride = rank + PAD // 4
        self.out = mem.take[DType.float32](padded_rows * self.out_stride)
        self.probs = mem.take[DType.bfloat16](padded_rows * max(AMX_KEY_TILE, 2 * SPLIT_ROW_WORDS))
        self.acc = mem.take[DType.float32](4 * TILE_ROWS * TILE_ROWS)

    def staging_block(self, kb: Int) -> BF16Ptr:
        return self.staging.unsafe_offset(kb * TILE_ROWS * self.steps * TILE_DEPTH)
