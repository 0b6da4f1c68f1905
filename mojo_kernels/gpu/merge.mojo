"""The log-sum-exp merge of step 5's key partitions, and the store of the attention output in dtype."""

from std.math import exp, log
from std.memory import stack_allocation
from std.utils.numerics import neg_inf

from max.gpu import WARP_SIZE, barrier, block_idx, thread_idx
from max.gpu.memory import AddressSpace
from max.gpu.primitives import warp

from .addressing import ELEMENTWISE_THREADS
from .params import GFPtr, GPtr, KernelParams
from .pdl import allow_dependents, wait_for_producers


comptime MERGE_THREADS = 128
comptime MAX_PARTITIONS = 64  # key partitions per request, at most (two per lane of the first warp)
comptime MERGE_UNROLL = 4  # partitions whose rows are loaded before they are summed


@fieldwise_init
struct MergeParams[dtype: DType](KernelParams):
    """Parameters of `merge_kernel`: the partitions' outputs `part_out [P, rows, R]`, maxima and sums `[P, rows]`."""

    var part_out: GFPtr
    var part_max: GFPtr
    var part_sum: GFPtr
    var raw: GFPtr  # [rows, R]
    var total_rows: Int32
    var num_partitions: Int32
    var kv_lora_rank: Int32
    var lse: GFPtr  # [rows]: the log-sum-exp of each row, when has_lse
    var has_lse: Int32


@fieldwise_init
struct StoreParams[dtype: DType](KernelParams):
    """Parameters of `store_kernel`: `count` values of `src` to `dst` as dtype."""

    var src: GFPtr
    var dst: GPtr[Self.dtype]
    var count: Int64


def merge_kernel[dtype: DType](p: MergeParams[dtype]):
    """One block per row: `raw = rnd(sum_p exp(m_p - M) o_p / sum_p exp(m_p - M) l_p)`.

    The first warp turns the partitions' maxima and sums into weights
    (0 for a partition that saw no key; a row that sees no key is 0) and, with
    `has_lse`, the row's LSE `M + log(sum_p exp(m_p - M) l_p)` (-inf without
    keys); then each thread adds four columns
    of the partitions' outputs, `MERGE_UNROLL` partitions at a time; `kv_lora_rank % 4 == 0`.
    """
    var weights = stack_allocation[MAX_PARTITIONS, Float32, address_space=AddressSpace.SHARED]()
    var tid = thread_idx.x
    var row = block_idx.x
    var rows = Int(p.total_rows)
    var parts = Int(p.num_partitions)
    var rank = Int(p.kv_lora_rank)
    wait_for_producers()  # the partitions come from the attention kernel (pdl.mojo)
    allow_dependents()
    if tid < WARP_SIZE:
        var m0 = p.part_max.unsafe_load(tid * rows + row) if tid < parts else neg_inf[DType.float32]()
        var m1 = p.part_max.unsafe_load((tid + WARP_SIZE) * rows + row) if tid + WARP_SIZE < parts else neg_inf[DType.float32]()
        var top = warp.max(max(m0, m1))
        var e0 = exp(m0 - top) if m0 != neg_inf[DType.float32]() else Float32(0)
        var e1 = exp(m1 - top) if m1 != neg_inf[DType.float32]() else Float32(0)
        var l0 = p.part_sum.unsafe_load(tid * rows + row) if e0 != 0 else Float32(0)
        var l1 = p.part_sum.unsafe_load((tid + WARP_SIZE) * rows + row) if e1 != 0 else Float32(0)
        var total = warp.sum(e0 * l0 + e1 * l1)
        var inv = Float32(1) / total if total > 0 else Float32(0)  # no key at all: the row is 0
        weights.unsafe_store(tid, e0 * inv)
        weights.unsafe_store(tid + WARP_SIZE, e1 * inv)
        if tid == 0 and p.has_lse != 0:
            p.lse.unsafe_store(row, top + log(total) if total > 0 else neg_inf[DType.float32]())
    barrier()
    for c in range(4 * tid, rank, 4 * MERGE_THREADS):
        var acc = SIMD[DType.float32, 4](0)
        for p0 in range(0, parts, MERGE_UNROLL):
            var v = Array[SIMD[DType.float32, 4], MERGE_UNROLL](fill=0)
            comptime for u in range(MERGE_UNROLL):
                if p0 + u < parts and weights.unsafe_load(p0 + u) != 0:
                    v[u] = p.part_out.unsafe_offset(((p0 + u) * rows + row) * rank + c).unsafe_load[width=4, alignment=16](0)
            comptime for u in range(MERGE_UNROLL):
                if p0 + u < parts and weights.unsafe_load(p0 + u) != 0:
                    acc += weights.unsafe_load(p0 + u) * v[u]
        p.raw.unsafe_offset(row * rank + c).unsafe_store[alignment=16](0, acc.cast[dtype]().cast[DType.float32]())


@fieldwise_init
struct WidenParams[dtype: DType](KernelParams):
    """Parameters of `widen_kernel`: `count` dtype values of `src` to float32 `dst`."""

    var src: GPtr[Self.dtype]
    var dst: GFPtr
    var count: Int64


def widen_kernel[dtype: DType](p: WidenParams[dtype]):
    """`dst[i] = src[i]` as float32 (an attention output given to step 6 alone)."""
    var i = block_idx.x * ELEMENTWISE_THREADS + thread_idx.x
    if i < Int(p.count):
        p.dst.unsafe_store(i, p.src.unsafe_load(i).cast[DType.float32]())


def store_kernel[dtype: DType](p: StoreParams[dtype]):
    """`dst[i] = src[i]` as dtype (the attention output, whose values are already dtype values)."""
    var i = block_idx.x * ELEMENTWISE_THREADS + thread_idx.x
    if i < Int(p.count):
        p.dst.unsafe_store(i, p.src.unsafe_load(i).cast[dtype]())
