"""The log-sum-exp merge of step 5's key partitions, and the store of the attention output in dtype.

With `QuantizedRows.active` the merge also does the first half of step 6: it
quantizes each merged row (one row per block, so per-row scales, `bm == 1`)
with the rule of `stage_activations` (`pymla/quant.py`) bit for bit, writes
the e4m3 values (as float16, exact) and scales for `out_step_kernel`, and the
optional attention output; the output step then only copies them
(`stage_quantized`) instead of reducing and converting raw rows on its
critical path.
"""

from std.math import exp, log
from std.memory import stack_allocation
from std.sys import size_of
from std.utils.numerics import neg_inf

from max.gpu import WARP_SIZE, barrier, block_idx, thread_idx
from max.gpu.memory import AddressSpace
from max.gpu.primitives import warp

from ..fp8 import Divisor, activation_scale, e4m3_as_f16
from .addressing import ELEMENTWISE_THREADS
from .params import GFPtr, GPtr, KernelParams
from .pdl import wait_for_producers
from .projection_mma import QuantizedRows
from .schedule import MAX_PARTITIONS, SplitSchedule


comptime MERGE_THREADS = 128
comptime MERGE_UNROLL = 4  # partitions whose rows are loaded before they are summed
# `merge_kernel[.., ahead=True]` (`GpuPlan.merge_ahead`: every row's block alone on its SM): a row's first
# MERGE_AHEAD_UNROLL partitions loaded before the weights, and as many at once after (224-232 registers;
# the plain instance 56-64, ptxas). H100: taken everywhere it was 1.2-1.5 us faster at 16 h b8 8k (128 rows) but 4-9% slower where
# the rows take more than one wave (128 h b8 and 16 h b64, 1024 rows: fewer blocks an SM; 2026-12-07b);
# taken where the rows fit one wave, 16 h b8 8k 64.1 -> 62.8 us on bf16 rows, 54.5 -> 52.6 us on fp8 rows,
# the other shapes level (2026-12-07c).
comptime MERGE_AHEAD_UNROLL = 16
comptime MERGE_QUANT_RANK = 2048  # kv_lora_rank up to which the merge can quantize rows (shared memory)
comptime MERGE_QUANT_K_BLOCKS = MERGE_QUANT_RANK // 64  # K blocks of at least 64


@fieldwise_init
struct MergeParams[dtype: DType](KernelParams):
    """Parameters of `merge_kernel`: the partitions' outputs `part_out [partial rows, R]`, maxima and sums
    `[partial rows]`, where `split` puts each row's partitions (schedule.mojo)."""

    var part_out: GFPtr
    var part_max: GFPtr
    var part_sum: GFPtr
    var raw: GFPtr  # [rows, R]
    var split: SplitSchedule
    var kv_lora_rank: Int32
    var lse: GFPtr  # [rows]: the log-sum-exp of each row, when has_lse
    var has_lse: Int32
    var quant: QuantizedRows  # active: quantized rows for step 6 instead of raw
    var attention_output: GPtr[Self.dtype]  # [rows, R]: raw as dtype, with quant active and has_attention_output
    var has_attention_output: Int32
    var one_partition_quantized: Int32  # the attention kernel quantized the rows of one partition (sm90 epilogue)


@fieldwise_init
struct StoreParams[dtype: DType](KernelParams):
    """Parameters of `store_kernel`: `count` values of `src` to `dst` as dtype."""

    var src: GFPtr
    var dst: GPtr[Self.dtype]
    var count: Int64


