"""Step 5's per-task state: the rows of one attention task and their online softmax.

`TaskRows` holds a task's (token, head) rows: their float32 queries, output
accumulators, the current tile's scores and each row's running max, sum,
correction and ALiBi slope. `softmax_update` turns a tile's scores into
probabilities and updates that state; every tile path of `cpu/attention.mojo`
(float32, AVX512-BF16, AMX) calls it once per key tile. The tile sizes of the
paths live here too, since the score buffer holds the widest tile.
"""

from std.math import exp, min
from std.utils.numerics import neg_inf

from ..common import FPtr, IPtr, ceil_div
from ..paged_cache import CacheShard
from .amx_attention import AMX_KEY_TILE
from .scratch import Scratch
from .simd import DOT_ROWS, F32_WIDTH

comptime KEY_TILE = 4 * F32_WIDTH
"""Keys per tile of the float32 path (keys widened once per tile): four score vectors per row.
Step 5 at 16 heads b8 8k, 2-core AMD EPYC, alternated: 16 keys 15.4-15.5 ms, 64 keys 14.1-14.2."""
comptime BF16_KEY_TILE = 8 * F32_WIDTH
"""Keys per tile of the bf16 path: the P V accumulators are loaded and stored once per tile, and
each row's softmax bookkeeping (max, sum, correction) is paid once per tile. Step 5 at 16 heads
b8 16k, 2-core AMD EPYC, alternated rounds: 32 keys 13.4-13.7 ms, 64 keys 13.0-13.4, 128 keys
(AVX-512) 12.4, 256 keys 12.4; 128 keys no slower than 64 at 128 heads (b8 4k, b1 4k) or at
batch 1."""
comptime MAX_KEY_TILE = max(KEY_TILE, BF16_KEY_TILE, AMX_KEY_TILE)
comptime ROW_BLOCK = DOT_ROWS  # rows per register block (scores and P V)
comptime COL_BLOCK = 4 if F32_WIDTH >= 16 else 2  # value vectors per register block of P V (AVX2: see DOT_COLS)


struct TaskRows(Movable):
    """The (token, head) rows of one attention task and their running state, in the task's `Scratch`."""

    var q_buf: FPtr  # [padded rows, key_dim]
    var out_buf: FPtr  # [padded rows, kv_lora_rank]
    var scores_buf: FPtr  # [padded rows, MAX_KEY_TILE]
    var state_buf: FPtr  # max, sum, correction, slope per padded row
    var meta: IPtr  # lo, hi, position, token, head per row
    var num_rows: Int
    var padded: Int

    def __init__(out self, mut mem: Scratch, num_rows: Int, key_dim: Int, rank: Int, row_multiple: Int):
        """Rows padded to a multiple of `row_multiple` (the path's row block); padding rows stay zero."""
        self.num_rows = num_rows
        self.padded = ceil_div(max(num_rows, 1), row_multiple) * row_multiple
        self.q_buf = mem.take[DType.float32](self.padded * key_dim)
        self.out_buf = mem.take[DType.float32](self.padded * rank)
        self.scores_buf = mem.take[DType.float32](self.padded * MAX_KEY_TILE)
        self.state_buf = mem.take[DType.float32](self.padded * 4)
        self.meta = mem.take_ints(self.padded * 5)
        for r in range(self.padded):
            self.state_buf.unsafe_store(r, neg_inf[DType.float32]())  # running max
            self.state_buf.unsafe_store(2 * self.padded + r, 1)  # correction

    def row_max(self) -> FPtr:
        return self.state_buf

    def row_sum(self) -> FPtr:
        return self.state_buf.unsafe_offset(self.padded)

    def correction(self) -> FPtr:
        return self.state_buf.unsafe_offset(2 * self.padded)

    def slope(self) -> FPtr:
        return self.state_buf.unsafe_offset(3 * self.padded)


def softmax_update[
    dtype: DType, tile: Int
](mut rows: TaskRows, j0: Int, num_keys: Int, scale: Float32, shard: CacheShard):
    """Turns the tile's scores `[rows, tile]` into probabilities and updates each row's max, sum and correction.

    The row sum takes the float32 probabilities; P V gets them rounded to `dtype`.
    Key slots `j0 ..` of the shard sit at sequence positions `shard.position(j)` (ALiBi).
    """
    comptime ScoreVec = SIMD[DType.float32, tile]
    var lanes = SIMD[DType.int32, tile]()
    var key_pos = ScoreVec()
    comptime for i in range(tile):
        lanes[i] = Int32(i)
        key_pos[i] = Float32(shard.position(j0 + i))
    var scores = rows.scores_buf
    var row_max = rows.row_max()
    var row_sum = rows.row_sum()
    var correction = rows.correction()
    var slope = rows.slope()
    for r in range(rows.padded):
        var p_row = scores.unsafe_offset(r * tile)
        correction.unsafe_store(r, 1)
        if r >= rows.num_rows:
            p_row.unsafe_store(0, ScoreVec(0))
            continue
        var lo = rows.meta.unsafe_load(5 * r) - j0
        var hi = min(rows.meta.unsafe_load(5 * r + 1), j0 + num_keys) - j0
        if lo >= hi:
            p_row.unsafe_store(0, ScoreVec(0))
            continue
        var position = Float32(rows.meta.unsafe_load(5 * r + 2))
        var s = p_row.unsafe_load[width=tile](0) * scale - slope.unsafe_load(r) * (position - key_pos)
        var valid = lanes.ge(Int32(lo)) & lanes.lt(Int32(hi))
        s = valid.select(s, ScoreVec(neg_inf[DType.float32]()))
        var old_max = row_max.unsafe_load(r)
        var new_max = max(old_max, s.reduce_max())
        var corr = exp(old_max - new_max)
        var p = exp(s - new_max)
        row_sum.unsafe_store(r, row_sum.unsafe_load(r) * corr + p.reduce_add())
        row_max.unsafe_store(r, new_max)
        correction.unsafe_store(r, corr)
        p_row.unsafe_store(0, p.cast[dtype]().cast[DType.float32]())
