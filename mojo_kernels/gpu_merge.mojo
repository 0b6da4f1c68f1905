"""The log-sum-exp merge of step 5's key partitions, and the store of the attention output in dtype."""

from std.math import exp, sqrt
from std.memory import bitcast, stack_allocation
from std.sys import size_of
from std.utils.numerics import neg_inf

from max.gpu import WARP_SIZE, barrier, block_idx, thread_idx
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.memory import AddressSpace, async_copy, async_copy_wait_all, external_memory
from max.gpu.primitives import warp

from .attention import MaskSpec
from .gpu_common import (
    row_attention_meta,
    attention_slots,
    cache_row_offset,
    find_request,
    find_slot_request,
    slot_start,
    ELEMENTWISE_THREADS,
)
from .common import DPtr, FPtr, U32Ptr, U8Ptr, ceil_div
from .fp8 import FP8_MAX
from .fp8_matmul import Granularity
from .paged_cache import PagedLatentRows


comptime MERGE_THREADS = 128


def merge_kernel[
    dtype: DType
](
    part_out: FPtr,
    part_max: FPtr,
    part_sum: FPtr,
    raw: FPtr,
    total_rows: Int32,
    num_partitions: Int32,
    kv_lora_rank: Int32,
):
    """One block per row: `raw = rnd(sum_p exp(m_p - M) o_p / sum_p exp(m_p - M) l_p)`."""
    var tid = thread_idx.x
    var row = block_idx.x
    var rows = Int(total_rows)
    var parts = Int(num_partitions)
    var rank = Int(kv_lora_rank)
    var top = neg_inf[DType.float32]()
    for p in range(parts):
        top = max(top, part_max.unsafe_load(p * rows + row))
    var total = Float32(0)
    for p in range(parts):
        var m = part_max.unsafe_load(p * rows + row)
        if m != neg_inf[DType.float32]():
            total += exp(m - top) * part_sum.unsafe_load(p * rows + row)
    for c in range(tid, rank, MERGE_THREADS):
        var acc = Float32(0)
        for p in range(parts):
            var m = part_max.unsafe_load(p * rows + row)
            if m != neg_inf[DType.float32]():
                var w = exp(m - top) / total
                acc += w * part_out.unsafe_load((p * rows + row) * rank + c)
        raw.unsafe_store(row * rank + c, acc.cast[dtype]().cast[DType.float32]())


def store_kernel[dtype: DType](src: FPtr, dst: DPtr[dtype], count: Int64):
    """`dst[i] = src[i]` as dtype (the attention output, whose values are already dtype values)."""
    var i = block_idx.x * ELEMENTWISE_THREADS + thread_idx.x
    if i < Int(count):
        dst.unsafe_store(i, src.unsafe_load(i).cast[dtype]())
