"""Step 5's end: the shape of the attention tasks, their partial results, and the partition merge.

Each (request, head group, key partition) task of `cpu/attention.mojo` leaves
its rows' unnormalized output, running max and sum in `PartialResults`;
`merge_partitions` combines a row's partitions with their log-sum-exp into the
attention output (rounded to dtype) and, when asked, the row's LSE (the op's
optional `lse`).
"""

from std.math import exp, log
from std.utils.numerics import neg_inf

from ..common import DPtr, FPtr, ceil_div
from .simd import F32_WIDTH, run_tasks

comptime MERGE_ROWS_PER_TASK = 16
"""(token, head) rows per merge task: a task per row made 128 tasks of a few thousand FMAs each at
128 heads, batch 1."""

@fieldwise_init
struct AttentionShape(TrivialRegisterPassable):
    var num_tokens: Int
    var num_heads: Int
    var kv_lora_rank: Int
    var key_dim: Int
    var heads_per_group: Int
    var num_partitions: Int


@fieldwise_init
struct PartialResults(TrivialRegisterPassable):
    """Per partition, row `(t, h)`: unnormalized output, running max and sum."""

    var out: FPtr  # [P, T, H, kv_lora_rank]
    var row_max: FPtr  # [P, T, H]
    var row_sum: FPtr  # [P, T, H]


def merge_partitions[
    dtype: DType
](partials: PartialResults, shape: AttentionShape, raw: DPtr[dtype], lse: FPtr, has_lse: Bool) raises:
    """`raw[t, h] = rnd(sum_p exp(m_p - M) o_p / sum_p exp(m_p - M) l_p)` with `M = max_p m_p`.

    With `has_lse`, `lse[t, h] = M + log(sum_p exp(m_p - M) l_p)`: the natural
    log-sum-exp of the row's scaled, biased scores (`m_p`, `l_p` are a
    partition's running max and sum of `exp(s - m_p)`). A row that saw no key
    (a shard holding none of its key range) gets `raw = 0` and `lse = -inf`.
    """
    var rows = shape.num_tokens * shape.num_heads

    def rows_task(task: Int) {var partials, var shape, var raw, var rows, var lse, var has_lse}:
        comptime W = F32_WIDTH
        var rank = shape.kv_lora_rank
        var weights = List[Float32](length=shape.num_partitions, fill=0)
        for row in range(task * MERGE_ROWS_PER_TASK, min((task + 1) * MERGE_ROWS_PER_TASK, rows)):
            var top = neg_inf[DType.float32]()
            for p in range(shape.num_partitions):
                top = max(top, partials.row_max.unsafe_load(p * rows + row))
            var total = Float32(0)
            for p in range(shape.num_partitions):
                var m = partials.row_max.unsafe_load(p * rows + row)
                if m > neg_inf[DType.float32]():
                    total += exp(m - top) * partials.row_sum.unsafe_load(p * rows + row)
            for p in range(shape.num_partitions):
                var m = partials.row_max.unsafe_load(p * rows + row)
                # Zero where this partition held none of the row's keys.
                weights[p] = exp(m - top) / total if m > neg_inf[DType.float32]() else Float32(0)
            if has_lse:
                lse.unsafe_store(row, top + log(total) if total > 0 else neg_inf[DType.float32]())
            var dst = raw.unsafe_offset(row * rank)
            var c = 0
            while c < rank:
                var width = W if c + W <= rank else 1
                if width == W:
                    var acc = SIMD[DType.float32, W](0)
                    for p in range(shape.num_partitions):
                        if weights[p] != 0:
                            acc += weights[p] * partials.out.unsafe_load[width=W]((p * rows + row) * rank + c)
                    dst.unsafe_store(c, acc.cast[dtype]())
                else:
                    var acc = Float32(0)
                    for p in range(shape.num_partitions):
                        if weights[p] != 0:
                            acc += weights[p] * partials.out.unsafe_load((p * rows + row) * rank + c)
                    dst.unsafe_store(c, acc.cast[dtype]())
                c += width

    run_tasks(rows_task, ceil_div(rows, MERGE_ROWS_PER_TASK), rows * shape.kv_lora_rank * shape.num_partitions)
