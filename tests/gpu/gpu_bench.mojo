# GPU timings of mojo_kernels/gpu/ (no correctness checks: tests/gpu/gpu_smoke.mojo).
#
# Run on a machine with an NVIDIA GPU, from the repository root; configurations are
# BATCH:HEADS:CACHE_LEN[:ITERS[:FLAG...]] (one new token per request, bf16; `fp8`: the configuration
# with a bf16 cache, then with an fp8_ds_mla cache, side by side; `fp8-only`: the fp8_ds_mla cache
# alone; `one-long`: the first request CACHE_LEN, the others CACHE_LEN // 16; `plan-only`: `bench` times the
# op's plan alone, not also the plans with one choice turned; the cache's rows are copies
# of 4096 drawn rows, `decode_case`: 64 requests of 8k keys build in 1.7 s (bf16) / 2.5 s (fp8 rows) on a
# 2-core AMD EPYC, 2026-12-06, where drawing every row takes about 24 ns a value):
#     mojo run -I . tests/gpu/gpu_bench.mojo bench 64:128:8191:5       # the copy rate, then the whole op on these
#                                                                      # configurations: the op's plan and each plan
#                                                                      # choice turned, alternating (`bench` below)
#     mojo run -I . tests/gpu/gpu_bench.mojo variants 64:128:8191:5    # step 5 alone: the op's plan, then pinned kernels
#     mojo run -I . tests/gpu/gpu_bench.mojo both 64:128:8191:5        # step 5 alone (the op's plan, its kernel
#                                                                      # without a split),
#                                                                      # then the whole op, on one random case per
#                                                                      # configuration (scripts/device_gpu_vs_peers.sh)
#     mojo run -I . tests/gpu/gpu_bench.mojo bench 64:128:4095:5:fp8   # the whole op, bf16 cache then fp8_ds_mla cache
#     mojo run -I . tests/gpu/gpu_bench.mojo proj 64:128:0:50          # steps 1-4 on q and step 6 alone, every tile shape

from std.sys import argv, has_accelerator, size_of
from std.time import perf_counter_ns

from max.gpu.host import DeviceBuffer, DeviceContext

from mojo_kernels.gpu.pipeline import (
    AttentionWorkspace,
    cache_rows_params,
    gpu_attention_into,
    gpu_attention_with,
    out_step_params,
    q_step_params,
)
from mojo_kernels.gpu.params import DeviceBatch, to_global
from mojo_kernels.gpu.schedule import ScheduleParams
from mojo_kernels.gpu.steps_fused import enqueue_out_step, enqueue_q_step, is_wg_tile, tile_cols
from mojo_kernels.gpu.projection_mma import QuantizedRows
from mojo_kernels.gpu.plan import (
    FMA_PATH,
    PROJ_TILES,
    DeviceLimits,
    ATTENTION_VARIANTS,
    SPLIT_BY_WORK,
    GpuPlan,
    attention_rows_per_block,
    attention_split,
    proj_tile_supported,
)

from gpu_case import Case, DeviceCase, Rng, decode_case, download, round_to, untracked, upload


def time_us(ctx: DeviceContext, start: Int) raises -> Float64:
    ctx.synchronize()
    return Float64(perf_counter_ns() - start) / 1000.0


def bench_copy(ctx: DeviceContext, iters: Int) raises:
    """The device-to-device copy rate (bytes read + written per second): the HBM yardstick."""
    comptime N = 1 << 28  # 1 GiB of float32
    var src = ctx.enqueue_create_buffer[DType.float32](N)
    var dst = ctx.enqueue_create_buffer[DType.float32](N)
    ctx.enqueue_memset(src, Float32(1))
    ctx.enqueue_copy(dst_buf=dst, src_buf=src)
    ctx.synchronize()
    var t0 = perf_counter_ns()
    for _ in range(iters):
        ctx.enqueue_copy(dst_buf=dst, src_buf=src)
    var s = time_us(ctx, t0) / 1e6 / Float64(iters)
    print("copy", 2.0 * Float64(N * 4) / s / 1e9, "GB/s (bytes read + written, 1 GiB device-to-device)")


