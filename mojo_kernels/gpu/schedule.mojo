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
  tasks [grid, 4]   per attention block: request (-1: none), row slot within the request, partition, partitions
  rows  [T H, 2]    per (token, head) row: its partial row in partition 0, partitions
Block row `r` of task `i` writes partial row `i rows_per_block + r`, so partition
`q` of a row is partial row `first + q rows_per_block` (`partial_row`).
"""

from std.memory import stack_allocation

from max.gpu import barrier, thread_idx
from max.gpu.memory import AddressSpace

from ..common import ceil_div
from ..paged_cache import partitions_by_work
from .params import DeviceBatch, GlobalPtr, KernelParams, to_global

comptime SCHEDULE_THREADS = 256
comptime MAX_PARTITIONS = 64  # key partitions per request, at most (the merge weighs two per lane of a warp)
comptime TASK_WIDTH = 4  # int32 per task: request, slot, partition, partitions
comptime ROW_WIDTH = 2  # int32 per row: first partial row, partitions


def schedule_grid(slots: Int, target: Int, forced_partitions: Int) -> Int:
    """Attention blocks of a split launch: `slots` bounds the batch's row slots (`attention_slots`),
    `target` the blocks aimed at; `forced_partitions` > 0: that many per request."""
    if forced_partitions > 0:
        return slots * forced_partitions
    return target + slots


def schedule_ints(grid: Int, total_rows: Int) -> Int:
    """Size in int32 of the tables of a `grid`-block schedule over `total_rows` rows."""
    return TASK_WIDTH * grid + ROW_WIDTH * total_rows


@fieldwise_init
struct SplitSchedule(TrivialRegisterPassable):
    """The tables of one launch's schedule (module docstring); `grid` 0: no split, one partition per
    request written normalized, no merge (the tables are not read)."""

    var tasks: GlobalPtr[Int32]
    var rows: GlobalPtr[Int32]
    var grid: Int32
    var rows_per_block: Int32

    @staticmethod
    def over(tables: GlobalPtr[Int32], grid: Int, rows_per_block: Int) -> Self:
        """The schedule in `tables` (`schedule_ints(grid, T H)` int32) for a grid of `grid` blocks."""
        return Self(tables, tables.unsafe_offset(TASK_WIDTH * grid), Int32(grid), Int32(rows_per_block))

    @always_inline
    def active(self) -> Bool:
        return self.grid > 0

    @always_inline
    def task(self, i: Int) -> SIMD[DType.int32, TASK_WIDTH]:
        """Task `i`: request (-1: none), row slot, partition, partitions."""
        return self.tasks.unsafe_offset(TASK_WIDTH * i).unsafe_load[width=TASK_WIDTH, alignment=16](0)

    @always_inline
    def row(self, row: Int) -> SIMD[DType.int32, ROW_WIDTH]:
        """Row `row` (`t H + h`): its partial row in partition 0, partitions."""
        return self.rows.unsafe_offset(ROW_WIDTH * row).unsafe_load[width=ROW_WIDTH, alignment=8](0)

    @always_inline
    def partial_row(self, first: Int, q: Int) -> Int:
        """Partial row of partition `q` of a row whose partition 0 is at `first`."""
        return first + q * Int(self.rows_per_block)


@fieldwise_init
struct ScheduleParams(KernelParams):
    """Parameters of `schedule_kernel`."""

    var batch: DeviceBatch
    var schedule: SplitSchedule
    var num_heads: Int32
    var target: Int32  # attention blocks aimed at (one wave)
    var forced_partitions: Int32  # > 0: every request that many

    @staticmethod
    def nothing(batch: DeviceBatch) -> Self:
        """No schedule to build (no split; its pointers are never read)."""
        var placeholder = to_global(batch.offsets).unsafe_bitcast[Int32]()
        return Self(batch, SplitSchedule.over(placeholder, 0, 0), 0, 0, 0)

    @always_inline
    def active(self) -> Bool:
        """Whether there is a schedule to build (a split)."""
        return self.schedule.active()


@always_inline
def request_slots(batch: DeviceBatch, b: Int, heads: Int, rows_per_block: Int) -> Int:
    """Row slots (attention blocks per partition) of request `b`: its rows in blocks of `rows_per_block`."""
    var offsets = to_global(batch.offsets)
    return ceil_div(Int(offsets.unsafe_load(b + 1) - offsets.unsafe_load(b)) * heads, rows_per_block)


@always_inline
def request_keys(batch: DeviceBatch, b: Int) -> Int:
    """Keys (cache slots of this shard) request `b`'s rows may see: cached and new positions."""
    var offsets = to_global(batch.offsets)
    var visible = Int(to_global(batch.cache_lengths).unsafe_load(b)) + Int(
        offsets.unsafe_load(b + 1) - offsets.unsafe_load(b)
    )
    return batch.shard().local_count(visible)


