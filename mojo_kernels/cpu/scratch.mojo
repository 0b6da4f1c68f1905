"""Scratch memory of the CPU stages, kept across op calls: once the pool has grown, the op's own buffers
need no allocation (the task runner, `sync_parallelize`, still allocates its task frames).

A process-wide pool (`_get_global`) of `SCRATCH_SLOTS` slots. A task (or a
stage's call) takes the first free slot (`Scratch()`, by compare-and-swap: the
slots in use, and so the memory kept, follow the tasks in flight), carves its buffers from the slot's segments in order
(`Scratch.take`: 64-byte aligned, zero-filled unless asked otherwise) and
gives the slot back when the `Scratch` ends; the segments stay with the slot.
A call of the same sizes carves the same buffers from the same segments, so
it allocates nothing. A segment too small for a buffer is passed over for the
next one (one nothing has been carved from yet is regrown instead), a missing
one is allocated (at least `SCRATCH_MIN_SEGMENT` bytes);
with every slot busy or every segment passed over, the buffer is allocated
for this `Scratch` alone and freed with it: correct, only slower.
"""

from std.atomic import Atomic
from std.ffi import _get_global
from std.memory import Allocation, Layout, alloc, dealloc
from std.sys import size_of

from ..common import DPtr, IPtr

comptime SCRATCH_SLOTS = 256
"""Slots of the pool: tasks holding scratch at once (cores x the calls in flight, with room)."""
comptime SCRATCH_SEGMENTS = 16
"""Segments a slot keeps."""
comptime SCRATCH_MIN_SEGMENT = 1 << 16
"""Bytes of a new segment, at least."""
comptime SCRATCH_ALIGN = 64

comptime _Raw = Pointer[NoneType, MutUntrackedOrigin]
comptime _Busy = Pointer[Atomic[Int64], MutUntrackedOrigin]
comptime _Bytes = DPtr[DType.uint8]


def _allocate(bytes: Int) -> _Bytes:
    """`bytes` bytes, `SCRATCH_ALIGN`-aligned (the pointer `_release` frees is stored before them)."""
    var raw = alloc(Layout[UInt8](count=bytes + 2 * SCRATCH_ALIGN)).unsafe_leak()
    var at = (Int(raw) + 2 * SCRATCH_ALIGN - 1) // SCRATCH_ALIGN * SCRATCH_ALIGN
    var header = IPtr(unsafe_from_address=at - SCRATCH_ALIGN)
    header.unsafe_store(0, Int(raw))
    header.unsafe_store(1, bytes)
    return _Bytes(unsafe_from_address=at)


def _release(at: _Bytes):
    """Frees what `_allocate` returned."""
    var header = IPtr(unsafe_from_address=Int(at) - SCRATCH_ALIGN)
    var raw = _Bytes(unsafe_from_address=header.unsafe_load(0))
    dealloc(Allocation[UInt8](unsafe_owned_ptr=raw, layout=Layout[UInt8](count=header.unsafe_load(1) + 2 * SCRATCH_ALIGN)))


@fieldwise_init
struct _Pool(TrivialRegisterPassable):
    """The pool's arrays: a busy flag per slot, each slot's segment addresses (0: none) and sizes."""

    var busy: _Busy  # [SCRATCH_SLOTS]
    var base: IPtr  # [SCRATCH_SLOTS, SCRATCH_SEGMENTS]
    var size: IPtr  # [SCRATCH_SLOTS, SCRATCH_SEGMENTS]


def _init_pool() -> Optional[_Raw]:
    var pool = _allocate(size_of[_Pool]()).unsafe_bitcast[_Pool]()
    var busy = _allocate(SCRATCH_SLOTS * size_of[Atomic[Int64]]()).unsafe_bitcast[Atomic[Int64]]()
    var base = _allocate(SCRATCH_SLOTS * SCRATCH_SEGMENTS * size_of[Int]()).unsafe_bitcast[Int]()
    var size = _allocate(SCRATCH_SLOTS * SCRATCH_SEGMENTS * size_of[Int]()).unsafe_bitcast[Int]()
    for i in range(SCRATCH_SLOTS):
        busy.unsafe_offset(i)[] = Atomic[Int64](0)
    for i in range(SCRATCH_SLOTS * SCRATCH_SEGMENTS):
        base.unsafe_store(i, 0)
        size.unsafe_store(i, 0)
    pool[] = _Pool(busy, base, size)
    return Optional[_Raw](pool.unsafe_bitcast[NoneType]())