def cache_row_bytes[dtype: DType](c: Case) -> Int:
    """Bytes per cache row: of dtype values, or an fp8_ds_mla row."""
    return c.row_bytes if c.fp8 else c.key_dim * size_of[dtype]()


def cache_label(c: Case) -> String:
    return String("fp8_ds_mla cache") if c.fp8 else String("dtype cache")


def time_op[dtype: DType](ctx: DeviceContext, c: Case, d: DeviceCase[dtype], plan: GpuPlan, iters: Int) raises -> Float64:
    """Microseconds per call of the whole op under `plan`, `iters` calls back to back after one warm-up."""
    d.run_plan(ctx, c, plan)
    ctx.synchronize()
    var t0 = perf_counter_ns()
    for _ in range(iters):
        d.run_plan(ctx, c, plan)
    return time_us(ctx, t0) / Float64(iters)


def visible_keys(c: Case) -> Int:
    """Keys the decode step's requests see in all: cached and new."""
    var keys = 0
    for b in range(c.num_requests):
        keys += Int(c.lengths[b]) + Int(c.offsets[b + 1] - c.offsets[b])
    return keys


def shape_label(batch: Int, heads: Int, cache_len: Int, one_long: Bool) -> String:
    """`B b H h L l`; `one-long B ...` (the first request L, the others L/16: not a line the results
    scripts read as a uniform batch)."""
    return String("one-long " if one_long else "", "B ", batch, " H ", heads, " L ", cache_len + 1)


def split_label(plan: GpuPlan) -> String:
    """How the plan splits step 5's keys."""
    if plan.num_partitions == SPLIT_BY_WORK:
        return String("split by work")
    if plan.num_partitions == 1:
        return String("1 partition")
    return String(plan.num_partitions, " partitions")


def bench[
    dtype: DType
](ctx: DeviceContext, c: Case, d: DeviceCase[dtype], shape: String, iters: Int, plans: Int = 4) raises:
    """Times the whole op on decode step `c` (`shape`: its label; an fp8_ds_mla cache where `c` has one):
    the op's plan, and (`plans` 4) the plan with one choice turned the other way each (programmatic
    dependent launch, `GpuPlan.pdl`; step 6's quantization in step 6, not the merge,
    `quantize_in_merge`; the split schedule in a launch of its own, not the q step's,
    `schedule_in_q_step`), the four alternating, two rounds: an A/B in one process. `plans` 1: the
    op's plan alone (the `plan-only` flag: builds compared by `device_kernel_profile.sh ab`)."""
    var cache_bytes = Float64(visible_keys(c) * cache_row_bytes[dtype](c))
    var weight_bytes = Float64(len(c.w_uk.bytes) + len(c.w_uv.bytes))
    var flops = 2.0 * Float64(c.heads) * Float64(visible_keys(c)) * Float64(c.key_dim + c.rank)
    var best = [Float64(1e30), Float64(1e30), Float64(1e30), Float64(1e30)]
    var names = List[String]()
    for mode in range(plans):
        names.append(plan_label(plan_mode(d.plan(ctx, c), mode)))
    for _ in range(2):
        for mode in range(plans):
            var plan = plan_mode(d.plan(ctx, c), mode)  # the op's own, one choice turned
            var us = time_op[dtype](ctx, c, d, plan, iters)
            best[mode] = min(best[mode], us)
            print(
                "bench", dtype, cache_label(c), shape, "(", names[mode], ", ", split_label(plan),
                " ) :", us, "us per call,", (cache_bytes + weight_bytes) / us / 1e3, "GB/s of cache+weights,",
                flops / us / 1e6, "TFLOP/s attention",
            )
    for mode in range(plans):
        print("  best of 2,", cache_label(c), names[mode], ":", best[mode], "us (", best[mode] - best[0], "us vs the op's plan )")