comptime SPtr[T: AnyType] = Pointer[T, MutUntrackedOrigin, address_space=AddressSpace.SHARED]


def schedule_kernel(p: ScheduleParams):
    """One block of SCHEDULE_THREADS threads: `build_schedule` (bf16 / f16 ops fold it into the q step's launch)."""
    build_schedule[SCHEDULE_THREADS](p, stack_allocation[SCHEDULE_THREADS, Int64, address_space=AddressSpace.SHARED]())


@always_inline
def build_schedule[threads: Int](p: ScheduleParams, sums: SPtr[Int64]):
    """One block of `threads` threads (`sums`: `threads` int64 of shared memory): the tables of
    `p.schedule` for the batch `p.batch`.

    A thread per request: the batch's work (sum of slots x keys, a block sum),
    then in chunks of `threads` requests each one's partitions and tasks,
    their first task by a block scan, and the request's task and row entries;
    last the unused tasks (request -1).
    """
    var tid = thread_idx.x
    var nreq = Int(p.batch.num_requests)
    var heads = Int(p.num_heads)
    var sched = p.schedule
    var rpb = Int(sched.rows_per_block)
    var grid = Int(sched.grid)

    var work = 0
    for b in range(tid, nreq, threads):
        work += request_slots(p.batch, b, heads, rpb) * request_keys(p.batch, b)
    var total_work = Int(block_scan[threads](sums, Int64(work))[1])

    var offsets = to_global(p.batch.offsets)
    var first = 0  # first task of this chunk
    for c0 in range(0, nreq, threads):
        var b = c0 + tid
        var slots = 0
        var parts = 0
        if b < nreq:
            slots = request_slots(p.batch, b, heads, rpb)
            var keys = request_keys(p.batch, b)
            if p.forced_partitions > 0:
                parts = Int(p.forced_partitions)
            else:
                parts = min(partitions_by_work(keys, slots * keys, total_work, Int(p.target), slots, round_up=False), MAX_PARTITIONS)
        var scan = block_scan[threads](sums, Int64(slots * parts))
        var start = first + Int(scan[0])
        if slots > 0:
            for s in range(slots):
                for q in range(parts):
                    sched.tasks.unsafe_offset(TASK_WIDTH * (start + s * parts + q)).unsafe_store[alignment=16](
                        0, SIMD[DType.int32, TASK_WIDTH](Int32(b), Int32(s), Int32(q), Int32(parts))
                    )
            var row0 = Int(offsets.unsafe_load(b)) * heads
            var row_end = Int(offsets.unsafe_load(b + 1)) * heads
            for i in range(row_end - row0):
                var slot = i // rpb
                sched.rows.unsafe_offset(ROW_WIDTH * (row0 + i)).unsafe_store[alignment=8](
                    0, SIMD[DType.int32, ROW_WIDTH](Int32((start + slot * parts) * rpb + i - slot * rpb), Int32(parts))
                )
        first += Int(scan[1])
    for t in range(first + tid, grid, threads):
        sched.tasks.unsafe_offset(TASK_WIDTH * t).unsafe_store[alignment=16](0, SIMD[DType.int32, TASK_WIDTH](-1, 0, 0, 0))


@always_inline
def block_scan[threads: Int](sums: SPtr[Int64], value: Int64) -> Tuple[Int64, Int64]:
    """This thread's exclusive prefix sum of `value` over the block's `threads` threads, and the total."""
    var tid = thread_idx.x
    barrier()  # `sums` may still be read by an earlier scan
    sums.unsafe_store(tid, value)
    barrier()
    var step = 1
    while step < threads:
        var add = sums.unsafe_load(tid - step) if tid >= step else Int64(0)
        barrier()
        sums.unsafe_store(tid, sums.unsafe_load(tid) + add)
        barrier()
        step *= 2
    return (sums.unsafe_load(tid) - value, sums.unsafe_load(threads - 1))
