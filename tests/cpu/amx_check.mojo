# Step 5 on AMX tiles (mojo_kernels/cpu/amx.mojo) against the float32 path, on random paged caches.
#
# Build (any x86-64 machine; the AMX instructions are compiled in for this target):
#     mojo build --target-cpu sapphirerapids -I . tests/cpu/amx_check.mojo -o /tmp/amx_check
# Run:
#     /tmp/amx_check            # correctness: every case on the emulated tiles, and on the AMX unit
#                               # where the CPU has it; then timings where the CPU has AMX
#     /tmp/amx_check quick      # correctness only
#     /tmp/amx_check projections  # steps 3 and 6 alone: checks, then timings per path
#     /tmp/amx_check overhead [fp8]  # the AMX path with no tile instruction, 16 heads, on any CPU (fp8: fp8_ds_mla rows):
#                               # `perf record /tmp/amx_check overhead` shows where the rest goes
#     /tmp/amx_check dequantize  # one thread dequantizing fp8_ds_mla rows, cache-resident and from memory (any CPU)
#     /tmp/amx_check loop 16 200  # the AMX path alone, 200 times, 16 heads (perf on an AMX host)
#     /tmp/amx_check ab 16 10 5 op pf0 whole  # `loop` variants alternated in one process, 10 rounds of best-of-5:
#                               # medians and per-round ratios to the first (a noisy AMX host)
#     /tmp/amx_check ab 16 5 3 cold fp8-cold  # fp8_ds_mla rows against bf16 rows from memory, round by round (any CPU)
#     /tmp/amx_check loop 16 50 stages [fp8]  # the whole op and each of its stages alone (fp8: fp8_ds_mla rows; any CPU)
#     /tmp/amx_check loop 16 20 cold  # the whole op, the last-level cache evicted before each call (`fp8-cold`:
#                               # fp8_ds_mla rows; any CPU: AMX where it has it, else the op's own path)
#
# Each case (random bf16 caches, NaN in every slot past a request's tokens; page sizes 1/16/64/128 and one of 24, heads 1/16/128, ragged requests incl. ones with
# no new token and ones with an empty cache, causal / sliding-window / no mask, 1 or several key
# partitions, and sizes with tails: kv_lora_rank 100, key dim 114) runs `attend_partitions` +
# `merge_partitions` on the f32 path (tested against the torch reference by tests/test_op_parity.py),
# on the AVX512-BF16 path where compiled in, on the AMX path with `EmulatedTiles` (the
# instructions' semantics in plain loops: the layouts are checked on any CPU) and with `AmxTiles`
# (the unit) where the CPU has it. Every path must match f32 within TOLERANCE (products of the
# same bf16 values summed in another order; the probabilities and the output rounded to bf16).
# Timings: batch 8, 16k context, page 64, 16 and 128 heads, every path the CPU has, one line each
# with the thread count: step 5 alone, then the whole CPU op (mla_decode_branch_fp8_cpu with
# DeepSeek-V3 dims, blockwise fp8 weights; PYMLA_CPU_PATH set per path). The AMX line also times
# the path with `tdpbf16ps` left out and with no tile instruction at all (wrong results, where the
# time goes), and the AmxTuning variants of the next tile's prefetch (every 2nd / 4th line, none). Steps 3 and 6 on tiles (cpu/amx_matmul.mojo): checks and timings in
# projection_check.mojo; the tile emulation in check_common.mojo. Exit status 1 if any check fails.

from std.memory import bitcast
from std.os import setenv
from std.sys import argv, num_physical_cores
from std.sys.info import CompilationTarget
from std.time import perf_counter_ns

from mojo_kernels.common import DPtr, FPtr, U32Ptr, ceil_div
from mojo_kernels.fp8 import NO_SHIFT, bf16_scale_shift, power_of_two, widen_e4m3, widen_e4m3_bf16
from mojo_kernels.cpu.amx import HAS_AMX, AmxTiles, TileUnit, amx_permitted
from mojo_kernels.cpu.amx_attention import AMX_TUNING, AmxTuning
from mojo_kernels.cpu.attention import PATH_AMX, PATH_AVX512BF16, PATH_F32, attend_partitions
from mojo_kernels.cpu.merge import PartialResults, TaskPlan, merge_partitions
from mojo_kernels.cpu.bf16 import HAS_AVX512_BF16
from mojo_kernels.cpu.pipeline import MergeRows, RopeQuery, mla_decode_branch_fp8_cpu, plan_attention, project_output, project_q_nope
from mojo_kernels.cpu.rope_norm import rotate_and_normalize_new_rows
from mojo_kernels.cpu.scratch import SCRATCH_SLOTS, Scratch
from mojo_kernels.cpu.simd import run_tasks
from mojo_kernels.paged_cache import CacheShard, Fp8LatentRows, PagedLatentRows, RaggedBatch
from mojo_kernels.problem import DecodeProblem
from mojo_kernels.spec import MASK_CAUSAL, MASK_NULL, MASK_SLIDING_WINDOW_CAUSAL, Granularity, MaskSpec

from check_common import AmxWithoutDots, EmulatedTiles, NoTiles, Rng, amx_runs, cpu_has_amx, cpu_model, huge_page_list
from projection_check import check_divisor, check_projections, model_weight_byte, time_projections

comptime TOLERANCE: Float32 = 0.02
"""Largest |path - f32| allowed on outputs of magnitude <= 1 (values uniform in [-1, 1]); a bf16 ulp there is 2^-8."""

comptime BF16 = DType.bfloat16
def tuned(
    in_place_max: Int = AMX_TUNING.values_in_place_max_row_blocks,
    prefetch_stride: Int = AMX_TUNING.prefetch_line_stride,
    score_pairs: Bool = AMX_TUNING.score_pairs,
    value_pairs: Bool = AMX_TUNING.value_pairs,
) -> AmxTuning:
    """The op's tuning with the choices given here instead."""
    return AmxTuning(in_place_max, prefetch_stride, score_pairs, value_pairs)


