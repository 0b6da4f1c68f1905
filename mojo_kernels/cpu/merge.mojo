"""Step 5's task plan and its end: the partial results and the partition merge.

`TaskPlan` splits step 5 into (request, head group, key partition) tasks,
a request's number of key partitions in proportion to its work, so that a
long request beside short ones is spread over every core. Each task of
`cpu/attention.mojo` leaves its rows' unnormalized output, running max and
sum in `PartialResults`, at the rows of its partition's slot;
`merge_partitions` combines a row's partitions with their log-sum-exp into the
attention output (rounded to dtype) and, when asked, the row's LSE (the op's
optional `lse`).
"""

from std.math import exp, log
from std.utils.numerics import neg_inf

from ..common import DPtr, FPtr, IPtr, ceil_div
from ..paged_cache import RaggedBatch
from .scratch import Scratch
from .simd import F32_WIDTH, run_tasks

comptime MERGE_ROWS_PER_TASK = 16
"""(token, head) rows per merge task: a task per row made 128 tasks of a few thousand FMAs each at
128 heads, batch 1."""

# Per request in `TaskPlan.requests`, `REQUEST_FIELDS` ints at these offsets.
comptime PARTITIONS = 0
comptime TOKENS = 1  # new tokens
comptime FIRST_TOKEN = 2
comptime FIRST_SLOT = 3
comptime FIRST_TASK = 4
comptime REQUEST_FIELDS = 5