def _destroy_pool(pool: Optional[_Raw]):
    """At process exit: the pool stays (the OS reclaims it; a task may still hold a slot)."""
    pass


def _pool() -> _Pool:
    return _get_global["pymla_cpu_scratch", _init_pool, _destroy_pool]().value().unsafe_bitcast[_Pool]()[]


struct Scratch(Movable):
    """One task's scratch: a slot of the pool (module docstring), or `slot` -1 with every slot busy.

    Its buffers are valid while it lives, and a value ends at its last use: a task ends its
    `Scratch` explicitly after its last use of the buffers (`_ = mem^`), or a struct that holds it
    (`TaskPlan`) keeps it."""

    var pool: _Pool  # looked up once (`_get_global`), not per buffer
    var slot: Int
    var segment: Int  # the segment being carved
    var used: Int  # bytes carved from it
    var private: List[Int]  # addresses of buffers allocated for this scratch alone

    def __init__(out self):
        var pool = _pool()
        self.pool = pool
        self.slot = -1
        self.segment = 0
        self.used = 0
        self.private = List[Int]()
        for s in range(SCRATCH_SLOTS):
            var expected = Int64(0)
            # A plain read first: a busy slot costs no locked operation (the flags share cache lines).
            if pool.busy.unsafe_offset(s)[].load() == 0 and pool.busy.unsafe_offset(s)[].compare_exchange(expected, 1):
                self.slot = s
                return

    def __deinit__(deinit self):
        for address in self.private:
            _release(_Bytes(unsafe_from_address=address))
        if self.slot >= 0:
            self.pool.busy.unsafe_offset(self.slot)[].store(0)

    def take[dtype: DType](mut self, count: Int, zero: Bool = True) -> DPtr[dtype]:
        """`count` values of `dtype` (at least one), 64-byte aligned, zero-filled unless `zero` is False."""
        var bytes = (max(count, 1) * size_of[dtype]() + SCRATCH_ALIGN - 1) // SCRATCH_ALIGN * SCRATCH_ALIGN
        var at = self._carve(bytes)
        if zero:
            for i in range(0, bytes, SCRATCH_ALIGN):
                at.unsafe_store[width=SCRATCH_ALIGN, alignment=SCRATCH_ALIGN](i, SIMD[DType.uint8, SCRATCH_ALIGN](0))
        return at.unsafe_bitcast[Scalar[dtype]]()

    def take_ints(mut self, count: Int) -> IPtr:
        """`count` zeroed Ints."""
        return self.take[DType.int64](count).unsafe_bitcast[Int]()

    def _carve(mut self, bytes: Int) -> _Bytes:
        if self.slot >= 0:
            var pool = self.pool
            while self.segment < SCRATCH_SEGMENTS:
                var i = self.slot * SCRATCH_SEGMENTS + self.segment
                var base = pool.base.unsafe_load(i)
                var size = pool.size.unsafe_load(i)
                if base == 0 or (self.used == 0 and size < bytes):
                    # A new segment, or an empty one regrown (nothing of this scratch points into it).
                    if base != 0:
                        _release(_Bytes(unsafe_from_address=base))
                    size = max(bytes, 2 * size, SCRATCH_MIN_SEGMENT)
                    base = Int(_allocate(size))
                    pool.base.unsafe_store(i, base)
                    pool.size.unsafe_store(i, size)
                if size - self.used >= bytes:
                    var at = _Bytes(unsafe_from_address=base + self.used)
                    self.used += bytes
                    return at
                self.segment += 1
                self.used = 0
        var at = _allocate(bytes)
        self.private.append(Int(at))
        return at