comptime PACKED = tuned(in_place_max=0)
"""The op's tuning with values always packed."""
comptime IN_PLACE = tuned(in_place_max=1 << 20)
"""The op's tuning with values always read in place."""
comptime PAIRS = tuned(score_pairs=not AMX_TUNING.score_pairs, value_pairs=not AMX_TUNING.value_pairs)
"""The op's tuning with the other choices of `score_pairs` and `value_pairs` (tiles on two register sets, or
on one)."""
comptime PAIRS_PF0 = tuned(
    score_pairs=not AMX_TUNING.score_pairs, value_pairs=not AMX_TUNING.value_pairs, prefetch_stride=0
)
"""`PAIRS` without the next tile's software prefetch."""
comptime SCORE_PAIRS = tuned(score_pairs=not AMX_TUNING.score_pairs)
comptime VALUE_PAIRS = tuned(value_pairs=not AMX_TUNING.value_pairs)
comptime PACKED_PAIRS = tuned(in_place_max=0, score_pairs=not AMX_TUNING.score_pairs, value_pairs=not AMX_TUNING.value_pairs)


def prefetching(stride: Int) -> AmxTuning:
    """The op's tuning with the next tile's rows prefetched every `stride`-th line (0: none)."""
    return tuned(prefetch_stride=stride)


