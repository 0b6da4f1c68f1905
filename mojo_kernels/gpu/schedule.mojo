"""Step 5's split-KV schedule on the GPU: which request, row slot and key partition each attention block takes.

`build_schedule` (one block) builds it on the device from the batch alone
(new tokens per request, cache lengths, the cache shard): as a block of the q
step's launch (`q_step_kernel`, bf16 / f16 with `GpuPlan.schedule_in_q_step`)
or as its own launch before it (`schedule_kernel`); the attention kernels
(`AttentionBlock.locate`, after their wait for the q step) and the partition
merge only read it. Each request's keys split by its share of the batch's work
(`paged_cache.partitions_by_work`, the CPU plan's rule too): a row slot of a
request costs its keys, so partitions go where the keys are, and one long
request beside short ones spreads over the SMs instead of keeping one block per
row slot busy for its whole length. `GpuPlan.num_partitions` > 1 (tests)
gives every request that many instead.

The attention grid is a bound the host knows from the sizes alone
(`schedule_grid`): `target + slots` blocks hold every request's
`slots_b max(1, floor(keys_b target / sum_b slots_b keys_b))` tasks, and a
block past the last task finds request -1 and exits. The grid never depends on
the lengths, so a CUDA graph captured from one call stays right when they change.

Tables (int32, in one workspace):
  tasks  [grid, 4]  per attention block: request (-1: none), row slot within the request, partition, partitions
  tokens [T, 4]     per new token: its request's first task, partitions, first row (`offsets[b] H`), 0
Block row `r` of task `i` writes partial row `i rows_per_block + r`, so partition
`q` of row `row` is partial row `first + q rows_per_block` (`row_partials`, for the merge).
The builder's loads are one per request, its scans warp shuffles, and its
table entries spread over all of its threads (the first version, a thread per
request writing every row's entry with 64-bit divisions, took 21 us on an H100).
"""

from std.memory import stack_allocation

from max.gpu import WARP_SIZE, barrier, thread_idx
from max.gpu.memory import AddressSpace
from max.gpu.primitives import warp

from ..common import ceil_div
from ..paged_cache import partitions_by_work
from .params import DeviceBatch, GlobalPtr, KernelParams, to_global

