# GPU smoke test of mojo_kernels/gpu/: every stage against plain CPU loops.
#
# Run on a machine with an NVIDIA GPU, from the repository root:
#     mojo run -I . tests/gpu/gpu_smoke.mojo            # the correctness cases
#     mojo run -I . tests/gpu/gpu_smoke.mojo fp8        # the fp8_ds_mla cache's cases alone
#     mojo run -I . tests/gpu/gpu_smoke.mojo sm90       # only the sm90 (TMA) kernel's raw checks, every case
# (timings: tests/gpu/gpu_bench.mojo). Build without a GPU (checks that every kernel compiles
# for sm_90, emits PTX):
#     mojo build --target-accelerator=sm_90 --emit asm -I . tests/gpu/gpu_smoke.mojo -o /tmp/smoke/smoke.s
#
# Each case checks, in order:
#   cache   rows rotated + normalized in place (CPU loops on the same inputs), other bytes unchanged;
#           an fp8_ds_mla cache (`fp8` cases): the new rows quantized as the CPU's Fp8LatentRows.store_row
#           (bytes, power-of-two scales, values within an e4m3 step), and from `new_rows` byte for byte alike
#   q_full  concat(fp8mm(q_nope, w_uk), rope(q_rope)) against the blockwise fp8 formula of pymla/quant.py,
#           with every projection tile and the FMA path pinned by a plan, then the op's plan
#   raw     attention from the GPU's own q_full and cache (float64 on the CPU), without a split, with
#           3 partitions per request and split by work (schedule.mojo), and the FMA, small-rank
#           tensor-core, wgmma and sm90 (TMA) kernels pinned by a plan (the two Hopper kernels also
#           in the whole op with PDL on: its attention output)
#   output  output projection of the GPU's raw (CPU fp8mm), then the whole op against the CPU pipeline
#           with the tolerance of pymla/parity.py, with programmatic dependent launch (PDL) on and
#           off (`GpuPlan.pdl`) and step 6's quantization in the partition merge on and off
#           (`GpuPlan.quantize_in_merge`), the four bit for bit equal (output, attention output and
#           the cache: its values, or an fp8_ds_mla cache's bytes)
# Then, once: `fp8.Divisor` (the GPU quantizations' division) against `x / d` on the GPU, e4m3 bytes
# and float32 quotients from 2^-12 up, every bfloat16 `x` and 65536 float32 `x` for 1020 scales.
# Exit status 1 if any check fails.

from std.memory import bitcast
from std.sys import argv, has_accelerator
from std.utils.numerics import nan

from max.gpu import block_idx, thread_idx
from max.gpu.host import DeviceContext

from mojo_kernels.fp8 import DIVISOR_EXACT_FROM, FP8_MAX, Divisor, activation_scale, into_e4m3_range

from mojo_kernels.gpu.pipeline import AttentionWorkspace, cache_rows_params, gpu_rotate_and_normalize_new_rows
from mojo_kernels.gpu.plan import (
    FMA_ATTENTION,
    FMA_PATH,
    MMA_FEW_HEADS_SMALL_RANK,
    PROJ_TILES,
    NARROW_SHAPE,
    SM90_SHAPE,
    SPLIT_BY_WORK,
    WGMMA_SHAPE,
    DeviceLimits,
    GpuPlan,
    attention_supported,
    proj_tile_supported,
)
from mojo_kernels.common import DPtr
from mojo_kernels.gpu.attention_block import dequantize8
from mojo_kernels.gpu.params import GFPtr, GlobalPtr, to_global
from mojo_kernels.gpu.tma_producer import pow2_multiplier, widen_pow2
from mojo_kernels.spec import Granularity

from gpu_case import Case, DeviceCase, download, download_u8, round_to, untracked, upload, upload_u8, variant_index
from gpu_reference import cpu_attention, cpu_attention_lse, cpu_cache_rows, cpu_output, cpu_q_full


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def max_abs(values: List[Float32]) -> Float32:
    var m = Float32(0)
    for v in values:
        m = max(m, abs(v))
    return m


def report(name: String, ok: Bool, detail: String) -> Bool:
    print("  ", "PASS" if ok else "FAIL", name, detail)
    return ok


@fieldwise_init
struct Errors(Copyable):
    """`got` against `want`."""

    var top: Float32  # max|want|
    var worst: Float32  # the largest error that is not NaN
    var worst_i: Int  # where
    var nans: Int  # NaN errors
    var within: Int  # errors within the bound of `scan`

    @staticmethod
    def scan(got: List[Float32], want: List[Float32], rel_bound: Float32 = 0) -> Self:
        """`within` counts the errors up to `rel_bound x max|want|`."""
        var e = Self(max_abs(want), 0, 0, 0, 0)
        for i in range(len(want)):
            var err = abs(got[i] - want[i])
            if err != err:
                e.nans += 1
                continue
            if err > e.worst:
                e.worst = err
                e.worst_i = i
            if err <= rel_bound * e.top:
                e.within += 1
        return e^

    def relative(self) -> Float32:
        """The largest error x max|want|."""
        return self.worst / self.top if self.top > 0 else self.worst


def check_close(name: String, got: List[Float32], want: List[Float32], rel_tol: Float32) -> Bool:
    var e = Errors.scan(got, want)
    var rel = e.relative()
    var ok = rel <= rel_tol and e.nans == 0
    var at = e.worst_i
    return report(
        name, ok,
        String("max err ", rel, " x max|ref| (tol ", rel_tol, ") at ", at, ": got ", got[at] if len(got) > 0 else Float32(0),
               " want ", want[at] if len(want) > 0 else Float32(0), ", NaN ", e.nans),
    )