struct Case(Movable):
    """A random paged bf16 cache (pages shuffled, every slot filled) and q_full rows for a ragged batch."""

    var blocks: List[BFloat16]
    var lookup: List[UInt32]
    var offsets: List[UInt32]
    var cache_lengths: List[UInt32]
    var q_full: List[BFloat16]
    var num_tokens: Int
    var num_heads: Int
    var page_size: Int
    var pages_per_request: Int
    var key_dim: Int
    var rank: Int
    var mask: MaskSpec
    var name: String
    var fp8_bytes: List[UInt8]  # the cache quantized to `fp8_ds_mla` rows (`quantize_to_fp8`)
    var use_fp8: Bool

    def __init__(
        out self,
        seed: Int,
        num_heads: Int,
        page_size: Int,
        cache_lengths: List[Int],
        new_tokens: List[Int],
        mask: MaskSpec,
        key_dim: Int = 576,
        rank: Int = 512,
        random_values: Bool = True,
    ):
        var rng = Rng(seed)
        var n = len(cache_lengths)
        self.num_heads = num_heads
        self.page_size = page_size
        self.key_dim = key_dim
        self.rank = rank
        self.mask = mask
        self.fp8_bytes = List[UInt8]()
        self.use_fp8 = False
        self.offsets = List[UInt32](length=n + 1, fill=0)
        self.cache_lengths = List[UInt32](length=n, fill=0)
        var longest = 1
        for b in range(n):
            self.cache_lengths[b] = UInt32(cache_lengths[b])
            self.offsets[b + 1] = self.offsets[b] + UInt32(new_tokens[b])
            longest = max(longest, cache_lengths[b] + new_tokens[b])
        self.num_tokens = Int(self.offsets[n])
        self.pages_per_request = ceil_div(longest, page_size)
        var num_pages = n * self.pages_per_request + 1
        var order = List[UInt32](length=num_pages, fill=0)
        for i in range(num_pages):
            order[i] = UInt32(i)
        for i in range(num_pages - 1, 0, -1):  # shuffled pages
            var j = rng.below(i + 1)
            var t = order[i]
            order[i] = order[j]
            order[j] = t
        self.lookup = List[UInt32](length=n * self.pages_per_request, fill=0)
        for i in range(n * self.pages_per_request):
            self.lookup[i] = order[i]
        var size = num_pages * page_size * key_dim
        self.blocks = huge_page_list[BF16](size)  # as the op's caches (pymla/host_memory.py)
        self.q_full = List[BFloat16](length=max(self.num_tokens, 1) * num_heads * key_dim, fill=0)
        if random_values:
            for i in range(size):
                self.blocks[i] = rng.uniform().cast[BF16]()
            for i in range(len(self.q_full)):
                self.q_full[i] = (rng.uniform() * 2).cast[BF16]()
        else:  # timing cases: a cheap pattern, never zero (an fp8 cache's zero bytes take the slow widening, rare in a model's rows)
            for i in range(size):
                self.blocks[i] = (Float32((i * 37) % 101 - 50) + 0.5).cast[BF16]() * BFloat16(0.02)
            for i in range(len(self.q_full)):
                self.q_full[i] = Float32((i * 13) % 29 - 14).cast[BF16]() * BFloat16(0.05)
        # Slots past each request's tokens hold NaN (a real cache may hold any bits there).
        for b in range(n):
            for pos in range(cache_lengths[b] + new_tokens[b], self.pages_per_request * page_size):
                var row = Int(self.lookup[b * self.pages_per_request + pos // page_size]) * page_size + pos % page_size
                for d in range(key_dim):
                    self.blocks[row * key_dim + d] = BFloat16.MAX * 0 / 0
        var lengths = String()
        for b in range(n):
            lengths += String(cache_lengths[b], "+", new_tokens[b], " ")
        self.name = String("H=", num_heads, " page=", page_size, " D=", key_dim, " R=", rank, " mask=", mask.kind, "/", mask.window, " req=", lengths)

    def batch(mut self) -> RaggedBatch:
        return RaggedBatch(
            self.offsets.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            self.cache_lengths.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            len(self.cache_lengths),
            CacheShard.whole(),
        )

    def cache(mut self) -> PagedLatentRows[BF16]:
        return PagedLatentRows[BF16].create(
            self.blocks.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            self.lookup.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            self.pages_per_request, 1, self.page_size, self.key_dim, 0,
        )

    def fp8_row_bytes(self) -> Int:
        return self.rank + 4 * (self.rank // 128) + 2 * (self.key_dim - self.rank)

    def fp8_rows(mut self) -> Fp8LatentRows:
        """The cache as `fp8_ds_mla` rows when `use_fp8`, else none (rows in bf16)."""
        if not self.use_fp8:
            return Fp8LatentRows.absent(self.cache())
        return Fp8LatentRows.create(
            self.fp8_bytes.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            self.lookup.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            self.pages_per_request, 1, self.page_size, self.fp8_row_bytes(), 0, self.rank,
        )

    def quantize_to_fp8(mut self):
        """Fills `fp8_bytes` with every slot's row quantized (the rule of `Fp8LatentRows.store_row`)."""
        self.fp8_bytes = huge_page_list[DType.uint8](len(self.blocks) // self.key_dim * self.fp8_row_bytes())
        self.use_fp8 = True
        var rows = self.fp8_rows()
        var cache = self.cache()
        for b in range(len(self.cache_lengths)):
            for pos in range(self.pages_per_request * self.page_size):
                rows.store_row[BF16](b, pos, cache.row(b, pos))

    def plan(mut self, partitions: Int) -> TaskPlan:
        """`partitions` 0: the op's own plan (every core); else that many key partitions per request."""
        return plan_attention(self.batch(), self.num_tokens, self.num_heads, self.rank, self.key_dim, partitions)

    def attend[
        tiles: TileUnit, tuning: AmxTuning = AMX_TUNING
    ](mut self, path: Int, partitions: Int) raises -> List[BFloat16]:
        """`attend_partitions` + `merge_partitions` on `path`: the attention output `[T, H, rank]`.

        `tuning`: the AMX path's (`AmxTuning`; e.g. PACKED, IN_PLACE).
        """
        var plan = self.plan(partitions)
        var shape = plan.shape()
        var rows = shape.num_slots * self.num_heads
        var out = List[Float32](length=max(rows * self.rank, 1), fill=Float32.MAX)
        var row_max = List[Float32](length=max(rows, 1), fill=0)
        var row_sum = List[Float32](length=max(rows, 1), fill=0)
        var partials = PartialResults(
            out.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            row_max.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            row_sum.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        )
        var raw = List[BFloat16](length=max(self.num_tokens * self.num_heads * self.rank, 1), fill=0)
        var q = self.q_full.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        attend_partitions[BF16, tiles, tuning](
            q, self.cache(), self.batch(), shape, Float32(0.0416), self.mask, 0, partials, path, self.fp8_rows(),
        )
        merge_partitions[BF16](
            partials, shape, raw.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](), row_sum.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](), False
        )
        _ = out^
        _ = row_max^
        _ = row_sum^
        _ = plan^
        return raw^


def max_error(a: List[BFloat16], b: List[BFloat16]) -> Float32:
    var worst = Float32(0)
    for i in range(len(a)):
        var d = abs(a[i].cast[DType.float32]() - b[i].cast[DType.float32]())
        if not (d <= worst):  # NaN counts as the worst
            worst = d if d == d else Float32.MAX
    return worst


def check(name: String, path_name: String, expected: List[BFloat16], got: List[BFloat16], mut failures: Int):
    var err = max_error(expected, got)
    var ok = err <= TOLERANCE
    if not ok:
        failures += 1
    print("PASS" if ok else "FAIL", path_name, "max|err|", err, name)


def check_case(mut c: Case, partitions: Int, mut failures: Int) raises:
    var name = c.name + String("parts=", partitions if partitions > 0 else -1)
    var expected = c.attend[AmxTiles](PATH_F32, partitions)
    comptime if HAS_AVX512_BF16:
        check(name, "avx512bf16", expected, c.attend[AmxTiles](PATH_AVX512BF16, partitions), failures)
    check(name, "amx-emulated packed", expected, c.attend[EmulatedTiles, PACKED](PATH_AMX, partitions), failures)
    check(name, "amx-emulated in-place", expected, c.attend[EmulatedTiles, IN_PLACE](PATH_AMX, partitions), failures)
    check(name, "amx-emulated other pairs", expected, c.attend[EmulatedTiles, PAIRS](PATH_AMX, partitions), failures)
    check(name, "amx-emulated packed, other pairs", expected, c.attend[EmulatedTiles, PACKED_PAIRS](PATH_AMX, partitions), failures)
    if amx_runs():
        check(name, "amx packed", expected, c.attend[AmxTiles, PACKED](PATH_AMX, partitions), failures)
        check(name, "amx in-place", expected, c.attend[AmxTiles, IN_PLACE](PATH_AMX, partitions), failures)
        check(name, "amx other pairs", expected, c.attend[AmxTiles, PAIRS](PATH_AMX, partitions), failures)
        check(name, "amx packed, other pairs", expected, c.attend[AmxTiles, PACKED_PAIRS](PATH_AMX, partitions), failures)
    if c.rank % 128 != 0:
        return  # no fp8_ds_mla rows: 128-value scale blocks
    # The same keys as fp8_ds_mla rows: every path dequantizes them to the same bf16 values.
    c.quantize_to_fp8()
    var expected_fp8 = c.attend[AmxTiles](PATH_F32, partitions)
    comptime if HAS_AVX512_BF16:
        check(name, "fp8 avx512bf16", expected_fp8, c.attend[AmxTiles](PATH_AVX512BF16, partitions), failures)
    check(name, "fp8 amx-emulated packed", expected_fp8, c.attend[EmulatedTiles, PACKED](PATH_AMX, partitions), failures)
    check(
        name, "fp8 amx-emulated in-place", expected_fp8, c.attend[EmulatedTiles, IN_PLACE](PATH_AMX, partitions), failures
    )
    if amx_runs():
        check(name, "fp8 amx", expected_fp8, c.attend[AmxTiles](PATH_AMX, partitions), failures)
    c.use_fp8 = False


def check_fp8_dequantize(mut failures: Int):
    """`Fp8LatentRows.dequantize` to bfloat16 (bit arithmetic per 128-value block after one zero-exponent test per
    block) against its float32 route (`e4m3 * scale` rounded to bfloat16): bit for bit, on rows whose blocks hold
    only normal bytes, a zero or subnormal byte in the block's first or second half, and a scale that is not a power
    of two."""
    comptime RANK = 512
    comptime KEY_DIM = 576
    comptime ROWS = 4
    var row_bytes = RANK + 4 * (RANK // 128) + 2 * (KEY_DIM - RANK)
    var rng = Rng(5)
    var bytes = List[UInt8](length=ROWS * row_bytes, fill=0)
    var lookup = List[UInt32](length=1, fill=0)
    var rows = Fp8LatentRows.create(
        bytes.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        lookup.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        1, 1, ROWS, row_bytes, 0, RANK,
    )
    for r in range(ROWS):
        var row = rows.row(0, r)  # the scales and the rope part written through the rows' own accessors
        for i in range(RANK):  # normal e4m3: exponent 1..15, any sign and mantissa, never NaN
            var e = 1 + rng.below(15)
            var m = rng.below(7 if e == 15 else 8)
            row.unsafe_store(i, UInt8(rng.below(2) * 128 + e * 8 + m))
        for block in range(RANK // 128):
            var scale = power_of_two(-9 + 5 * r - 3 * block) if r != 3 or block != 2 else Float32(0.75)
            rows.scales(row).unsafe_store(block, scale)
        for d in range(KEY_DIM - RANK):
            rows.rope(row).unsafe_store(d, rng.uniform().cast[BF16]())
    bytes[row_bytes + 70] = 0x00  # row 1, block 0, second half: zero
    bytes[row_bytes + 128 + 3] = 0x01  # row 1, block 1, first half: subnormal
    bytes[2 * row_bytes + 3 * 128 + 127] = 0x80  # row 2, block 3: negative zero
    bytes[2 * row_bytes + 2 * 128 + 64] = 0x85  # row 2, block 2: negative subnormal
    var as_bf16 = List[BFloat16](length=ROWS * KEY_DIM, fill=BFloat16(0))
    var as_f32 = List[Float32](length=ROWS * KEY_DIM, fill=0)
    rows.dequantize_rows[BF16](0, 0, ROWS, as_bf16.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](), KEY_DIM)
    rows.dequantize_rows[DType.float32](0, 0, ROWS, as_f32.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](), KEY_DIM)
    var wrong = 0
    for i in range(ROWS * KEY_DIM):
        if bitcast[DType.uint16](as_bf16[i]) != bitcast[DType.uint16](as_f32[i].cast[BF16]()):
            wrong += 1
    if wrong:
        failures += 1
    print("PASS" if wrong == 0 else "FAIL", "fp8 rows dequantized to bf16:", wrong, "of", ROWS * KEY_DIM, "values differ")


def check_fp8_widening(mut failures: Int):
    """`widen_e4m3_bf16` (the bf16 route of fp8 key reads) against `widen_e4m3 * 2^k` rounded to bf16:
    bit for bit, every e4m3 byte but NaN, alone and in vectors of 32 (normal only, or mixed with
    zero and subnormal bytes: both routes), shifts across the range `bf16_scale_shift` allows."""
    var wrong = 0
    for k in [-120, -64, -9, -1, 0, 3, 64, 119]:
        if bf16_scale_shift(power_of_two(k)) != k:
            wrong += 1
        for x in range(256):
            if x & 0x7F == 0x7F:
                continue
            var byte = SIMD[DType.uint8, 2](UInt8(x))
            var fast = widen_e4m3_bf16[2](byte, k)[0]
            var slow = (widen_e4m3[2](byte) * power_of_two(k)).cast[DType.bfloat16]()[0]
            if bitcast[DType.uint16](fast) != bitcast[DType.uint16](slow):
                wrong += 1
            # 32 consecutive bytes (NaN as 0x7E): vectors of normal bytes only and ones mixed with subnormals.
            var window = SIMD[DType.uint8, 32](0)
            comptime for i in range(32):
                var y = (x + i) % 256
                window[i] = UInt8(0x7E if y & 0x7F == 0x7F else y)
            var fast_window = bitcast[DType.uint16, 32](widen_e4m3_bf16[32](window, k))
            if fast_window != bitcast[DType.uint16, 32]((widen_e4m3[32](window) * power_of_two(k)).cast[DType.bfloat16]()):
                wrong += 1
    if bf16_scale_shift(Float32(0.75)) != NO_SHIFT or bf16_scale_shift(power_of_two(-121)) != NO_SHIFT:
        wrong += 1
    if wrong:
        failures += 1
    print("PASS" if wrong == 0 else "FAIL", "fp8 widening to bf16:", wrong, "mismatches")


def check_scratch(mut failures: Int) raises:
    """The CPU scratch pool (mojo_kernels/cpu/scratch.mojo): a task taking the same buffers as the one
    before it gets the same memory (no allocation once warm), zero-filled again; tasks at once get
    distinct slots and disjoint buffers, also from many threads; a bigger buffer regrows its segment;
    with every slot busy a task still gets usable (private) memory."""
    var wrong = 0
    var first = Scratch()
    var a = first.take[DType.float32](1000)
    var b = first.take_ints(10)
    a.unsafe_store(999, 1.5)
    b.unsafe_store(9, 7)
    var a_at = Int(a)
    var b_at = Int(b)
    _ = first^
    var again = Scratch()
    var a2 = again.take[DType.float32](1000)
    var b2 = again.take_ints(10)
    if Int(a2) != a_at or Int(b2) != b_at:
        wrong += 1  # the pool should hand back the same memory
    if a2.unsafe_load(999) != 0 or b2.unsafe_load(9) != 0 or Int(a2) % 64 != 0:
        wrong += 1  # zero-filled and 64-byte aligned
    var big = again.take[DType.bfloat16](1 << 20)  # past the first segment: another one
    big.unsafe_store((1 << 20) - 1, 1)
    _ = again^
    var regrown = Scratch()
    var huge = regrown.take[DType.float32](1 << 21)  # bigger than the slot's first segment: regrown
    if huge.unsafe_load((1 << 21) - 1) != 0:
        wrong += 1
    _ = regrown^
    # Every slot busy: the next scratch is private and its memory usable.
    var held = List[Scratch]()
    for _ in range(SCRATCH_SLOTS):
        held.append(Scratch())
    var extra = Scratch()
    var p = extra.take[DType.float32](64)
    p.unsafe_store(63, 2)
    if extra.slot != -1 or p.unsafe_load(63) != 2:
        wrong += 1
    var slots = List[Int](length=SCRATCH_SLOTS, fill=0)
    for i in range(SCRATCH_SLOTS):
        if held[i].slot < 0 or slots[held[i].slot] != 0:
            wrong += 1
        else:
            slots[held[i].slot] = 1
    _ = extra^
    _ = held^
    # Many tasks at once: each fills its buffer with its own index, then checks it.
    var tasks = 64
    var bad = List[Int](length=tasks, fill=0)
    var bad_at = bad.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

    def task(i: Int) {var bad_at}:
        var mem = Scratch()
        var buf = mem.take[DType.int32](4096)
        for k in range(4096):
            buf.unsafe_store(k, Int32(i))
        for k in range(4096):
            if buf.unsafe_load(k) != Int32(i):
                bad_at.unsafe_store(i, 1)
        _ = mem^

    run_tasks(task, tasks, 1 << 30)
    for i in range(tasks):
        wrong += bad[i]
    if wrong:
        failures += 1
    print("PASS" if wrong == 0 else "FAIL", "scratch pool:", wrong, "problems")


def mask(kind: Int, window: Int = 0) -> MaskSpec:
    return MaskSpec(kind, window)


def time_path[
    tiles: TileUnit, tuning: AmxTuning = AMX_TUNING
](mut c: Case, path: Int, iters: Int) raises -> Float64:
    _ = c.attend[tiles, tuning](path, 0)  # warm-up
    var best = Float64(1e30)
    for _ in range(iters):
        var t0 = perf_counter_ns()
        _ = c.attend[tiles, tuning](path, 0)
        best = min(best, Float64(perf_counter_ns() - t0) / 1e6)
    return best


def time_hot_cache(mut c: Case, iters: Int) raises -> Float64:
    """The AMX path with every page table entry pointing at 4 pages (in L2): the time without memory traffic."""
    var saved = c.lookup.copy()
    for i in range(len(c.lookup)):
        c.lookup[i] = saved[i % 4]
    var best = time_path[AmxTiles](c, PATH_AMX, iters)
    c.lookup = saved^
    return best


def read_all(words: Pointer[UInt64, MutUntrackedOrigin], count: Int, mut sums: List[UInt64]) raises:
    """Reads `count` 8-byte words from `words` on every core (64-byte vector sums into `sums`, one per chunk)."""
    var total = count // 8  # 64-byte vectors
    var chunks = len(sums)
    var out = sums.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

    def work(i: Int) {var words, var total, var chunks, var out}:
        var acc = SIMD[DType.uint64, 8](0)
        for k in range(total * i // chunks, total * (i + 1) // chunks):
            acc += words.unsafe_load[width=8](k * 8)
        out.unsafe_store(i, acc.reduce_add())

    run_tasks(work, chunks, total * 64)


def read_cache_ms(mut c: Case, iters: Int) raises -> Float64:
    """Best time to read every byte of the cache once on every core (64-byte vector sums): step 5's memory floor."""
    var words = c.blocks.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[UInt64]()
    var sums = List[UInt64](length=num_physical_cores() * 4, fill=0)
    var best = Float64(1e30)
    for _ in range(iters + 1):
        var t0 = perf_counter_ns()
        read_all(words, len(c.blocks) // 4, sums)
        best = min(best, Float64(perf_counter_ns() - t0) / 1e6)
    return best


comptime EVICT_BYTES = 1 << 30
"""What `Evictor` reads: more than twice any last-level cache seen here (the H200 machine's host lists 300 MiB of L3)."""


struct Evictor(Movable):
    """Reads EVICT_BYTES on every core between timed calls, so a call finds none of its inputs cached: what a
    serving loop's call per layer finds (each of a model's layers reads its own cache rows and weights), and what
    `python -m pymla bench` times by cycling its calls through cache layers. Without it the timing case (151 MB
    of bf16 rows, 86 MB of fp8 rows) can be read from a 300 MiB L3. Written once and only read after: no dirty
    lines left to write back during the timed call."""

    var buffer: List[UInt64]
    var sums: List[UInt64]

    def __init__(out self):
        self.buffer = List[UInt64](length=EVICT_BYTES // 8, fill=1)
        self.sums = List[UInt64](length=num_physical_cores() * 4, fill=0)

    def evict(mut self) raises:
        read_all(self.buffer.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](), len(self.buffer), self.sums)


struct OpInputs(Movable):
    """The rest of the op's inputs for a `Case` (DeepSeek-V3 dims: nope 128, rope 64, v_head 128)."""

    var q: List[BFloat16]
    var freqs: List[BFloat16]
    var gamma: List[BFloat16]
    var w_uk: List[UInt8]
    var w_uv: List[UInt8]
    var w_uk_scale: List[Float32]
    var w_uv_scale: List[Float32]
    var output: List[BFloat16]
    var raw: List[BFloat16]

    def __init__(out self, c: Case, max_len: Int):
        var h = c.num_heads
        var t = c.num_tokens
        var rng = Rng(7)
        self.q = List[BFloat16](length=t * h * 192, fill=0)
        for i in range(len(self.q)):
            self.q[i] = rng.uniform().cast[BF16]()
        self.freqs = List[BFloat16](length=max_len * 64, fill=0)
        for i in range(len(self.freqs)):
            self.freqs[i] = rng.uniform().cast[BF16]()
        self.gamma = List[BFloat16](length=c.rank, fill=BFloat16(1))
        self.w_uk = List[UInt8](length=h * c.rank * 128, fill=0)
        self.w_uv = List[UInt8](length=h * 128 * c.rank, fill=0)
        for i in range(len(self.w_uk)):
            self.w_uk[i] = model_weight_byte(rng)  # as block quantization makes them (few zero or subnormal bytes)
            self.w_uv[i] = model_weight_byte(rng)
        self.w_uk_scale = List[Float32](length=h * (c.rank // 128), fill=0.01)
        self.w_uv_scale = List[Float32](length=h * (c.rank // 128), fill=0.01)
        self.output = List[BFloat16](length=t * h * 128, fill=0)
        self.raw = List[BFloat16](length=t * h * c.rank, fill=0)

    def problem(mut self, mut c: Case) -> DecodeProblem[BF16]:
        return DecodeProblem[BF16](
            untracked(self.output), True, untracked(self.q), c.batch(), untracked(self.freqs), untracked(self.gamma),
            c.cache(), c.num_tokens, c.num_heads, 128, 64, c.rank, 128, Float32(0.0416), Float32(1e-6), c.mask, 0,
            Granularity(1, 128, 128),
            self.w_uk.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            self.w_uk_scale.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            self.w_uv.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            self.w_uv_scale.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            untracked(self.raw), False,  # no attention_output
            self.w_uk_scale.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](), False,  # no lse
            untracked(self.raw), False,  # no new_rows
            False,  # all six steps
            c.fp8_rows(),  # the cache's fp8_ds_mla rows when the case has them, else rows in bf16
        )


def untracked(mut buffer: List[BFloat16]) -> DPtr[BF16]:
    return buffer.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()


def time_op(mut c: Case, mut inputs: OpInputs, path: String, iters: Int, cold: Bool = False) raises -> Float64:
    """Best of `iters` calls of the whole CPU op with `PYMLA_CPU_PATH=path` (the new rows rotated again each time);
    `cold`: the last-level cache evicted (`Evictor`, untimed) before each call."""
    _ = setenv("PYMLA_CPU_PATH", path)
    var p = inputs.problem(c)
    mla_decode_branch_fp8_cpu[BF16](p)
    var evictor = Optional[Evictor](Evictor()) if cold else None
    var best = Float64(1e30)
    for _ in range(iters):
        if evictor:
            evictor.value().evict()
        var t0 = perf_counter_ns()
        mla_decode_branch_fp8_cpu[BF16](p)
        best = min(best, Float64(perf_counter_ns() - t0) / 1e6)
    return best


def best_ms[F: def() raises -> None](f: F, iters: Int) raises -> Float64:
    """Best wall time of `iters` calls of `f` (after one warm-up)."""
    f()
    var best = Float64(1e30)
    for _ in range(iters):
        var t0 = perf_counter_ns()
        f()
        best = min(best, Float64(perf_counter_ns() - t0) / 1e6)
    return best


def time_stages(mut c: Case, mut inputs: OpInputs, iters: Int) raises -> String:
    """The whole CPU op (bf16 rows, or fp8_ds_mla rows after `c.quantize_to_fp8()`) and each of its stages alone,
    best of `iters`, on the AMX path where the CPU has it, else on the AVX512-BF16 path: where the op's time goes
    beside step 5 (stage launches, projections, merge). Also an empty parallel stage (the task runner's own cost
    per stage)."""
    var name = "amx" if amx_runs() and amx_permitted() else "avx512bf16"
    var path = PATH_AMX if name == "amx" else PATH_AVX512BF16
    var p = inputs.problem(c)
    var whole = time_op(c, inputs, name, iters)
    var mem = Scratch()
    var key_dim = p.key_dim()
    var q_full = mem.take[BF16](p.num_tokens * p.num_heads * key_dim, zero=False)
    var plan = plan_attention(p.batch, p.num_tokens, p.num_heads, p.kv_lora_rank, key_dim)
    var shape = plan.shape()
    var partials = PartialResults.take(mem, shape)
    var raw = mem.take[BF16](p.num_tokens * p.num_heads * p.kv_lora_rank, zero=False)

    def steps_1_2() raises {var p}:
        rotate_and_normalize_new_rows[BF16](
            p.cache, p.batch, p.freqs_cis, p.kv_norm_gamma, p.epsilon, p.kv_lora_rank, p.rope_dim
        )

    def step_3() raises {var p, var q_full, var path}:
        project_q_nope[BF16](
            p.q, p.w_uk, p.w_uk_scale, q_full, p.num_tokens, p.num_heads, p.nope_dim, p.rope_dim, p.kv_lora_rank,
            p.granularity, path, RopeQuery[BF16](p, q_full),
        )

    def planning() raises {var p, var key_dim}:
        _ = plan_attention(p.batch, p.num_tokens, p.num_heads, p.kv_lora_rank, key_dim)

    def step_5() raises {var p, var q_full, var shape, var partials, var path}:
        attend_partitions[BF16](
            q_full, p.cache, p.batch, shape, p.scale, p.mask, p.score_mod, partials, path, p.fp8_cache
        )

    def merge() raises {var partials, var shape, var raw, var p}:
        merge_partitions[BF16](partials, shape, raw, p.lse, False)

    def step_6() raises {var p, var raw, var path, var partials, var shape}:
        project_output[BF16](
            raw, p.w_uv, p.w_uv_scale, p.output, p.num_tokens, p.num_heads, p.kv_lora_rank, p.v_head_dim,
            p.granularity, path, MergeRows[BF16](partials, shape, raw, p.lse, False),
        )

    def empty_task(i: Int):
        pass

    def empty_stage() raises:
        run_tasks(empty_task, num_physical_cores() * 4, 1 << 30)

    var line = String("stages, path ", name, ", heads ", p.num_heads, ", threads ", num_physical_cores(), ": whole op ", whole, " ms;")
    var total = Float64(0)
    var names = ["steps 1-2 (cache rows)", "rope q + step 3", "plan", "step 5", "merge + step 6", "(merge alone)"]
    var times = [
        best_ms(steps_1_2, iters), best_ms(step_3, iters), best_ms(planning, iters), best_ms(step_5, iters),
        best_ms(step_6, iters), best_ms(merge, iters),
    ]
    for i in range(len(names) - 1):
        line += String(" ", names[i], " ", times[i], " ms,")
        total += times[i]
    line += String(" ", names[len(names) - 1], " ", times[len(times) - 1], " ms,")
    line += String(" sum ", total, " ms; an empty parallel stage ", best_ms(empty_stage, iters), " ms")
    _ = plan^
    _ = mem^
    return line


def time_dequantize(mut c: Case, iters: Int) raises -> String:
    """One thread dequantizing `fp8_ds_mla` rows into a bf16 staging tile (the AMX path's per-key work on an fp8
    cache): the same 64 rows again and again (cache-resident: the arithmetic), then every row of the cache once
    (from memory), in ns per row."""
    c.quantize_to_fp8()
    var rows = c.fp8_rows()
    var staging = List[BFloat16](length=64 * c.key_dim, fill=0)
    var dst = staging.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    rows.dequantize_rows[BF16](0, 0, 64, dst, c.key_dim)
    var t0 = perf_counter_ns()
    for _ in range(iters):
        rows.dequantize_rows[BF16](0, 0, 64, dst, c.key_dim)
    var resident = Float64(perf_counter_ns() - t0) / Float64(iters * 64)
    var total = 0
    t0 = perf_counter_ns()
    for b in range(len(c.cache_lengths)):
        var n = Int(c.cache_lengths[b])
        var pos = 0
        while pos + 64 <= n:
            rows.dequantize_rows[BF16](b, pos, 64, dst, c.key_dim)
            pos += 64
            total += 64
    var streamed = Float64(perf_counter_ns() - t0) / Float64(max(total, 1))
    return String("dequantize on ", cpu_model(), ", one thread: ", resident, " ns per row cache-resident, ", streamed,
                  " ns per row from memory (", total, " rows of ", c.fp8_row_bytes(), " bytes)")


def timing_case(heads: Int) -> Case:
    """The timings' case: batch 8, 16k cached keys and one new token each, page 64, causal, `heads` heads
    (cache values that need no random draws)."""
    return Case(99, heads, 64, List[Int](length=8, fill=16383), List[Int](length=8, fill=1), mask(MASK_CAUSAL), random_values=False)


comptime VARIANTS = "op, packed, inplace, score, value, pairs, pairs-pf0, pf0, pf2, pf4, nodots, notiles, hot, whole, cold"


def time_variant(mut c: Case, mut inputs: OpInputs, variant: String, iters: Int) raises -> Float64:
    """Best of `iters` of one `loop` variant (VARIANTS; `main` describes them) on `c`."""
    if variant == "op":
        return time_path[AmxTiles](c, PATH_AMX, iters)
    elif variant == "packed":
        return time_path[AmxTiles, PACKED](c, PATH_AMX, iters)
    elif variant == "inplace":
        return time_path[AmxTiles, IN_PLACE](c, PATH_AMX, iters)
    elif variant == "score":
        return time_path[AmxTiles, SCORE_PAIRS](c, PATH_AMX, iters)
    elif variant == "value":
        return time_path[AmxTiles, VALUE_PAIRS](c, PATH_AMX, iters)
    elif variant == "pairs":
        return time_path[AmxTiles, PAIRS](c, PATH_AMX, iters)
    elif variant == "pairs-pf0":
        return time_path[AmxTiles, PAIRS_PF0](c, PATH_AMX, iters)
    elif variant == "nodots":
        return time_path[AmxWithoutDots](c, PATH_AMX, iters)
    elif variant == "notiles":
        return time_path[NoTiles](c, PATH_AMX, iters)
    elif variant == "hot":
        return time_hot_cache(c, iters)
    elif variant == "pf0":
        return time_path[AmxTiles, prefetching(0)](c, PATH_AMX, iters)
    elif variant == "pf2":
        return time_path[AmxTiles, prefetching(2)](c, PATH_AMX, iters)
    elif variant == "pf4":
        return time_path[AmxTiles, prefetching(4)](c, PATH_AMX, iters)
    elif variant == "whole":
        return time_op(c, inputs, "amx", iters)
    elif variant == "cold":
        return time_op(c, inputs, "amx" if amx_runs() else "auto", iters, cold=True)
    raise Error(String("unknown variant ", variant, " (", VARIANTS, ", each also with an fp8- prefix)"))


def median(var xs: List[Float64]) -> Float64:
    sort(xs)
    var n = len(xs)
    return xs[n // 2] if n % 2 == 1 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def alternate_variants(heads: Int, rounds: Int, iters: Int, names: List[String]) raises -> String:
    """`ab`: the variants `names` alternated for `rounds` rounds in one process (best of `iters` each): per variant
    the median and the best of its rounds, and the median over the rounds of its time over the first
    variant's in the same round. On a host whose speed drifts between rounds (the H100 machine's: 1.5-2x
    in one call) the per-round ratio is the number to read. Variants with and without the fp8- prefix mix:
    the case holds both row formats (`ab 16 5 3 cold fp8-cold`: fp8 rows against bf16 rows, round by round)."""
    var c = timing_case(heads)
    var any_fp8 = False
    for name in names:
        var variant = String(name[byte=4:]) if name.startswith("fp8-") else name
        if (variant != "cold" or amx_runs()) and not amx_permitted():
            raise Error("Linux refused the AMX tile registers (arch_prctl ARCH_REQ_XCOMP_PERM)")
        any_fp8 = any_fp8 or name.startswith("fp8-")
    if any_fp8:
        c.quantize_to_fp8()
    var inputs = OpInputs(c, 16384 + 1)
    var times = List[List[Float64]](length=len(names), fill=List[Float64]())
    for _ in range(rounds):
        for i in range(len(names)):
            c.use_fp8 = names[i].startswith("fp8-")
            var variant = String(names[i][byte=4:]) if c.use_fp8 else names[i]
            times[i].append(time_variant(c, inputs, variant, iters))
    var out = String("ab on ", cpu_model(), ", heads ", heads, ", threads ", num_physical_cores(), ", ", rounds,
                     " rounds, best of ", iters, " each:")
    for i in range(len(names)):
        var ratios = List[Float64]()
        var best = Float64(1e30)
        for r in range(rounds):
            ratios.append(times[i][r] / times[0][r])
            best = min(best, times[i][r])
        out += String("\n  ", names[i], ": median ", median(times[i].copy()), " ms, best ", best, " ms, x ", names[0],
                      " per round (median) ", median(ratios^))
    return out


def main() raises:
    var quick = len(argv()) > 1 and argv()[1] == "quick"
    if len(argv()) > 1 and argv()[1] == "overhead":
        # The AMX path's work outside the unit (no tile instruction: `NoTiles`), on any CPU: a
        # target for a profiler (`perf record`), batch 8, 16k, page 64, 16 heads.
        # `overhead fp8`: the cache as fp8_ds_mla rows (the dequantization into the staging tiles shows).
        var c = timing_case(16)
        var rows = String("bf16")
        if len(argv()) > 2 and argv()[2] == "fp8":
            c.quantize_to_fp8()
            rows = String("fp8_ds_mla")
        print("overhead on", cpu_model(), ": AMX path without tile instructions, 16 heads,", rows, "rows, threads",
              num_physical_cores(), ":", time_path[NoTiles](c, PATH_AMX, 20), "ms")
        return
    if len(argv()) > 1 and argv()[1] == "dequantize":
        var c = Case(99, 16, 64, List[Int](length=8, fill=16383), List[Int](length=8, fill=1), mask(MASK_CAUSAL))
        print(time_dequantize(c, 2000))
        return
    if len(argv()) > 4 and argv()[1] == "loop" and argv()[4] == "stages":
        var c = timing_case(atol(argv()[2]))
        if len(argv()) > 5 and argv()[5] == "fp8":
            c.quantize_to_fp8()
        var inputs = OpInputs(c, 16384 + 1)
        print("loop on", cpu_model(), ":", time_stages(c, inputs, atol(argv()[3])))
        return
    if len(argv()) > 5 and argv()[1] == "ab":
        # `ab HEADS ROUNDS ITERS V1 V2 ...`: `loop` variants alternated in one process (an AMX host; `cold` and
        # `fp8-cold` alone on any CPU).
        var names = List[String]()
        for i in range(5, len(argv())):
            names.append(String(argv()[i]))
        print(alternate_variants(atol(argv()[2]), atol(argv()[3]), atol(argv()[4]), names))
        return
    if len(argv()) > 2 and argv()[1] == "loop":
        # The AMX path alone, again and again (`perf record` on an AMX host): batch 8, 16k, page 64,
        # `loop HEADS [ITERS [VARIANT]]` heads, VARIANT one of op (the op's tuning), packed, inplace (values
        # always packed / read in place), nodots, notiles (the op's tuning without `tdpbf16ps` / without any tile
        # instruction), hot (every page table entry on 4 pages: no memory traffic), score, value, pairs (the other `score_pairs`, `value_pairs`, both),
        # pairs-pf0 (both, without the next tile's prefetch), pf0, pf2, pf4 (the next tile prefetched not at all,
        # every 2nd, every 4th line); an `fp8-` prefix reads the cache as fp8_ds_mla rows; `whole`: the whole
        # CPU op on the AMX path (steps 1-6; `fp8-whole` on fp8_ds_mla rows), where the rest of the op shows
        # beside step 5; `cold`: `whole` with the last-level cache evicted before each call (`Evictor`; on a CPU
        # without AMX, on the op's own path). Prints
        # the best time. `loop HEADS ITERS stages [fp8]` (any CPU): the whole op and each of its stages alone.
        var heads = atol(argv()[2])
        var iters = atol(argv()[3]) if len(argv()) > 3 else 100
        var c = timing_case(heads)
        var which = String(argv()[4]) if len(argv()) > 4 else String("op")
        var variant = which
        if which.startswith("fp8-"):
            c.quantize_to_fp8()
            variant = String(which[byte=4:])
        if (variant != "cold" or amx_runs()) and not amx_permitted():
            raise Error("Linux refused the AMX tile registers (arch_prctl ARCH_REQ_XCOMP_PERM)")
        var inputs = OpInputs(c, 16384 + 1)
        var ms = time_variant(c, inputs, variant, iters)
        print("loop on", cpu_model(), ":", "AMX path" if amx_runs() else "the op's path", ", tuning", which, ", heads", heads, ", threads", num_physical_cores(), ":", ms, "ms (best of", iters, ")")
        return
    print("amx_check on", cpu_model(), ": compiled with amx =", HAS_AMX, " avx512bf16 =", HAS_AVX512_BF16, " cpu amx =", cpu_has_amx(),
          " cores =", num_physical_cores())
    # The tile registers, asked for before any tile instruction (without them one faults).
    if amx_runs() and not amx_permitted():
        raise Error("Linux refused the AMX tile registers (arch_prctl ARCH_REQ_XCOMP_PERM)")
    if len(argv()) > 1 and argv()[1] == "projections":
        # Steps 3 and 6 alone: their checks, then their timings per path, side by side.
        var failed = 0
        check_projections(failed)
        time_projections(7, failed)
        if failed:
            raise Error(String(failed, " checks failed"))
        return
    var failures = 0
    var seed = 1
    # Page sizes x heads, ragged: a request with no new token, one with an empty cache, one crossing pages.
    for page in [1, 16, 64, 128, 24]:
        for heads in [1, 16, 128]:
            var c = Case(seed, heads, page, [130, 0, 77, 5], [1, 3, 0, 2], mask(MASK_CAUSAL))
            check_case(c, 0, failures)
            check_case(c, 3, failures)
            seed += 1
    # Masks that cut tiles in the middle; a long request spread over partitions with 2 row blocks + 1.
    var sliding = Case(seed, 16, 16, [200, 33], [4, 1], mask(MASK_SLIDING_WINDOW_CAUSAL, 21))
    check_case(sliding, 0, failures)
    check_case(sliding, 4, failures)
    var no_mask = Case(seed + 1, 48, 64, [300, 1], [1, 2], mask(MASK_NULL))
    check_case(no_mask, 5, failures)
    # Tails: kv_lora_rank 100 (6 x 16 + 4), key dim 114 (3 x 32 + 18): gathered keys, scalar columns.
    var tails = Case(seed + 2, 5, 16, [37, 0, 70], [3, 1, 2], mask(MASK_CAUSAL), key_dim=114, rank=100)
    check_case(tails, 0, failures)
    check_case(tails, 2, failures)
    check_fp8_widening(failures)
    check_fp8_dequantize(failures)
    check_scratch(failures)
    check_projections(failures)
    check_divisor(failures)
    print("amx_check:", failures, "failed")
    if not quick:
        var threads = num_physical_cores()
        for heads in [16, 128]:
            var c = timing_case(heads)
            var line = String("timing: batch 8, 16k, page 64, heads ", heads, ", threads ", threads, ":")
            line += String(" f32 ", time_path[AmxTiles](c, PATH_F32, 3), " ms")
            comptime if HAS_AVX512_BF16:
                line += String(", avx512bf16 ", time_path[AmxTiles](c, PATH_AVX512BF16, 5), " ms")
            if amx_runs():
                line += String(", amx ", time_path[AmxTiles](c, PATH_AMX, 5), " ms (values packed ")
                line += String(time_path[AmxTiles, PACKED](c, PATH_AMX, 5), " ms, in place ")
                line += String(time_path[AmxTiles, IN_PLACE](c, PATH_AMX, 5), " ms; score_pairs ", not AMX_TUNING.score_pairs, " ")
                line += String(time_path[AmxTiles, SCORE_PAIRS](c, PATH_AMX, 5), " ms, value_pairs ", not AMX_TUNING.value_pairs, " ")
                line += String(time_path[AmxTiles, VALUE_PAIRS](c, PATH_AMX, 5), " ms, both ")
                line += String(time_path[AmxTiles, PAIRS](c, PATH_AMX, 5), " ms; hot cache ")
                line += String(time_hot_cache(c, 5), " ms; reading the cache once ", read_cache_ms(c, 5), " ms)")
                var err = max_error(c.attend[AmxTiles](PATH_F32, 0), c.attend[AmxTiles](PATH_AMX, 0))
                line += String(" (amx vs f32 max|err| ", err, "; without tdpbf16ps ")
                line += String(time_path[AmxWithoutDots](c, PATH_AMX, 5), " ms, without tile instructions ")
                line += String(time_path[NoTiles](c, PATH_AMX, 5), " ms; next tile prefetched every 2nd line ")
                line += String(time_path[AmxTiles, prefetching(2)](c, PATH_AMX, 5), " ms, every 4th ")
                line += String(time_path[AmxTiles, prefetching(4)](c, PATH_AMX, 5), " ms, not at all ")
                line += String(time_path[AmxTiles, prefetching(0)](c, PATH_AMX, 5), " ms)")
                if not (err <= TOLERANCE):
                    failures += 1
            print(line)
            # The same keys as fp8_ds_mla rows (656 bytes instead of 1152).
            c.quantize_to_fp8()
            var fp8_line = String("timing: same shape, fp8_ds_mla cache:")
            comptime if HAS_AVX512_BF16:
                fp8_line += String(" avx512bf16 ", time_path[AmxTiles](c, PATH_AVX512BF16, 5), " ms")
            if amx_runs():
                fp8_line += String(", amx ", time_path[AmxTiles](c, PATH_AMX, 5), " ms")
            print(fp8_line)
            c.use_fp8 = False
            c.fp8_bytes = List[UInt8]()
            var inputs = OpInputs(c, 16384 + 1)
            var op_line = String("timing: whole CPU op, same shape:")
            op_line += String(" f32 ", time_op(c, inputs, "f32", 3), " ms")
            comptime if HAS_AVX512_BF16:
                op_line += String(", avx512bf16 ", time_op(c, inputs, "avx512bf16", 5), " ms")
            if amx_runs():
                op_line += String(", amx ", time_op(c, inputs, "amx", 5), " ms")
            print(op_line)
        time_projections(5, failures)
    if failures:
        raise Error(String(failures, " checks failed"))