def merge_kernel[dtype: DType, quantize: Bool, ahead: Bool](p: MergeParams[dtype]):
    """One block per row: `raw = rnd(sum_p exp(m_p - M) o_p / sum_p exp(m_p - M) l_p)`; with `quantize`
    (`p.quant` active) the row quantized for step 6 instead (`quantize_row`).

    The first warp turns the partitions' maxima and sums into weights
    (0 for a partition that saw no key; a row that sees no key is 0) and, with
    `has_lse`, the row's LSE `M + log(sum_p exp(m_p - M) l_p)` (-inf without
    keys); then each thread adds four columns
    of the partitions' outputs, `MERGE_UNROLL` partitions at a time; `kv_lora_rank % 4 == 0`.
    With `ahead` (`MERGE_AHEAD_UNROLL` at a time) the first of them, of a thread's first columns,
    are loaded before the weights are known (`load_partials`), so the two loads' latencies overlap:
    the kernel is a chain of dependent loads (H100, 16 h b8 8k: about one warp per scheduler, 10 us).
    A row of one partition is already in `raw`, normalized by the attention kernel
    (`AttentionBlock.normalized`): only its LSE and, with `quantize`, its quantization remain
    (none with `one_partition_quantized`: the TMA kernel's epilogue quantized it).
    """
    var weights = stack_allocation[MAX_PARTITIONS, Float32, address_space=AddressSpace.SHARED]()
    # The merged row for `quantize_row` (a parameter: the plain merge keeps its registers and shared memory).
    var row_s = stack_allocation[MERGE_QUANT_RANK if quantize else 4, Float32, address_space=AddressSpace.SHARED]()
    var tid = thread_idx.x
    var row = block_idx.x
    var rank = Int(p.kv_lora_rank)
    wait_for_producers()  # the partitions come from the attention kernel, the schedule from the q step (pdl.mojo)
    var entry = p.split.row_partials(row)
    var first = entry[0]
    var parts = entry[1]
    # A row of one partition, normalized in `raw` already: nothing to do without an LSE to give or a row
    # to quantize (the whole block agrees: one row).
    if parts == 1 and p.has_lse == 0 and (not quantize or p.one_partition_quantized != 0):
        return
    comptime UNROLL = MERGE_AHEAD_UNROLL if ahead else MERGE_UNROLL
    var c0 = 4 * tid
    var early = Array[SIMD[DType.float32, 4], UNROLL](fill=0)
    comptime if ahead:
        if parts > 1 and c0 < rank:
            early = load_partials[UNROLL](p, first, parts, 0, c0)
    if tid < WARP_SIZE:
        # Every partial row of the request's tasks holds its statistics: the sums load beside the maxima.
        var m0 = p.part_max.unsafe_load(p.split.partial_row(first, tid)) if tid < parts else neg_inf[DType.float32]()
        var m1 = p.part_max.unsafe_load(p.split.partial_row(first, tid + WARP_SIZE)) if tid + WARP_SIZE < parts else neg_inf[DType.float32]()
        var l0 = p.part_sum.unsafe_load(p.split.partial_row(first, tid)) if tid < parts else Float32(0)
        var l1 = p.part_sum.unsafe_load(p.split.partial_row(first, tid + WARP_SIZE)) if tid + WARP_SIZE < parts else Float32(0)
        var top = warp.max(max(m0, m1))
        var e0 = exp(m0 - top) if m0 != neg_inf[DType.float32]() else Float32(0)
        var e1 = exp(m1 - top) if m1 != neg_inf[DType.float32]() else Float32(0)
        l0 = l0 if e0 != 0 else Float32(0)
        l1 = l1 if e1 != 0 else Float32(0)
        var total = warp.sum(e0 * l0 + e1 * l1)
        var inv = Float32(1) / total if total > 0 else Float32(0)  # no key at all: the row is 0
        weights.unsafe_store(tid, e0 * inv)
        weights.unsafe_store(tid + WARP_SIZE, e1 * inv)
        if tid == 0 and p.has_lse != 0:
            p.lse.unsafe_store(row, top + log(total) if total > 0 else neg_inf[DType.float32]())
    barrier()
    if parts == 1:
        comptime if quantize:
            if p.one_partition_quantized != 0:
                return
            for c in range(4 * tid, rank, 4 * MERGE_THREADS):
                row_s.unsafe_offset(c).unsafe_store[alignment=16](
                    0, p.raw.unsafe_offset(row * rank + c).unsafe_load[width=4, alignment=16](0)
                )
            quantize_row[dtype](p, row_s, row)
        return
    for c in range(c0, rank, 4 * MERGE_THREADS):
        var acc = SIMD[DType.float32, 4](0)
        for p0 in range(0, parts, UNROLL):
            var v = early.copy() if ahead and p0 == 0 and c == c0 else load_partials[UNROLL](p, first, parts, p0, c)
            comptime for u in range(UNROLL):
                # A partition that saw no key (weight 0) may hold anything: skipped, not multiplied.
                if p0 + u < parts and weights.unsafe_load(p0 + u) != 0:
                    acc += weights.unsafe_load(p0 + u) * v[u]
        var value = acc.cast[dtype]().cast[DType.float32]()
        comptime if quantize:
            row_s.unsafe_offset(c).unsafe_store[alignment=16](0, value)
        else:
            p.raw.unsafe_offset(row * rank + c).unsafe_store[alignment=16](0, value)
    comptime if quantize:
        quantize_row[dtype](p, row_s, row)