def tile_label[stage: StaticString, i: Int]() -> String:
    """`stage (tile WMxWNxTMxTN)` of projection tile `PROJ_TILES[i]`."""
    comptime t = PROJ_TILES[i]
    return String(stage, " (tile ", t[0], "x", t[1], "x", t[2], "x", t[3], ")")


def ulp_of[dtype: DType]() -> Float32:
    comptime if dtype == DType.bfloat16:
        return Float32(2.0) ** -7
    elif dtype == DType.float16:
        return Float32(2.0) ** -10
    else:
        return Float32(2.0) ** -23


def raw_tolerance[dtype: DType]() -> Float32:
    """Step 5 vs the float64 loop, x max|ref|: pymla/parity.py's per-element bound at its largest
    (2u M + 2^(1-p) |raw| with M, |raw| <= max|V|), or float32 sums in another order."""
    comptime if dtype == DType.float32:
        return Float32(1e-4)
    else:
        return 2 * ulp_of[dtype]()


def check_parity[dtype: DType](name: String, got: List[Float32], want: List[Float32]) -> Bool:
    """As pymla/parity.py: all within 2 ulp + 1e-6 + 2^-8, 95% within 2 ulp + 1e-6 (x max|ref|)."""
    var ulp_bound = 2 * ulp_of[dtype]() + Float32(1e-6)
    var e = Errors.scan(got, want, ulp_bound)
    var rel = e.relative()
    var bulk = Float32(e.within) / Float32(max(len(want), 1))
    var ok = e.nans == 0 and rel <= ulp_bound + Float32(2.0) ** -8 and bulk >= 0.95
    return report(name, ok, String("max err ", rel, " x max|ref|, ", bulk * 100, "% within ", ulp_bound, ", NaN ", e.nans))


def cache_tolerance[dtype: DType]() -> Float32:
    comptime if dtype == DType.float32:
        return Float32(2.0) ** -20
    else:
        return ulp_of[dtype]()


def check_cache[dtype: DType](c: Case, got: List[Float32], want: List[Float32]) -> Bool:
    var mask = c.new_row_mask()
    var top = Float32(0)
    var worst = Float32(0)
    var changed = 0
    for i in range(len(want)):
        if mask[i]:
            top = max(top, abs(want[i]))
    for i in range(len(want)):
        if mask[i]:
            worst = max(worst, abs(got[i] - want[i]))
        elif got[i] != c.blocks[i]:
            changed += 1
    var rel = worst / top if top > 0 else worst
    var ok = rel <= cache_tolerance[dtype]() and changed == 0
    return report("cache", ok, String("max err ", rel, " x max|ref| (tol ", cache_tolerance[dtype](), "), other elements changed: ", changed))