def plan_mode(plan: GpuPlan, mode: Int) -> GpuPlan:
    """`plan` (mode 0), or with its PDL (1), where step 6 quantizes (2), or where the schedule is built (3) turned."""
    var turned = plan
    if mode == 1:
        turned.pdl = not plan.pdl
    elif mode == 2:
        turned.quantize_in_merge = not plan.quantize_in_merge
    elif mode == 3:
        turned.schedule_in_q_step = not plan.schedule_in_q_step
    return turned


def plan_label(plan: GpuPlan) -> String:
    """`PDL on|off, quantize in merge|step 6, schedule in q step|alone` (pymla/tools/gpu_bench_json.py reads it)."""
    return String(
        "PDL ", "on" if plan.pdl else "off", ", quantize in ", "merge" if plan.quantize_in_merge else "step 6",
        ", schedule ", "in q step" if plan.schedule_in_q_step else "alone",
    )


comptime OP_PLAN = (-1, 0, 0)
"""`bench_attention`'s variant for the op's own plan."""
comptime NO_SPLIT = (-2, 0, 0)
"""`bench_attention`'s variant for the op's kernel without a split: one block per row slot with all of
its request's keys, no schedule, no merge (the op's plan before it always split by work, where a
uniform split would have given one partition)."""


def bench_attention[
    dtype: DType, v: Tuple[Int, Int, Int]
](
    ctx: DeviceContext, c: Case, d: DeviceCase[dtype], q_full: DeviceBuffer[DType.float32],
    raw: DeviceBuffer[DType.float32], iters: Int, expected: List[Float32],
) raises:
    """Times step 5 alone with attention kernel `v` (groups, keys per tile, warps per group; OP_PLAN: the op's
    plan), its key partitions planned for it."""
    var problem = d.problem(c)
    var limits = DeviceLimits.read(ctx)
    var plan = GpuPlan.create(problem, limits)
    comptime if v == NO_SPLIT:
        plan.num_partitions = 1
    comptime if v[0] >= 0:  # a pinned variant: its own rows per block and split
        plan.rows_per_block = attention_rows_per_block(v)
        var split = attention_split(problem, v, limits)
        plan.num_partitions = split[0]
        plan.split_target = split[1]
    var ws = AttentionWorkspace(ctx, problem, plan)
    ws.build_schedule(ctx, problem)
    var t0 = 0
    for it in range(iters + 1):  # the first run is a warm-up
        if it == 1:
            ctx.synchronize()
            t0 = perf_counter_ns()
        comptime if v[0] < 0:
            gpu_attention_into[dtype](ctx, problem, plan, untracked(q_full), untracked(raw), ws, QuantizedRows.none(to_global(untracked(raw))))
        else:
            gpu_attention_with[dtype, v](ctx, problem, untracked(q_full), untracked(raw), ws, False, False, QuantizedRows.none(to_global(untracked(raw))))
    var us = time_us(ctx, t0) / Float64(iters)
    var cache_bytes = Float64(visible_keys(c) * cache_row_bytes[dtype](c))
    var line = String(
        "  attention groups ", v[0], " kt ", v[1], " warps/group ", v[2], " : ", us, " us, ", cache_bytes / us / 1e3,
        " GB/s of cache",
    )
    comptime if v[0] < 0:
        var name = "op's plan" if v == OP_PLAN else "op's kernel, no split"
        line = String("  attention ", name, " (variant ", plan.attention, ", ", split_label(plan), ") : ", us,
                      " us, ", cache_bytes / us / 1e3, " GB/s of cache")
    if len(expected) > 0:  # a pinned variant: compared with the op's own kernel
        var got = download[DType.float32](ctx, raw, c.num_tokens * c.heads * c.rank)
        var top = Float32(0)
        for i in range(len(expected)):
            top = max(top, abs(expected[i]))
        line += String("; max |diff| vs the op's kernel ", max_diff(got, expected) / top, " x max|raw|")
    print(line)