@always_inline
def load_partials[
    dtype: DType, //, unroll: Int
](p: MergeParams[dtype], first: Int, parts: Int, p0: Int, c: Int) -> Array[SIMD[DType.float32, 4], unroll]:
    """Columns `c ..< c + 4` of partitions `p0 ..< p0 + unroll` (those below `parts`) of a row whose
    partition 0 is partial row `first`: independent loads, all in flight at once."""
    var v = Array[SIMD[DType.float32, 4], unroll](fill=0)
    var rank = Int(p.kv_lora_rank)
    comptime for u in range(unroll):
        if p0 + u < parts:
            v[u] = p.part_out.unsafe_offset(p.split.partial_row(first, p0 + u) * rank + c).unsafe_load[width=4, alignment=16](0)
    return v^


@always_inline
def quantize_row[
    dtype: DType
](p: MergeParams[dtype], row_s: Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED], row: Int):
    """Merged row `row` (in `row_s`, dtype values) quantized into `p.quant` per K block of `block_k`:
    `s = amax / 448` (1 when 0), `fp8(clamp(x / s))`, as `quantize_rows_in_registers` does; with
    `has_attention_output` the row as dtype too. `block_k % 4 == 0`, `kv_lora_rank % block_k == 0`."""
    var div_s = stack_allocation[MERGE_QUANT_K_BLOCKS, Divisor, address_space=AddressSpace.SHARED]()  # each K block's divisor
    var tid = thread_idx.x
    var lane = tid % WARP_SIZE
    var rank = Int(p.kv_lora_rank)
    var bk = Int(p.quant.block_k)
    var k_blocks = rank // bk
    barrier()
    for kb in range(tid // WARP_SIZE, k_blocks, MERGE_THREADS // WARP_SIZE):
        var amax = Float32(0)
        for k in range(kb * bk + lane, (kb + 1) * bk, WARP_SIZE):
            amax = max(amax, abs(row_s.unsafe_load(k)))
        amax = warp.max(amax)
        if lane == 0:
            var scale = activation_scale(amax)
            div_s.unsafe_offset(kb)[] = Divisor.of(scale)
            p.quant.scales.unsafe_store(row * k_blocks + kb, scale)
    barrier()
    for c in range(4 * tid, rank, 4 * MERGE_THREADS):
        var value = row_s.unsafe_offset(c).unsafe_load[width=4, alignment=16](0)
        p.quant.values.unsafe_offset(row * rank + c).unsafe_store[alignment=8](
            0, e4m3_as_f16[4](value, div_s.unsafe_offset(c // bk)[])
        )
        if p.has_attention_output != 0:
            p.attention_output.unsafe_offset(row * rank + c).unsafe_store[alignment=4 * size_of[dtype]()](
                0, value.cast[dtype]()
            )


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