def check_fp8_rows(name: String, c: Case, got: List[UInt8], want: List[UInt8]) -> Bool:
    """An fp8_ds_mla cache after steps 1-2: every byte but the new rows' unchanged; the new rows
    99% of the reference's bytes, power-of-two scales, values within an e4m3 step (2^-3) of the row's largest."""
    var changed = 0
    for i in range(len(got)):
        if got[i] != c.fp8_bytes[i]:
            changed += 1
    var same = 0
    var total = 0
    var bad_scales = 0
    var worst = Float32(0)
    var got_values = c.values_of(got)
    var want_values = c.values_of(want)
    for t in range(c.num_tokens):
        var b = c.request_of(t)
        var pos = c.position(t)
        var at = c.fp8_row_offset(b, pos)
        for i in range(c.row_bytes):
            total += 1
            if got[at + i] == want[at + i]:
                same += 1
            if got[at + i] != c.fp8_bytes[at + i]:
                changed -= 1  # a new row's byte: not counted as changed
        for blk in range(c.rank // 128):
            var sat = at + c.rank + 4 * blk
            var bits = bitcast[DType.uint32, 1](SIMD[DType.uint8, 4](got[sat], got[sat + 1], got[sat + 2], got[sat + 3]))[0]
            if bits & 0x807FFFFF != 0:
                bad_scales += 1
        var vat = c.row_offset(b, pos)
        var top = Float32(0)
        var err = Float32(0)
        for i in range(c.key_dim):
            top = max(top, abs(want_values[vat + i]))
            var e = abs(got_values[vat + i] - want_values[vat + i])
            err = max(err, e if e == e else Float32(1e30))
        worst = max(worst, err / top if top > 0 else err)
    var frac = Float32(same) / Float32(max(total, 1))
    var ok = changed == 0 and frac >= 0.99 and bad_scales == 0 and worst <= Float32(0.125)
    return report(
        name, ok,
        String(frac * 100, "% of the new rows' bytes the reference's, max err ", worst, " x the row's max|ref| (tol 0.125), ",
               bad_scales, " scales not powers of two, other bytes changed: ", changed),
    )


def check_fp8_new_rows_source[dtype: DType](ctx: DeviceContext, c: Case, in_place: List[UInt8]) raises -> Bool:
    """Steps 1-2 from `new_rows` (the rows' values) into rows zeroed first: the bytes of the in-place run, exactly."""
    var d = DeviceCase[dtype](ctx, c)
    var poisoned = c.fp8_bytes.copy()
    var rows = List[Float32](length=max(c.num_tokens * c.key_dim, 1), fill=0)
    for t in range(c.num_tokens):
        var b = c.request_of(t)
        var pos = c.position(t)
        for i in range(c.row_bytes):
            poisoned[c.fp8_row_offset(b, pos) + i] = 0
        for i in range(c.key_dim):
            rows[t * c.key_dim + i] = c.blocks[c.row_offset(b, pos) + i]
    d.fp8_bytes = upload_u8(ctx, poisoned)
    var new_rows = upload[dtype](ctx, rows)
    var p = d.problem(c)
    p.new_rows = untracked(new_rows)
    p.has_new_rows = True
    gpu_rotate_and_normalize_new_rows[dtype](ctx, cache_rows_params(p, c.num_tokens))
    var got = download_u8(ctx, d.fp8_bytes)
    var differ = 0
    for i in range(len(got)):
        if got[i] != in_place[i]:
            differ += 1
    _ = new_rows^
    return report("cache (fp8 rows from new_rows)", differ == 0, String(differ, " bytes differ from the in-place run"))


comptime PLANNED = -1
"""A partition count of the smoke loops: the op's own plan (1: no split; SPLIT_BY_WORK: by each
request's share of the keys; n > 1: n for every request)."""


def parts_label(parts: Int) -> String:
    if parts == PLANNED:
        return "planned"
    if parts == SPLIT_BY_WORK:
        return "split by work"
    return String(parts, " partitions")


def poison_workspaces[dtype: DType](ctx: DeviceContext, c: Case, d: DeviceCase[dtype], plan: GpuPlan) raises:
    """NaN-filled buffers of the op's workspace sizes (q_full, raw, the split's tables and partitions, the
    tables filled with 0x7f7f7f7f), released at once: the device's allocator tends to hand their memory
    to the next op call's workspaces, so that a kernel reading one before its producer wrote it sees
    NaN (or a wild index), not an earlier call's equal values."""
    var rows = c.num_tokens * c.heads
    for n in [rows * c.key_dim, rows * c.rank]:
        var buf = ctx.enqueue_create_buffer[DType.float32](max(n, 1))
        ctx.enqueue_memset(buf, nan[DType.float32]())
        _ = buf^
    var ws = AttentionWorkspace(ctx, d.problem(c), plan)
    ctx.enqueue_memset(ws.tables, Int32(0x7F7F7F7F))
    ctx.enqueue_memset(ws.part_out, nan[DType.float32]())
    ctx.enqueue_memset(ws.part_max, nan[DType.float32]())
    ctx.enqueue_memset(ws.part_sum, nan[DType.float32]())
    _ = ws^


def cache_state[dtype: DType](ctx: DeviceContext, c: Case, d: DeviceCase[dtype]) raises -> List[Float32]:
    """The cache after a run, to compare runs bit for bit: its values, or (`fp8`) the fp8_ds_mla rows' bytes."""
    if not c.fp8:
        return download[dtype](ctx, d.blocks, len(c.blocks))
    var bytes = download_u8(ctx, d.fp8_bytes)
    var out = List[Float32](capacity=len(bytes))
    for b in bytes:
        out.append(Float32(b))
    return out^


def run_case[dtype: DType](ctx: DeviceContext, sm90_only: Bool, name: String, c: Case) raises -> Bool:
    """The checks above on case `c`; `sm90_only`: the sm90 kernel's raw checks alone (then returns)."""
    print(name, "dtype", dtype, "fp8_ds_mla" if c.fp8 else "", "T", c.num_tokens, "H", c.heads, "R", c.rank, "Dr", c.rope, "Dn", c.nope, "Dv", c.v_dim,
          "mask", c.mask_kind, "window", c.window, "score_mod", c.score_mod, "gran", c.gm, c.gn, c.gk)
    var ok = True
    var rows = c.num_tokens * c.heads

    # Stage by stage, each from the GPU's previous results.
    var d = DeviceCase[dtype](ctx, c)
    var problem = d.problem(c)
    var limits = DeviceLimits.read(ctx)
    var plan = d.plan(ctx, c)  # the op's own
    gpu_rotate_and_normalize_new_rows[dtype](ctx, cache_rows_params(problem, c.num_tokens))
    var ref_blocks = cpu_cache_rows[dtype](c)
    var gpu_blocks: List[Float32]
    var want_bytes = List[UInt8]()  # fp8: the expected cache
    if c.fp8:
        # Values from here on: the rows' values (e4m3 x scale), the GPU's and the reference's.
        want_bytes = c.quantized_new_rows(ref_blocks)
        var got_bytes = download_u8(ctx, d.fp8_bytes)
        ok = check_fp8_rows("cache (fp8 rows)", c, got_bytes, want_bytes) and ok
        ok = check_fp8_new_rows_source[dtype](ctx, c, got_bytes) and ok
        gpu_blocks = c.values_of(got_bytes)
        ref_blocks = c.values_of(want_bytes)
    else:
        gpu_blocks = download[dtype](ctx, d.blocks, len(c.blocks))
        ok = check_cache[dtype](c, gpu_blocks, ref_blocks) and ok

    var q_full_buf = ctx.enqueue_create_buffer[DType.float32](max(rows * c.key_dim, 1))
    var raw_buf = ctx.enqueue_create_buffer[DType.float32](max(rows * c.rank, 1))
    var ref_q_full = cpu_q_full[dtype](c)
    # q_full: dtype values; a float32 sum in another order may round one ulp the other way.
    # Every tile shape of the tensor-core kernel and the FMA path, then the op's own choice (kept).
    comptime if dtype != DType.float32:
        var q_blocks = Granularity(c.gm, c.gn, c.gk).resolve(c.num_tokens, c.rank, c.nope)
        comptime for i in range(len(PROJ_TILES)):
            if proj_tile_supported(PROJ_TILES[i], c.rank, c.nope, q_blocks, limits.smem_per_block, True):
                var tiled = plan
                tiled.q_tile = i
                d.build_q_full(ctx, c, tiled, q_full_buf)
                var got = download[DType.float32](ctx, q_full_buf, rows * c.key_dim)
                ok = check_close(tile_label["q_full", i](), got, ref_q_full, ulp_of[dtype]()) and ok
            else:
                print("  q_full: tile", i, "does not fit in shared memory or take these sizes, skipped")
        var fma_path = plan
        fma_path.q_tile = FMA_PATH
        d.build_q_full(ctx, c, fma_path, q_full_buf)
        ok = check_close("q_full (FMA path)", download[DType.float32](ctx, q_full_buf, rows * c.key_dim), ref_q_full, ulp_of[dtype]()) and ok
    d.build_q_full(ctx, c, plan, q_full_buf)
    var gpu_q_full = download[DType.float32](ctx, q_full_buf, rows * c.key_dim)
    ok = check_close("q_full", gpu_q_full, ref_q_full, ulp_of[dtype]()) and ok

    var lse_from_gpu = List[Float32]()
    var raw_from_gpu = cpu_attention_lse[dtype](c, gpu_q_full, gpu_blocks, lse_from_gpu)
    # The LSE (float32 [T H], from the partition merge: with one partition per request too) with the
    # raw it comes with; float32 scores in another order: pymla/parity.py's F32_SLACK of the scores.
    var lse_buf = ctx.enqueue_create_buffer[DType.float32](max(rows, 1))
    for parts in List[Int]() if sm90_only else [1, 3, SPLIT_BY_WORK]:
        var parted = plan
        parted.num_partitions = parts
        d.attention_lse(ctx, c, parted, q_full_buf, raw_buf, lse_buf)
        ok = check_close(String("raw with lse (", parts_label(parts), ")"), download[DType.float32](ctx, raw_buf, rows * c.rank), raw_from_gpu, raw_tolerance[dtype]()) and ok
        ok = check_close(String("lse (", parts_label(parts), ")"), download[DType.float32](ctx, lse_buf, rows), lse_from_gpu, Float32(2.0) ** -13) and ok
    var gpu_raw = List[Float32]()
    # The op's own plan last, so gpu_raw is the op's.
    for parts in List[Int]() if sm90_only else [1, 3, SPLIT_BY_WORK, PLANNED]:
        var parted = plan
        if parts != PLANNED:
            parted.num_partitions = parts
        d.attention(ctx, c, parted, q_full_buf, raw_buf)
        gpu_raw = download[DType.float32](ctx, raw_buf, rows * c.rank)
        ok = check_close(String("raw (", parts_label(parts), ")"), gpu_raw, raw_from_gpu, raw_tolerance[dtype]()) and ok
    comptime if dtype != DType.float32:
        # The FMA kernel too (the op uses tensor cores for this dtype when sizes allow; it reads no fp8 rows).
        var fma = GpuPlan.with_attention(problem, limits, FMA_ATTENTION)
        fma.num_partitions = 2
        if not sm90_only and not c.fp8:
            d.attention(ctx, c, fma, q_full_buf, raw_buf)
            ok = check_close("raw (FMA kernel, 2 partitions)", download[DType.float32](ctx, raw_buf, rows * c.rank), raw_from_gpu, raw_tolerance[dtype]()) and ok
        # The tensor-core shape for small kv_lora_rank (the op picks it only when the others do not fit).
        if sm90_only:
            pass
        elif attention_supported[dtype, MMA_FEW_HEADS_SMALL_RANK](c.key_dim, c.rank, c.page_size):
            var small = GpuPlan.with_attention(problem, limits, variant_index[MMA_FEW_HEADS_SMALL_RANK]())
            small.num_partitions = 2
            d.attention(ctx, c, small, q_full_buf, raw_buf)
            ok = check_close("raw (tensor cores 1 x 32 x 4, 2 partitions)", download[DType.float32](ctx, raw_buf, rows * c.rank), raw_from_gpu, raw_tolerance[dtype]()) and ok
        else:
            print("  raw: tensor cores 1 x 32 x 4 do not handle these sizes, skipped")
        # The Hopper kernels (wgmma; TMA with a producer warpgroup) on every case they support,
        # whatever the head count (the op takes the sm90 kernel from SM90_MIN_HEADS heads).
        comptime HOPPER = (WGMMA_SHAPE, SM90_SHAPE, NARROW_SHAPE)
        comptime for h in range(len(HOPPER)):
            comptime shape = HOPPER[h]
            var name = String("wgmma") if shape[2] == 0 else (String("sm90 TMA") if shape[2] == SM90_SHAPE[2] else String("sm90 narrow"))
            if sm90_only and shape[2] == 0:
                pass
            elif attention_supported[dtype, shape](c.key_dim, c.rank, c.page_size):
                for parts in [1, 3, SPLIT_BY_WORK]:
                    var pinned = GpuPlan.with_attention(problem, limits, variant_index[shape]())
                    pinned.num_partitions = parts
                    d.attention(ctx, c, pinned, q_full_buf, raw_buf)
                    ok = check_close(String("raw (", name, ", ", parts_label(parts), ")"), download[DType.float32](ctx, raw_buf, rows * c.rank), raw_from_gpu, raw_tolerance[dtype]()) and ok
                # The whole op pinned to it with PDL on (split by work, poisoned workspaces): the kernel's
                # wait before it reads q_full and the new cache rows.
                var d2 = DeviceCase[dtype](ctx, c)
                var pdl_plan = GpuPlan.with_attention(problem, limits, variant_index[shape]())
                pdl_plan.num_partitions = SPLIT_BY_WORK
                pdl_plan.pdl = True
                var pdl_att = ctx.enqueue_create_buffer[dtype](max(rows * c.rank, 1))
                poison_workspaces(ctx, c, d2, pdl_plan)
                ctx.enqueue_memset(pdl_att, nan[dtype]())
                d2.run_plan_storing(ctx, c, pdl_plan, pdl_att)
                ok = check_close(String("op attention output (", name, ", split by work, PDL on)"), download[dtype](ctx, pdl_att, rows * c.rank), raw_from_gpu, raw_tolerance[dtype]()) and ok
                _ = pdl_att^
            else:
                print("  raw:", name, "does not handle these sizes, skipped")
        if sm90_only:
            _ = q_full_buf^
            _ = raw_buf^
            _ = lse_buf^
            return ok
        # Restore the op's own raw for the output stage.
        d.attention(ctx, c, plan, q_full_buf, raw_buf)

    if sm90_only:  # float32: no sm90 kernel
        return ok
    var ref_out_stage = cpu_output(c, gpu_raw)
    for i in range(len(ref_out_stage)):
        ref_out_stage[i] = round_to[dtype](ref_out_stage[i])
    var att_out = ctx.enqueue_create_buffer[dtype](max(rows * c.rank, 1))
    comptime if dtype != DType.float32:
        var o_blocks = Granularity(c.gm, c.gn, c.gk).resolve(c.num_tokens, c.v_dim, c.rank)
        comptime for i in range(len(PROJ_TILES)):
            if proj_tile_supported(PROJ_TILES[i], c.v_dim, c.rank, o_blocks, limits.smem_per_block, False):
                var tiled = plan
                tiled.out_tile = i
                d.project_output(ctx, c, tiled, raw_buf, att_out)
                ok = check_parity[dtype](tile_label["output stage", i](), download[dtype](ctx, d.output, rows * c.v_dim), ref_out_stage) and ok
            else:
                print("  output stage: tile", i, "does not fit in shared memory or is the q step's alone, skipped")
        var fma_path = plan
        fma_path.out_tile = FMA_PATH
        d.project_output(ctx, c, fma_path, raw_buf, att_out)
        ok = check_parity[dtype]("output stage (FMA path)", download[dtype](ctx, d.output, rows * c.v_dim), ref_out_stage) and ok
    ctx.enqueue_memset(att_out, Scalar[dtype](0))
    d.project_output(ctx, c, plan, raw_buf, att_out)
    var gpu_out_stage = download[dtype](ctx, d.output, rows * c.v_dim)
    ok = check_parity[dtype]("output stage", gpu_out_stage, ref_out_stage) and ok
    # The attention output the op stores on request: raw as dtype, exactly.
    ok = check_close("attention output store", download[dtype](ctx, att_out, rows * c.rank), gpu_raw, 0) and ok
    # Step 6 alone (first_step 6) from that attention output: the op's own step 6, exactly,
    # with programmatic dependent launch (PDL) off and on.
    for pdl in [False, True]:
        ctx.enqueue_memset(d.output, Scalar[dtype](0))
        d.project_only(ctx, c, att_out, pdl)
        var name = String("step 6 alone (first_step 6", ", PDL" if pdl else "", ")")
        ok = check_close(name, download[dtype](ctx, d.output, rows * c.v_dim), gpu_out_stage, 0) and ok

    # The whole op on fresh inputs against the CPU pipeline, with its planned partitions and split by
    # work (the schedule kernel before the q step, a merge, so step 6's quantization in the merge
    # too), each with programmatic dependent launch
    # (PDL) on and off and the quantization in the merge on and off (`GpuPlan.pdl`,
    # `quantize_in_merge`), the schedule built in the q step's launch or its own (with and without
    # PDL, `schedule_in_q_step`), the merge's two instances (`merge_ahead`, turned in modes 1 and 3). Per
    # partition count the four agree bit for bit: PDL changes only when a
    # kernel starts (a misplaced wait is a race that reads stale q_full, cache rows or raw), and the
    # merge quantizes by the output step's rule. The first run (PDL on) gets poisoned workspaces.
    var ref_raw = cpu_attention[dtype](c, ref_q_full, ref_blocks)
    var ref_out = cpu_output(c, ref_raw)
    for i in range(len(ref_out)):
        ref_out[i] = round_to[dtype](ref_out[i])
    var op_att = ctx.enqueue_create_buffer[dtype](max(rows * c.rank, 1))
    for parts in [PLANNED, SPLIT_BY_WORK]:
        var first_out = List[Float32]()
        var first_att = List[Float32]()
        var first_cache = List[Float32]()
        for mode in range(4):
            var pdl = mode == 0 or mode == 2
            var in_merge = mode < 2
            var in_q_step = mode == 0 or mode == 3  # the schedule: with and without PDL either way
            var d2 = DeviceCase[dtype](ctx, c)
            var op_plan = d2.plan(ctx, c)
            if parts != PLANNED:
                op_plan.num_partitions = parts
            op_plan.pdl = pdl
            op_plan.quantize_in_merge = in_merge
            op_plan.schedule_in_q_step = in_q_step
            if mode % 2 == 1:  # the merge's other instance (`merge_ahead`): the same bits
                op_plan.merge_ahead = not op_plan.merge_ahead
            if mode == 0:
                poison_workspaces(ctx, c, d2, op_plan)
            ctx.enqueue_memset(op_att, nan[dtype]())
            d2.run_plan_storing(ctx, c, op_plan, op_att)
            var out = download[dtype](ctx, d2.output, rows * c.v_dim)
            var att = download[dtype](ctx, op_att, rows * c.rank)
            var cache_after = cache_state[dtype](ctx, c, d2)  # fp8: the rows' bytes
            var tag = String(
                " (", parts_label(parts), ", PDL ", "on" if pdl else "off",
                ", quantized in the merge" if in_merge else "", ", schedule in the q step" if in_q_step else "",
                ", merge ahead" if op_plan.merge_ahead else "", ")",
            )
            if mode == 0:
                comptime if dtype == DType.float32:
                    ok = check_parity[dtype](String("op output", tag), out, ref_out) and ok
                else:
                    # End to end, step 6 re-quantizes an attention output that differs by the rounding of
                    # the probabilities: pymla/parity.py's end-to-end element bound (2 ulp + 2^-5).
                    ok = check_close(String("op output (end to end)", tag), out, ref_out, 2 * ulp_of[dtype]() + Float32(2.0) ** -5) and ok
                ok = check_close(String("op attention output", tag), att, raw_from_gpu, raw_tolerance[dtype]()) and ok
                if c.fp8:
                    ok = check_fp8_rows(String("cache (fp8 rows, op)", tag), c, download_u8(ctx, d2.fp8_bytes), want_bytes) and ok
                else:
                    ok = check_cache[dtype](c, cache_after, ref_blocks) and ok
                first_out = out^
                first_att = att^
                first_cache = cache_after^
            else:
                ok = check_close(String("op output, bit for bit", tag), out, first_out, 0) and ok
                ok = check_close(String("op attention output, bit for bit", tag), att, first_att, 0) and ok
                ok = check_close(String("cache, bit for bit", tag), cache_after, first_cache, 0) and ok
    _ = op_att^
    _ = q_full_buf^
    _ = raw_buf^
    _ = att_out^
    _ = lse_buf^
    return ok


def ints(*values: Int) -> List[Int]:
    var out = List[Int]()
    for v in values:
        out.append(v)
    return out^


def correctness(ctx: DeviceContext, only: String) raises -> Bool:
    """Every case; `only` "fp8": the fp8_ds_mla cache's cases alone; "sm90": the sm90 kernel's raw checks alone."""
    if only == "fp8":
        return fp8_cases(ctx)
    var sm90_only = only == "sm90"
    var ok = True
    ok = run_case[DType.bfloat16](ctx, sm90_only, "decode bf16", Case.__init__[DType.bfloat16](1, 16, ints(130, 1, 0, 64), ints(1, 4, 2, 1))) and ok
    ok = run_case[DType.float32](ctx, sm90_only, "decode f32", Case.__init__[DType.float32](2, 16, ints(130, 1, 0, 64), ints(1, 4, 2, 1))) and ok
    ok = run_case[DType.float16](ctx, sm90_only, "decode f16 page 1", Case.__init__[DType.float16](3, 8, ints(40, 7), ints(2, 1), page_size=1)) and ok
    ok = run_case[DType.bfloat16](ctx, sm90_only, "zero-token request", Case.__init__[DType.bfloat16](4, 16, ints(12, 50, 7), ints(2, 0, 1))) and ok
    ok = run_case[DType.bfloat16](
        ctx, sm90_only, "alibi, 3 heads, null mask", Case.__init__[DType.bfloat16](5, 3, ints(20, 33), ints(3, 1), mask_kind=0, score_mod=1)
    ) and ok
    ok = run_case[DType.float32](
        ctx, sm90_only, "sliding window", Case.__init__[DType.float32](6, 16, ints(100, 5), ints(2, 3), mask_kind=2, window=17)
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, sm90_only, "chunked, per_tensor", Case.__init__[DType.bfloat16](7, 20, ints(70, 9), ints(4, 2), mask_kind=3, window=32, gm=0, gn=0, gk=0)
    ) and ok
    ok = run_case[DType.float32](
        ctx, sm90_only, "per_channel, small dims",
        Case.__init__[DType.float32](8, 4, ints(10, 31), ints(1, 2), rank=256, nope=64, rope=32, v_dim=64, gm=1, gn=1, gk=0),
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, sm90_only, "odd blocks (3, 20, 24)", Case.__init__[DType.bfloat16](9, 6, ints(25, 3), ints(5, 2), gm=3, gn=20, gk=24)
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, sm90_only, "long context", Case.__init__[DType.bfloat16](10, 16, ints(4000), ints(2), page_size=64)
    ) and ok
    # Step 5 split by work: a long request beside short and empty ones gets more partitions.
    ok = run_case[DType.bfloat16](
        ctx, sm90_only, "long beside short", Case.__init__[DType.bfloat16](14, 16, ints(3000, 40, 0, 700), ints(1, 2, 1, 3))
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, sm90_only, "128 heads", Case.__init__[DType.bfloat16](11, 128, ints(300, 17), ints(1, 2), page_size=64)
    ) and ok
    # Small dims on tensor cores: per-channel K blocks of 64 (q) and 256 (output: two float32x4
    # slots per lane and item in `stage_activations`).
    ok = run_case[DType.bfloat16](
        ctx, sm90_only, "per_channel, small dims, bf16",
        Case.__init__[DType.bfloat16](13, 4, ints(10, 31), ints(1, 2), rank=256, nope=64, rope=32, v_dim=64, gm=1, gn=1, gk=0),
    ) and ok
    # Rope 24: the q step's rope of q pair by pair (rows not 16-byte aligned), a short last item per row.
    ok = run_case[DType.bfloat16](
        ctx, sm90_only, "rope 24, q rope pair by pair",
        Case.__init__[DType.bfloat16](26, 4, ints(10, 31), ints(1, 2), rank=256, nope=64, rope=24, v_dim=64, gm=1, gn=1, gk=0),
    ) and ok
    # Several row tiles of every projection tile shape (73 tokens), f16, per-channel scales.
    ok = run_case[DType.float16](
        ctx, sm90_only, "73 tokens, per_channel", Case.__init__[DType.float16](12, 4, ints(5, 60, 0), ints(33, 40, 0), gm=1, gn=1, gk=0)
    ) and ok
    return fp8_cases(ctx) and ok


comptime WIDEN_SCALES = 136  # 2^-126 ..= 2^7, which widen_pow2 serves, then 2^8 and 0.75 (dequantize8's alone)


def widen_check_kernel(bytes: DPtr[DType.uint8], fast: DPtr[DType.bfloat16], slow: DPtr[DType.bfloat16]):
    """Thread `t`: every e4m3 byte times scale `t` (`2^(t - 126)`, then 0.75), both ways."""
    var t = Int(thread_idx.x)
    var scale = Float32(0.75) if t == WIDEN_SCALES - 1 else bitcast[DType.float32](UInt32(t + 1) << 23)
    var mult = pow2_multiplier(scale)
    for c in range(32):
        var raw = bytes.unsafe_offset(8 * c).unsafe_load[width=8](0)
        var want = dequantize8[DType.bfloat16](raw, scale)
        var got = widen_pow2(raw, mult) if mult != 0 else want
        fast.unsafe_offset(t * 256 + 8 * c).unsafe_store(0, got)
        slow.unsafe_offset(t * 256 + 8 * c).unsafe_store(0, want)


def check_widen_pow2(ctx: DeviceContext) raises -> Bool:
    """The fp8 kernels' power-of-two widening (`widen_pow2`) against `dequantize8` bit for bit: every e4m3
    byte but NaN, every scale it serves (subnormal inputs and results included), and that it refuses the
    scales it cannot serve (2^8, 0.75)."""
    var host = List[UInt8](length=256, fill=0)
    for i in range(256):
        host[i] = UInt8(i)
    var bytes = upload_u8(ctx, host)
    var fast = ctx.enqueue_create_buffer[DType.bfloat16](WIDEN_SCALES * 256)
    var slow = ctx.enqueue_create_buffer[DType.bfloat16](WIDEN_SCALES * 256)
    ctx.enqueue_function[widen_check_kernel](untracked(bytes), untracked(fast), untracked(slow), grid_dim=1, block_dim=WIDEN_SCALES)
    var got = List[BFloat16](length=WIDEN_SCALES * 256, fill=0)
    var want = List[BFloat16](length=WIDEN_SCALES * 256, fill=0)
    ctx.enqueue_copy(dst_ptr=got.unsafe_ptr(), src_buf=fast)
    ctx.enqueue_copy(dst_ptr=want.unsafe_ptr(), src_buf=slow)
    ctx.synchronize()
    var differ = 0
    var subnormal = 0
    for t in range(WIDEN_SCALES):
        for i in range(256):
            if i % 128 == 127:
                continue  # NaN bytes: widen_pow2 reads 480 times the scale (documented)
            var g = bitcast[DType.uint16](got[t * 256 + i])
            if g != bitcast[DType.uint16](want[t * 256 + i]):
                differ += 1
            if g & 0x7F80 == 0 and g & 0x7F != 0:
                subnormal += 1
    var refused = pow2_multiplier(Float32(256.0)) == 0 and pow2_multiplier(Float32(0.75)) == 0 and pow2_multiplier(Float32(128.0)) != 0
    return report(
        "widen_pow2 vs dequantize8",
        differ == 0 and subnormal > 0 and refused,
        String(differ, " of ", WIDEN_SCALES * 254, " values differ; ", subnormal, " subnormal results; 2^8 and 0.75 refused, 2^7 served: ", refused),
    )


def fp8_cases(ctx: DeviceContext) raises -> Bool:
    # The fp8_ds_mla cache (bfloat16 ops): 16 heads (mma.sync) and 128 (wgmma), ragged, masks, page sizes 1 / 16 / 64;
    # every case also runs 1 and 3 partitions and the pinned tensor-core kernels.
    var ok = check_widen_pow2(ctx)
    ok = run_case[DType.bfloat16](
        ctx, False, "fp8 cache, 16 heads", Case.__init__[DType.bfloat16](20, 16, ints(130, 1, 0, 64), ints(1, 4, 2, 1), fp8=True)
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, False, "fp8 cache, 128 heads, page 64",
        Case.__init__[DType.bfloat16](21, 128, ints(300, 17), ints(1, 2), page_size=64, fp8=True),
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, False, "fp8 cache, page 1, sliding window",
        Case.__init__[DType.bfloat16](22, 16, ints(40, 7), ints(2, 1), page_size=1, mask_kind=2, window=9, fp8=True),
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, False, "fp8 cache, alibi, null mask, 32 heads",
        Case.__init__[DType.bfloat16](23, 32, ints(20, 33, 0), ints(3, 1, 2), mask_kind=0, score_mod=1, fp8=True),
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, False, "fp8 cache, chunked, long context",
        Case.__init__[DType.bfloat16](24, 16, ints(2000, 9), ints(2, 3), page_size=64, mask_kind=3, window=32, fp8=True),
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, False, "fp8 cache, scales not powers of two on some rows, 16 heads",
        Case.__init__[DType.bfloat16](26, 16, ints(300, 70), ints(1, 2), page_size=64, fp8=True, odd_scales=True),
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, False, "fp8 cache, scales not powers of two on some rows, 128 heads",
        Case.__init__[DType.bfloat16](27, 128, ints(130, 20), ints(1, 1), page_size=64, fp8=True, odd_scales=True),
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, False, "fp8 cache, small dims (R 256, Dr 32)",
        Case.__init__[DType.bfloat16](25, 4, ints(10, 31), ints(1, 2), rank=256, nope=64, rope=32, v_dim=64, fp8=True),
    ) and ok
    return ok


comptime DIVISOR_THREADS = 256


def divisor_check_kernel(scales: GFPtr, bad: GlobalPtr[UInt32]):
    """Block `b`: `Divisor.of(d)` with `d = scales[b]` against `x / d`, for every bfloat16 `x` and 65536
    float32 `x` (hashed mantissas, magnitudes 2^-31 .. 1 of 448 d) with `|x| <= 448 d`. A thread counts
    the `x` whose e4m3 bytes differ, or whose float32 quotients differ from 2^-12 up, into `bad`."""
    var d = scales.unsafe_load(block_idx.x)
    var div = Divisor.of(d)
    var count = UInt32(0)
    for i in range(thread_idx.x, 2 * 65536, DIVISOR_THREADS):
        var x: Float32
        if i < 65536:
            x = bitcast[DType.bfloat16](UInt16(i)).cast[DType.float32]()
        else:
            var h = (UInt32(i) * 2654435761) ^ (UInt32(block_idx.x) * 40503)
            h ^= h >> 15
            h *= 2246822519
            var unit = bitcast[DType.float32]((h & 0x007FFFFF) | 0x3F800000) - 1  # [0, 1), 23 bits
            var sign = Float32(-1) if (h >> 31) != 0 else Float32(1)
            x = sign * unit * (FP8_MAX * d) * bitcast[DType.float32](UInt32(127 - Int((h >> 23) & 31)) << 23)
        if abs(x) <= FP8_MAX * d:
            var want = x / d
            var got = div.quotient[1](x)[0]
            var want8 = into_e4m3_range[1](want).cast[DType.float8_e4m3fn]()
            var got8 = into_e4m3_range[1](got).cast[DType.float8_e4m3fn]()
            var f32_differs = bitcast[DType.uint32](got) != bitcast[DType.uint32](want) and abs(want) >= DIVISOR_EXACT_FROM
            if bitcast[DType.uint8](got8) != bitcast[DType.uint8](want8) or f32_differs:
                count += 1
    bad.unsafe_store(block_idx.x * DIVISOR_THREADS + thread_idx.x, count)


def divisor_check(ctx: DeviceContext) raises -> Bool:
    """`divisor_check_kernel` over the scales of 1020 amax values: every float32 exponent field (0: zero and
    subnormals) with four mantissas (0 and three hashed), `activation_scale` as the quantizations take it."""
    var scales = List[Float32]()
    for e in range(255):
        for j in range(4):
            var m = UInt32(0) if j == 0 else ((UInt32(e * 4 + j) * 2654435761) >> 9) & 0x007FFFFF
            scales.append(activation_scale(bitcast[DType.float32]((UInt32(e) << 23) | m)))
    var scales_d = upload[DType.float32](ctx, scales)
    var bad_d = ctx.enqueue_create_buffer[DType.uint32](len(scales) * DIVISOR_THREADS)
    ctx.enqueue_function[divisor_check_kernel](
        to_global(scales_d.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()),
        to_global(bad_d.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()),
        grid_dim=len(scales), block_dim=DIVISOR_THREADS,
    )
    var bad = List[UInt32](length=len(scales) * DIVISOR_THREADS, fill=0)
    ctx.enqueue_copy(dst_ptr=bad.unsafe_ptr(), src_buf=bad_d)
    ctx.synchronize()
    var total = 0
    for c in bad:
        total += Int(c)
    return report(
        "Divisor against x / d (e4m3 bytes, float32 quotients from 2^-12 up)", total == 0,
        String(len(scales), " scales x (65536 bfloat16 + 65536 float32 x): ", total, " differ"),
    )


def main() raises:
    comptime if not has_accelerator():
        print("gpu_smoke: no GPU in this build (compile with --target-accelerator=sm_90 on a GPU machine)")
        return
    else:
        var args = argv()
        var only = String(args[1]) if len(args) > 1 else String("")
        if only != "" and only != "sm90" and only != "fp8":
            raise Error(String("gpu_smoke: unknown argument '", only, "' (none: every check; sm90: the sm90 kernel's alone; fp8: the fp8 cache's cases alone)"))
        var ctx = DeviceContext()
        var ok = correctness(ctx, only)
        ok = divisor_check(ctx) and ok
        print("ALL PASS" if ok else "SOME CHECKS FAILED")
        if not ok:
            raise Error("gpu_smoke failed")