def bench_variants[
    dtype: DType
](ctx: DeviceContext, c: Case, d: DeviceCase[dtype], shape: String, iters: Int, pinned: Bool = True) raises:
    """Step 5 alone on decode step `c` (`shape`: its label): the op's plan, its kernel without a split, and
    (`pinned`) every attention kernel pinned."""
    var rows = c.num_tokens * c.heads
    var q_host = List[Float32]()
    var rng = Rng(5)
    for _ in range(rows * c.key_dim):
        q_host.append(rng.normal())
    var q_full = upload[DType.float32](ctx, q_host)
    var raw = ctx.enqueue_create_buffer[DType.float32](rows * c.rank)
    print("variants", cache_label(c), shape)
    bench_attention[dtype, OP_PLAN](ctx, c, d, q_full, raw, iters, List[Float32]())
    var expected = download[DType.float32](ctx, raw, rows * c.rank)
    bench_attention[dtype, NO_SPLIT](ctx, c, d, q_full, raw, iters, expected)
    if not pinned:
        return
    # (groups, kt, warps per group; 0: the warpgroup kernel, -1: the sm90 TMA kernel, -2: the narrow TMA
    # kernel): a launch that asks for too many registers is reported, not fatal.
    comptime VARIANTS = [
        (1, 32, 4), (2, 32, 4), (2, 64, 4), (1, 32, 8), (1, 64, 8), (4, 32, 0), (4, 64, 0), (4, 64, -1), (1, 64, -2)
    ]
    comptime for v in VARIANTS:
        try:
            bench_attention[dtype, v](ctx, c, d, q_full, raw, iters, expected)
        except e:
            print("  attention groups", v[0], "kt", v[1], "warps/group", v[2], ": launch failed:", e)


def bench_proj_plan[dtype: DType](
    ctx: DeviceContext, c: Case, d: DeviceCase[dtype], plan: GpuPlan, name: String, q_full: DeviceBuffer[DType.float32],
    raw: DeviceBuffer[DType.float32], att_out: DeviceBuffer[dtype], iters: Int,
) raises:
    """Times steps 1-4 on q (`gpu_build_q_full`) and step 6 (`gpu_project_output`) alone under `plan`."""
    d.build_q_full(ctx, c, plan, q_full)
    ctx.synchronize()
    var t0 = perf_counter_ns()
    for _ in range(iters):
        d.build_q_full(ctx, c, plan, q_full)
    var q_us = time_us(ctx, t0) / Float64(iters)
    d.project_output(ctx, c, plan, raw, att_out)
    ctx.synchronize()
    t0 = perf_counter_ns()
    for _ in range(iters):
        d.project_output(ctx, c, plan, raw, att_out)
    var o_us = time_us(ctx, t0) / Float64(iters)
    print("  ", name, ": q_full", q_us, "us, output (+attention output)", o_us, "us")


def bench_proj[dtype: DType](ctx: DeviceContext, batch: Int, heads: Int, iters: Int) raises:
    """Steps 1-4 on q and step 6 alone on one decode step (one token per request), every tile shape."""
    var c = decode_case[dtype](batch, heads, 15)
    var d = DeviceCase[dtype](ctx, c)
    var rows = c.num_tokens * c.heads
    var q_full = ctx.enqueue_create_buffer[DType.float32](rows * c.key_dim)
    var raw_host = List[Float32]()
    var rng = Rng(7)
    for _ in range(rows * c.rank):
        raw_host.append(round_to[dtype](rng.normal()))
    var raw = upload[DType.float32](ctx, raw_host)
    var att_out = ctx.enqueue_create_buffer[dtype](rows * c.rank)
    print("proj B", batch, "H", heads, "(time per call, launch included)")
    var plan = d.plan(ctx, c)
    bench_proj_plan[dtype](ctx, c, d, plan, "op's choice", q_full, raw, att_out, iters)
    comptime for i in range(len(PROJ_TILES)):
        comptime t = PROJ_TILES[i]
        var tiled = plan
        tiled.q_tile = i
        comptime if not is_wg_tile(t):  # a wgmma tile: the q step's alone, the output step the op's
            tiled.out_tile = i
        bench_proj_plan[dtype](ctx, c, d, tiled, String("tile ", t[0], "x", t[1], "x", t[2], "x", t[3]), q_full, raw, att_out, iters)
    var fma = plan
    fma.q_tile = FMA_PATH
    fma.out_tile = FMA_PATH
    bench_proj_plan[dtype](ctx, c, d, fma, "FMA path", q_full, raw, att_out, iters)
    # The op's choice again, as the reference of the candidates' results.
    d.build_q_full(ctx, c, plan, q_full)
    d.project_output(ctx, c, plan, raw, att_out)
    var want_q = download[DType.float32](ctx, q_full, rows * c.key_dim)
    var want_out = download[dtype](ctx, d.output, c.num_tokens * c.heads * c.v_dim)
    comptime for i in range(len(CANDIDATE_TILES)):
        bench_candidate_tile[dtype, CANDIDATE_TILES[i]](ctx, c, d, q_full, raw, att_out, iters, want_q, want_out)