@fieldwise_init
struct AttentionShape(TrivialRegisterPassable):
    """Step 5's sizes and its task plan (a view of a `TaskPlan`, which owns the tables).

    Request `b` splits its keys into `partitions(b)` partitions
    (`paged_cache.partition_keys`), each a task per head group; partition `p`
    of `b` owns `tokens(b)` slots of partial results from `first_slot(b) + p
    tokens(b)` on, one per new token, each `num_heads` rows.
    """

    var num_tokens: Int
    var num_heads: Int
    var kv_lora_rank: Int
    var key_dim: Int
    var heads_per_group: Int
    var num_requests: Int
    var num_tasks: Int
    var num_slots: Int
    var max_partitions: Int
    var requests: IPtr  # [num_requests, REQUEST_FIELDS]
    var request_of_token: IPtr  # [num_tokens]

    @always_inline
    def field(self, b: Int, f: Int) -> Int:
        return self.requests.unsafe_load(b * REQUEST_FIELDS + f)

    @always_inline
    def partitions(self, b: Int) -> Int:
        return self.field(b, PARTITIONS)

    @always_inline
    def tokens(self, b: Int) -> Int:
        return self.field(b, TOKENS)

    def task(self, i: Int) -> Tuple[Int, Int, Int]:
        """Task `i` as (request, head group, partition): the request by bisection of the first tasks."""
        var lo = 0
        var hi = self.num_requests  # first task of lo <= i < first task of hi (num_tasks past the last)
        while hi - lo > 1:
            var mid = (lo + hi) // 2
            if self.field(mid, FIRST_TASK) <= i:
                lo = mid
            else:
                hi = mid
        var local = i - self.field(lo, FIRST_TASK)
        var parts = self.partitions(lo)
        return (lo, local // parts, local % parts)

    @always_inline
    def row(self, b: Int, part: Int, t: Int, h: Int) -> Int:
        """Partial-result row of new token `t` (the op's token index), head `h`, partition `part` of request `b`."""
        var slot = self.field(b, FIRST_SLOT) + part * self.tokens(b) + t - self.field(b, FIRST_TOKEN)
        return slot * self.num_heads + h


struct TaskPlan(Movable):
    """The tables behind an `AttentionShape` (`shape()`, valid while this plan lives), in the plan's `Scratch`."""

    var mem: Scratch
    var requests: IPtr
    var request_of_token: IPtr
    var dims: AttentionShape

    def __init__(
        out self, var mem: Scratch, partitions: IPtr, batch: RaggedBatch, num_tokens: Int, num_heads: Int,
        kv_lora_rank: Int, key_dim: Int, heads_per_group: Int,
    ):
        """`partitions[b]` key partitions for request `b` of `batch`; a request without new tokens must have
        none. The tables are carved from `mem`, which the plan keeps."""
        var head_groups = ceil_div(num_heads, heads_per_group)
        self.requests = mem.take_ints(batch.num_requests * REQUEST_FIELDS)
        self.request_of_token = mem.take_ints(num_tokens)
        self.mem = mem^
        var slot = 0
        var task = 0
        var widest = 1
        for b in range(batch.num_requests):
            var at = b * REQUEST_FIELDS
            var parts = partitions.unsafe_load(b)
            self.requests.unsafe_store(at + PARTITIONS, parts)
            self.requests.unsafe_store(at + TOKENS, batch.num_tokens(b))
            self.requests.unsafe_store(at + FIRST_TOKEN, batch.start(b))
            self.requests.unsafe_store(at + FIRST_SLOT, slot)
            self.requests.unsafe_store(at + FIRST_TASK, task)
            for t in range(batch.start(b), batch.stop(b)):
                self.request_of_token.unsafe_store(t, b)
            slot += parts * batch.num_tokens(b)
            task += parts * head_groups
            widest = max(widest, parts)
        self.dims = AttentionShape(
            num_tokens, num_heads, kv_lora_rank, key_dim, heads_per_group, batch.num_requests, task, slot, widest,
            self.requests,
            self.request_of_token,
        )

    def shape(self) -> AttentionShape:
        """The view (the tables stay where they are when the plan moves)."""
        return self.dims


@fieldwise_init
struct PartialResults(TrivialRegisterPassable):
    """Per slot and head (`AttentionShape.row`): unnormalized output, running max and sum."""

    var out: FPtr  # [slots, H, kv_lora_rank]
    var row_max: FPtr  # [slots, H]
    var row_sum: FPtr  # [slots, H]

    @staticmethod
    def take(mut mem: Scratch, shape: AttentionShape) -> Self:
        """The partial results of `shape`'s tasks, from `mem` (not filled: every task writes its rows)."""
        var rows = shape.num_slots * shape.num_heads
        return Self(
            mem.take[DType.float32](rows * shape.kv_lora_rank, zero=False), mem.take[DType.float32](rows, zero=False),
            mem.take[DType.float32](rows, zero=False),
        )


def merge_row[
    dtype: DType
](
    partials: PartialResults, shape: AttentionShape, row: Int, raw: DPtr[dtype], lse: FPtr, has_lse: Bool,
    slots: IPtr, weights: FPtr,
):
    """Row `row = t H + h` of `merge_partitions`; `slots`, `weights` scratch of `shape.max_partitions`."""
    comptime W = F32_WIDTH
    var rank = shape.kv_lora_rank
    var t = row // shape.num_heads
    var b = shape.request_of_token.unsafe_load(t)
    var parts = shape.partitions(b)
    for p in range(parts):
        slots.unsafe_store(p, shape.row(b, p, t, row % shape.num_heads))
    var top = neg_inf[DType.float32]()
    for p in range(parts):
        top = max(top, partials.row_max.unsafe_load(slots.unsafe_load(p)))
    var total = Float32(0)
    for p in range(parts):
        var m = partials.row_max.unsafe_load(slots.unsafe_load(p))
        if m > neg_inf[DType.float32]():
            total += exp(m - top) * partials.row_sum.unsafe_load(slots.unsafe_load(p))
    for p in range(parts):
        var m = partials.row_max.unsafe_load(slots.unsafe_load(p))
        # Zero where this partition held none of the row's keys.
        weights.unsafe_store(p, exp(m - top) / total if m > neg_inf[DType.float32]() else Float32(0))
    if has_lse:
        lse.unsafe_store(row, top + log(total) if total > 0 else neg_inf[DType.float32]())
    var dst = raw.unsafe_offset(row * rank)
    var c = 0
    while c + W <= rank:
        weighted_columns[W](partials, rank, parts, slots, weights, c, dst)
        c += W
    while c < rank:
        weighted_columns[1](partials, rank, parts, slots, weights, c, dst)
        c += 1


@always_inline
def weighted_columns[
    dtype: DType, //, w: Int
](partials: PartialResults, rank: Int, parts: Int, slots: IPtr, weights: FPtr, c: Int, dst: DPtr[dtype]):
    """`dst[c ..< c + w] = sum_p weights[p] out[slots[p], c ..]` over the partitions with a nonzero weight."""
    var acc = SIMD[DType.float32, w](0)
    for p in range(parts):
        var weight = weights.unsafe_load(p)
        if weight != 0:
            acc += weight * partials.out.unsafe_load[width=w](slots.unsafe_load(p) * rank + c)
    dst.unsafe_store(c, acc.cast[dtype]())


def merge_rows[
    dtype: DType
](
    partials: PartialResults, shape: AttentionShape, first: Int, count: Int, stride: Int, raw: DPtr[dtype],
    lse: FPtr, has_lse: Bool,
):
    """Rows `first, first + stride, ..` (`count` of them) of `merge_partitions`, with this task's scratch."""
    var mem = Scratch()
    var slots = mem.take_ints(shape.max_partitions)
    var weights = mem.take[DType.float32](shape.max_partitions)
    for i in range(count):
        merge_row[dtype](partials, shape, first + i * stride, raw, lse, has_lse, slots, weights)
    _ = mem^  # the slot stays this task's until here (a value ends at its last use)


def merge_head[
    dtype: DType
](partials: PartialResults, shape: AttentionShape, h: Int, raw: DPtr[dtype], lse: FPtr, has_lse: Bool):
    """Head `h`'s rows of `merge_partitions` (every token's): the prologue of step 6's task for head `h`."""
    merge_rows[dtype](partials, shape, h, shape.num_tokens, shape.num_heads, raw, lse, has_lse)


def merge_partitions[
    dtype: DType
](partials: PartialResults, shape: AttentionShape, raw: DPtr[dtype], lse: FPtr, has_lse: Bool) raises:
    """`raw[t, h] = rnd(sum_p exp(m_p - M) o_p / sum_p exp(m_p - M) l_p)` with `M = max_p m_p`.

    With `has_lse`, `lse[t, h] = M + log(sum_p exp(m_p - M) l_p)`: the natural
    log-sum-exp of the row's scaled, biased scores (`m_p`, `l_p` are a
    partition's running max and sum of `exp(s - m_p)`). A row that saw no key
    (a shard holding none of its key range) gets `raw = 0` and `lse = -inf`.
    Its own stage where step 6 does not follow (a context-parallel rank); else
    step 6's task for head `h` merges that head's rows first (`merge_head`).
    """
    var rows = shape.num_tokens * shape.num_heads

    def rows_task(task: Int) {var partials, var shape, var raw, var rows, var lse, var has_lse}:
        var first = task * MERGE_ROWS_PER_TASK
        merge_rows[dtype](partials, shape, first, min(MERGE_ROWS_PER_TASK, rows - first), 1, raw, lse, has_lse)

    run_tasks(rows_task, ceil_div(rows, MERGE_ROWS_PER_TASK), shape.num_slots * shape.num_heads * shape.kv_lora_rank)