comptime SCHEDULE_THREADS = 256
comptime MAX_PARTITIONS = 64  # key partitions per request, at most (the merge weighs two per lane of a warp)
comptime TASK_WIDTH = 4  # int32 per task: request, slot, partition, partitions
comptime TOKEN_WIDTH = 4  # int32 per token: its request's first task, partitions, first row, 0
comptime SPtr[T: AnyType] = Pointer[T, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


def schedule_grid(slots: Int, target: Int, forced_partitions: Int) -> Int:
    """Attention blocks of a split launch: `slots` bounds the batch's row slots (`attention_slots`),
    `target` the blocks aimed at; `forced_partitions` > 0: that many per request."""
    if forced_partitions > 0:
        return slots * forced_partitions
    return target + slots


def schedule_ints(grid: Int, num_tokens: Int) -> Int:
    """Size in int32 of the tables of a `grid`-block schedule over `num_tokens` new tokens."""
    return TASK_WIDTH * grid + TOKEN_WIDTH * num_tokens


def schedule_smem_bytes(threads: Int) -> Int:
    """Shared memory `build_schedule` takes with `threads` threads."""
    return 8 * (threads // WARP_SIZE) + 4 * (3 * threads + 2 + threads // WARP_SIZE)


@fieldwise_init
struct SplitSchedule(TrivialRegisterPassable):
    """The tables of one launch's schedule (module docstring); `grid` 0: no split, one partition per
    request written normalized, no merge (the tables are not read)."""

    var tasks: GlobalPtr[Int32]
    var tokens: GlobalPtr[Int32]
    var grid: Int32
    var rows_per_block: Int32
    var num_heads: Int32

    @staticmethod
    def over(tables: GlobalPtr[Int32], grid: Int, rows_per_block: Int, num_heads: Int) -> Self:
        """The schedule in `tables` (`schedule_ints(grid, T)` int32) for a grid of `grid` blocks."""
        return Self(
            tables, tables.unsafe_offset(TASK_WIDTH * grid), Int32(grid), Int32(rows_per_block), Int32(num_heads)
        )

    @always_inline
    def active(self) -> Bool:
        return self.grid > 0

    @always_inline
    def task(self, i: Int) -> SIMD[DType.int32, TASK_WIDTH]:
        """Task `i`: request (-1: none), row slot, partition, partitions."""
        return self.tasks.unsafe_offset(TASK_WIDTH * i).unsafe_load[width=TASK_WIDTH, alignment=16](0)

    @always_inline
    def row_partials(self, row: Int) -> Tuple[Int, Int]:
        """Row `row` (`t H + h`): its partial row in partition 0, and its partitions (32-bit divisions)."""
        var t = Int32(row) // self.num_heads
        var e = self.tokens.unsafe_offset(TOKEN_WIDTH * Int(t)).unsafe_load[width=TOKEN_WIDTH, alignment=16](0)
        var i = Int32(row) - e[2]  # the row within its request
        var slot = i // self.rows_per_block
        return (Int((e[0] + slot * e[1]) * self.rows_per_block + i - slot * self.rows_per_block), Int(e[1]))

    @always_inline
    def partial_row(self, first: Int, q: Int) -> Int:
        """Partial row of partition `q` of a row whose partition 0 is at `first`."""
        return first + q * Int(self.rows_per_block)


@fieldwise_init
struct ScheduleParams(KernelParams):
    """Parameters of `schedule_kernel` (and of the q step's schedule block)."""

    var batch: DeviceBatch
    var schedule: SplitSchedule
    var target: Int32  # attention blocks aimed at (one wave)
    var forced_partitions: Int32  # > 0: every request that many

    @staticmethod
    def nothing(batch: DeviceBatch) -> Self:
        """No schedule to build (no split; its pointers are never read)."""
        var placeholder = to_global(batch.offsets).unsafe_bitcast[Int32]()
        return Self(batch, SplitSchedule.over(placeholder, 0, 0, 0), 0, 0)

    @always_inline
    def active(self) -> Bool:
        """Whether there is a schedule to build (a split)."""
        return self.schedule.active()


def schedule_kernel(p: ScheduleParams):
    """One block of SCHEDULE_THREADS threads: `build_schedule` (bf16 / f16 ops fold it into the q step's launch)."""
    comptime BYTES = schedule_smem_bytes(SCHEDULE_THREADS)
    build_schedule[SCHEDULE_THREADS](p, stack_allocation[(BYTES + 7) // 8, Int64, address_space=AddressSpace.SHARED]())


@always_inline
def build_schedule[threads: Int](p: ScheduleParams, smem: SPtr[Int64]):
    """One block of `threads` threads (`smem`: `schedule_smem_bytes(threads)` bytes): the tables of
    `p.schedule` for the batch `p.batch`.

    The batch's work (sum over requests of row slots x keys) by a block sum;
    then per chunk of `threads` requests, a thread per request: its partitions
    (`partitions_by_work`) and tasks (slots x partitions), their first task by a
    block scan, kept in shared memory with the requests' first tokens; then
    every thread writes task and token entries, each finding its request by
    bisection in shared memory; last the unused tasks (request -1).
    """
    comptime WARPS = threads // WARP_SIZE
    var warp_work = smem  # [WARPS] int64
    var ints = smem.unsafe_offset(WARPS).unsafe_bitcast[Int32]()
    var starts = ints  # [threads + 1]: each request's first task, relative to the chunk
    var nparts = ints.unsafe_offset(threads + 1)  # [threads]
    var firsts = ints.unsafe_offset(2 * threads + 1)  # [threads + 1]: each request's first token
    var warp_counts = ints.unsafe_offset(3 * threads + 2)  # [WARPS]
    var tid = thread_idx.x
    var nreq = Int(p.batch.num_requests)
    var sched = p.schedule
    var heads = Int(sched.num_heads)
    var rpb = Int(sched.rows_per_block)
    var offsets = to_global(p.batch.offsets)
    var lengths = to_global(p.batch.cache_lengths)
    var shard = p.batch.shard()

    var work = Int64(0)
    for b in range(tid, nreq, threads):
        var n = Int(offsets.unsafe_load(b + 1) - offsets.unsafe_load(b))
        var keys = shard.local_count(Int(lengths.unsafe_load(b)) + n)
        work += Int64(ceil_div(n * heads, rpb) * keys)
    var total_work = Int(block_sum[threads](warp_work, work))

    var first = 0  # first task of this chunk
    for c0 in range(0, nreq, threads):
        var b = c0 + tid
        var count = Int32(0)
        if b < nreq:
            var o0 = Int(offsets.unsafe_load(b))
            var n = Int(offsets.unsafe_load(b + 1)) - o0
            var slots = ceil_div(n * heads, rpb)
            var keys = shard.local_count(Int(lengths.unsafe_load(b)) + n)
            var parts = Int(p.forced_partitions)
            if parts <= 0:
                parts = min(partitions_by_work(keys, slots * keys, total_work, Int(p.target), slots, round_up=False), MAX_PARTITIONS)
            count = Int32(slots * parts)
            nparts.unsafe_store(tid, Int32(parts))
            firsts.unsafe_store(tid, Int32(o0))
        var scan = block_exclusive_scan[threads](warp_counts, count)
        var n_chunk = min(threads, nreq - c0)
        if b < nreq:
            starts.unsafe_store(tid, scan[0])
        if tid == 0:
            starts.unsafe_store(n_chunk, scan[1])
            firsts.unsafe_store(n_chunk, Int32(offsets.unsafe_load(c0 + n_chunk)))
        barrier()
        var chunk_tasks = Int(scan[1])
        for t in range(tid, chunk_tasks, threads):
            var j = last_at_most(starts, n_chunk, Int32(t))  # requests without tasks share the next one's start
            var local = Int32(t) - starts.unsafe_load(j)
            var parts = nparts.unsafe_load(j)
            var slot = local // parts
            sched.tasks.unsafe_offset(TASK_WIDTH * (first + t)).unsafe_store[alignment=16](
                0, SIMD[DType.int32, TASK_WIDTH](Int32(c0 + j), slot, local - slot * parts, parts)
            )
        var tok0 = Int(firsts.unsafe_load(0))
        for tok in range(tok0 + tid, Int(firsts.unsafe_load(n_chunk)), threads):
            var j = last_at_most(firsts, n_chunk, Int32(tok))  # requests without tokens share the next one's first
            sched.tokens.unsafe_offset(TOKEN_WIDTH * tok).unsafe_store[alignment=16](
                0,
                SIMD[DType.int32, TOKEN_WIDTH](
                    Int32(first) + starts.unsafe_load(j), nparts.unsafe_load(j), firsts.unsafe_load(j) * Int32(heads), 0
                ),
            )
        first += chunk_tasks
        barrier()  # before the next chunk rewrites the tables in shared memory
    for t in range(first + tid, Int(sched.grid), threads):
        sched.tasks.unsafe_offset(TASK_WIDTH * t).unsafe_store[alignment=16](0, SIMD[DType.int32, TASK_WIDTH](-1, 0, 0, 0))


@always_inline
def last_at_most(values: SPtr[Int32], n: Int, x: Int32) -> Int:
    """The last `j < n` with `values[j] <= x` (`values` non-decreasing, `values[0] <= x`)."""
    var lo = 0
    var hi = n
    while hi - lo > 1:
        var mid = (lo + hi) // 2
        if values.unsafe_load(mid) <= x:
            lo = mid
        else:
            hi = mid
    return lo


@always_inline
def block_sum[threads: Int](warp_sums: SPtr[Int64], value: Int64) -> Int64:
    """`value` summed over the block's `threads` threads (`warp_sums`: one int64 per warp, used once)."""
    var s = warp.sum(value)
    if thread_idx.x % WARP_SIZE == 0:
        warp_sums.unsafe_store(thread_idx.x // WARP_SIZE, s)
    barrier()
    var total = Int64(0)
    for w in range(threads // WARP_SIZE):
        total += warp_sums.unsafe_load(w)
    return total


@always_inline
def block_exclusive_scan[threads: Int](warp_totals: SPtr[Int32], value: Int32) -> Tuple[Int32, Int32]:
    """This thread's exclusive prefix sum of `value` over the block's `threads` threads, and the total
    (`warp_totals`: one int32 per warp; the caller's barrier separates two scans)."""
    var inclusive = warp.prefix_sum(value)
    var w = thread_idx.x // WARP_SIZE
    if thread_idx.x % WARP_SIZE == WARP_SIZE - 1:
        warp_totals.unsafe_store(w, inclusive)
    barrier()
    var before = Int32(0)
    var total = Int32(0)
    for i in range(threads // WARP_SIZE):
        var t = warp_totals.unsafe_load(i)
        if i < w:
            before += t
        total += t
    return (before + inclusive - value, total)