comptime CANDIDATE_TILES = [(1, 8, 1, 4), (1, 8, 1, 8), (1, 4, 1, 16)]
"""Projection tiles outside PROJ_TILES that `bench proj` times beside them: a head's whole weight tile per
block (the q step's 512 columns: 1x8x1x8, 1x4x1x16, or half of them: 1x8x1x4), so each head's
weights are read once and its activations quantized once (today's small tiles re-stage them per
column tile). 1x4x1x4 (the output step's 128 columns) joined PROJ_TILES. 2x8x1x8 (16 warps) was dropped: its launch asks for more registers than an SM has
(H100, CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES). A tile joins PROJ_TILES (and the plan's choice) only after it is measured faster."""


def max_diff(got: List[Float32], want: List[Float32]) -> Float32:
    """The largest `|got - want|`, 1e30 where one is NaN."""
    var diff = Float32(0)
    for i in range(len(got)):
        var e = abs(got[i] - want[i])
        diff = max(diff, e if e == e else Float32(1e30))
    return diff


def bench_candidate_tile[
    dtype: DType, tile: Tuple[Int, Int, Int, Int]
](
    ctx: DeviceContext, c: Case, d: DeviceCase[dtype], q_full: DeviceBuffer[DType.float32],
    raw: DeviceBuffer[DType.float32], att_out: DeviceBuffer[dtype], iters: Int, want_q: List[Float32],
    want_out: List[Float32],
) raises:
    """Times steps 1-4 on q and step 6 with projection tile `tile` (where it fits), each checked against the
    op's choice (`want_q`, `want_out`: the same quantization rule, so equal bit for bit)."""
    var p = d.problem(c)
    var limits = DeviceLimits.read(ctx)
    var q_blocks = p.granularity.resolve(p.num_tokens, p.kv_lora_rank, p.nope_dim)
    var out_blocks = p.granularity.resolve(p.num_tokens, p.v_head_dim, p.kv_lora_rank)
    var line = String("   tile ", tile[0], "x", tile[1], "x", tile[2], "x", tile[3], " (candidate) :")
    if proj_tile_supported(tile, p.kv_lora_rank, p.nope_dim, q_blocks, limits.smem_per_block, True):
        var params = q_step_params(p, untracked(q_full), cache_rows_params(p, 0), ScheduleParams.nothing(DeviceBatch.of(p.batch)))
        enqueue_q_step[dtype, tile](ctx, params, p.num_heads)
        ctx.synchronize()
        var t0 = perf_counter_ns()
        for _ in range(iters):
            enqueue_q_step[dtype, tile](ctx, params, p.num_heads)
        line += String(" q_full ", time_us(ctx, t0) / Float64(iters), " us (max |diff| vs the op's choice ")
        line += String(max_diff(download[DType.float32](ctx, q_full, len(want_q)), want_q), ")")
    else:
        line += " q_full: does not fit in shared memory or take these sizes"
    comptime if is_wg_tile(tile):
        line += ", output: the q step's tile alone"
        print(line)
        return
    if tile_cols(tile) <= p.v_head_dim and proj_tile_supported(
        tile, p.v_head_dim, p.kv_lora_rank, out_blocks, limits.smem_per_block, False
    ):
        p.attention_output = untracked(att_out)
        p.has_attention_output = True
        var params = out_step_params(p, untracked(raw), QuantizedRows.none(to_global(untracked(raw))))
        enqueue_out_step[dtype, tile](ctx, params, p.num_heads, False)
        ctx.synchronize()
        var t0 = perf_counter_ns()
        for _ in range(iters):
            enqueue_out_step[dtype, tile](ctx, params, p.num_heads, False)
        line += String(", output ", time_us(ctx, t0) / Float64(iters), " us (max |diff| vs the op's choice ")
        line += String(max_diff(download[dtype](ctx, d.output, len(want_out)), want_out), ")")
    else:
        line += ", output: wider than v_head_dim or does not fit"
    print(line)


def config_flag(config: String, flag: String) raises -> Bool:
    """Whether configuration `config` (BATCH:HEADS:CACHE_LEN[:ITERS[:FLAG...]]) has `flag`: `one-long` (the
    first request CACHE_LEN, the others CACHE_LEN // 16), `fp8` (the fp8_ds_mla cache too), `fp8-only`
    (the fp8_ds_mla cache alone) or `plan-only` (`bench`: the op's plan alone, not the turned plans)."""
    var f = config.split(":")
    var found = False
    for i in range(4, len(f)):
        var name = String(f[i])
        if name != "one-long" and name != "fp8" and name != "fp8-only" and name != "plan-only":
            raise Error("gpu_bench: a configuration's flags are one-long, fp8, fp8-only and plan-only, got ", name)
        found = found or name == flag
    return found


def main() raises:
    comptime if not has_accelerator():
        print("gpu_bench: no GPU in this build (compile with --target-accelerator=sm_90 on a GPU machine)")
        return
    else:
        var ctx = DeviceContext()
        var args = argv()
        var mode = String(args[1]) if len(args) > 1 else String("")
        # Configurations BATCH:HEADS:CACHE_LEN[:ITERS[:FLAG...]], e.g. 64:128:8191:5 or 8:16:8191:10:fp8
        # (`config_flag`: one-long, fp8)
        if mode == "proj":
            for i in range(2, len(args)):
                var f = String(args[i]).split(":")
                bench_proj[DType.bfloat16](ctx, Int(f[0]), Int(f[1]), Int(f[3]) if len(f) > 3 else 50)
        elif mode == "variants" or mode == "bench" or mode == "both":
            if mode != "variants":
                bench_copy(ctx, 10)
            for i in range(2, len(args)):
                var f = String(args[i]).split(":")
                var iters = Int(f[3]) if len(f) > 3 else 10
                var one_long = config_flag(String(args[i]), "one-long")
                var shape = shape_label(Int(f[0]), Int(f[1]), Int(f[2]), one_long)
                # the bf16 cache, then (`:fp8`) the fp8_ds_mla cache, side by side; `:fp8-only`: the latter
                var fp8_only = config_flag(String(args[i]), "fp8-only")
                var plans = 1 if config_flag(String(args[i]), "plan-only") else 4  # `bench`: the op's plan alone, or all 4
                var caches = List[Bool]()
                if not fp8_only:
                    caches.append(False)
                if fp8_only or config_flag(String(args[i]), "fp8"):
                    caches.append(True)
                for fp8 in caches:
                    # random inputs, no CPU reference (large); built once for both timings (`both`:
                    # drawing a 32k x 128 cache row by row would take about a minute on the host)
                    var c = decode_case[DType.bfloat16](Int(f[0]), Int(f[1]), Int(f[2]), one_long=one_long, fp8=fp8)
                    var d = DeviceCase[DType.bfloat16](ctx, c)
                    if mode != "bench":
                        bench_variants[DType.bfloat16](ctx, c, d, shape, iters, pinned=mode == "variants")
                    if mode != "variants":
                        bench[DType.bfloat16](ctx, c, d, shape, iters, plans)
        else:
            raise Error("gpu_bench: mode bench, variants, both or proj, then BATCH:HEADS:CACHE_LEN[:ITERS[:FLAG...]]...")
