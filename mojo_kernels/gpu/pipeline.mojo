"""GPU (NVIDIA sm_90) implementation of `pymla.mla_decode_branch_fp8`: the launchers of the six steps.

Same math as the CPU stages and `pymla/reference.py`, as a chain of small
kernels on the stream of the op's `DeviceContext` (entry:
`mla_decode_branch_fp8_gpu`, given the `DecodeProblem` that `execute` unpacked).
`plan.mojo` decides which kernels and shapes run (`GpuPlan`); this file
launches them; the kernels live in one file per concern:

1-4. `q_step_kernel`          (steps_fused.mojo) one launch for bf16 / f16: RMSNorm + RoPE of each
                                new token's cache row (extra blocks, `rope_norm_cache_row` of
                                rope_norm.mojo), RoPE of q's rope part into `q_full[:, :, R:]`, and
                                `q_full[:, :, :R] = fp8mm(q_nope, w_uk)` per head on tensor cores
                                (projection_mma.mojo: dynamic fp8 quantization of q_nope, the scale
                                rule of `pymla/quant.py` bit for bit, once per activation tile),
                                and one block of step 5's split schedule when the keys split
                                (schedule.mojo: which request, row slot and key partition each
                                attention block takes, by each request's share of the work)
     float32 (and tiles too large for shared memory): `schedule_kernel`, `rope_norm_cache_kernel`,
                                `rope_q_kernel` (rope_norm.mojo), `quantize_kernel` +
                                `fp8_matmul_kernel` (projection.mojo, float32 FMA)
5.   `attention_narrow_kernel`  (attention_narrow.mojo) Hopper, fp8_ds_mla rows at up to 16 heads:
                                the TMA kernel's pipeline with keys as the M of its wgmmas, 16
                                rows per block, or
     `attention_sm90_kernel`    (attention_sm90.mojo) Hopper: TMA key boxes from a producer
                                warpgroup, two math warpgroups (from SM90_MIN_HEADS heads), or
     `attention_wgmma_kernel`   (attention_wgmma.mojo) Hopper warpgroup tensor cores,
                                64 packed rows per block (many heads), or
     `attention_mma_kernel`     (attention_mma.mojo) tensor cores, bf16 / f16 caches, or
     `attention_fma_kernel`     (attention_fma.mojo) float32 FMA (float32 caches, other
                                sizes): one block per (request, tile of rows, key partition)
                                (a task of the schedule when the keys split);
                                all (token, head) rows of the block share each key tile
     `merge_kernel`             (merge.mojo) log-sum-exp merge of the key partitions
6.   `out_step_kernel`          (steps_fused.mojo) one launch for bf16 / f16: quantization of the
                                attention output + `fp8mm(raw, w_uv)` on tensor cores, and the
                                optional attention-output store; float32: `store_kernel` +
                                `quantize_kernel` + `fp8_matmul_kernel`.

An `fp8_ds_mla` cache (`p.fp8_cache`, bfloat16 ops): steps 1-2 quantize the new rows
(`rope_norm_fp8_row`), step 5 takes the tensor-core kernels' fp8 instances (the mma
and wgmma kernels widen each staged key tile into bfloat16, exactly, `KeyTiles`; the
TMA kernel's math warpgroups widen raw TMA slots into its bf16 stage); the FMA attention
kernel reads no fp8 rows (`check_fp8_shapes` refuses sizes only it takes).

Rounding points are the reference's: `q_full` and the attention output
hold dtype values (in float32 buffers), the probabilities enter P V rounded
to dtype.

Nothing is read back to the host: a block finds its request on the device
from `input_row_offsets`; sizes the host cannot know (tokens per request,
cache lengths) only bound grids whose spare blocks exit at once.
Every launch takes one parameter struct (`params.mojo`). Workspaces come from
`ctx.enqueue_create_buffer` and are released in stream order, all before the
first launch and after the last (`gpu_run_plan`).

With `GpuPlan.pdl` the attention kernel, the merge and the output step are
launched with programmatic dependent launch (`pdl.mojo`): each may start while
the kernel ahead of it finishes and waits (`wait_for_producers`) before its
first read of that kernel's results (the q step's q_full and new cache rows,
the partitions, raw). The q step, first of the chain, is launched as usual, so
the op starts after everything before it. With `GpuPlan.quantize_in_merge`
(and `merge_quantizes`) the merge writes step 6's quantized activations
(`QuantizedRows`) and the attention output, the output step copies them.
"""

from max.gpu import WARP_SIZE
from max.gpu.host import DeviceBuffer, DeviceContext

from ..common import FPtr, ceil_div
from ..problem import DecodeProblem
from ..spec import SCORE_MOD_ALIBI_POS
from .addressing import ELEMENTWISE_THREADS, attention_slots
from .attention_block import AttentionParams, enqueue_attention, enqueue_attention_with
from .attention_fma import ATT_ROWS, ATT_THREADS, attention_fma_kernel, attention_smem_bytes
from .attention_mma import MMA_ROWS, attention_mma_kernel, attention_mma_smem_bytes
from .attention_narrow import N9_ROWS, attention_narrow_kernel, attention_narrow_smem_bytes
from .attention_sm90 import S9_QUANT_BLOCK, attention_sm90_kernel, attention_sm90_smem_bytes
from .attention_wgmma import WG_BLOCK_THREADS, WG_ROWS, attention_wgmma_kernel, attention_wgmma_smem_bytes
from .merge import (
    MERGE_QUANT_RANK,
    MERGE_THREADS,
    MergeParams,
    StoreParams,
    WidenParams,
    merge_kernel,
    store_kernel,
    widen_kernel,
)
from .params import DeviceBatch, DeviceCache, DeviceFp8Rows, to_global
from .pdl import launch_attributes
from .plan import (
    ATTENTION_VARIANTS,
    NARROW_SHAPE,
    PROJ_TILES,
    SM90_SHAPE,
    DeviceLimits,
    GpuPlan,
    check_gpu_shapes,
    fp8_row_bytes,
)
from .projection import (
    MATMUL_M_TILE,
    MATMUL_SMEM_FLOATS,
    MATMUL_THREADS,
    QUANT_WARPS,
    FmaProjectionParams,
    fp8_matmul_kernel,
    quantize_kernel,
)
from .projection_mma import KCHUNK, Fp8Projection, QuantizedRows, ScaleBlocks, StridedRows
from .schedule import (
    MAX_PARTITIONS,
    SCHEDULE_THREADS,
    ScheduleParams,
    SplitSchedule,
    schedule_grid,
    schedule_ints,
    schedule_kernel,
)
from .rope_norm import CacheRowsParams, RopeQParams, rope_norm_cache_kernel, rope_q_kernel
from .steps_fused import OutStepParams, QStepParams, TileGrid, enqueue_out_step, enqueue_q_step, is_wg_tile
from .tma_smem import S9_ROWS, S9_THREADS, TmaAttentionParams


def device_cache[dtype: DType](p: DecodeProblem[dtype]) -> DeviceCache[dtype]:
    """The cache of `p` as kernel parameters; with `fp8_ds_mla` rows (`DeviceFp8Rows`) only its `key_dim` (R + Dr) counts."""
    var cache = DeviceCache[dtype].of(p.cache)
    if p.fp8_cache.active:
        cache.key_dim = Int32(p.key_dim())
    return cache


def cache_rows_params[dtype: DType](p: DecodeProblem[dtype], count: Int) -> CacheRowsParams[dtype]:
    """Steps 1 and 2 on the first `count` new tokens' cache rows (0: none), as kernel parameters."""
    return CacheRowsParams[dtype](
        device_cache(p),
        DeviceFp8Rows.of(p.fp8_cache),
        DeviceBatch.of(p.batch),
        p.freqs_cis,
        p.kv_norm_gamma,
        p.epsilon,
        Int32(p.kv_lora_rank),
        Int32(p.rope_dim),
        p.new_rows,
        Int32(1 if p.has_new_rows else 0),
        Int32(count),
    )


def gpu_rotate_and_normalize_new_rows[dtype: DType](ctx: DeviceContext, rows: CacheRowsParams[dtype]) raises:
    """Steps 1 and 2 on the new tokens' cache rows alone (`cache_rows_params`; `count` 0: nothing).

    bf16 / f16 fold this into `q_step_kernel`'s launch (`gpu_build_q_full`).
    """
    if rows.count > 0:
        ctx.enqueue_function[rope_norm_cache_kernel[dtype]](rows, grid_dim=Int(rows.count), block_dim=ELEMENTWISE_THREADS)


def q_projection[dtype: DType](p: DecodeProblem[dtype], q_full: FPtr) -> Fp8Projection[dtype, DType.float32]:
    """Step 3 as a projection: `q_full[t, h, :R] = rnd(fp8mm(q[t, h, :Dn], w_uk[h]))`."""
    var q_dim = p.nope_dim + p.rope_dim
    var key_dim = p.key_dim()
    var blocks = p.granularity.resolve(p.num_tokens, p.kv_lora_rank, p.nope_dim)
    return Fp8Projection[dtype, DType.float32](
        StridedRows(to_global(p.q), Int64(q_dim), Int64(p.num_heads * q_dim)), to_global(p.w_uk), to_global(p.w_uk_scale),
        StridedRows(to_global(q_full), Int64(key_dim), Int64(p.num_heads * key_dim)),
        Int32(p.num_tokens), Int32(p.kv_lora_rank), Int32(p.nope_dim), ScaleBlocks.of(blocks),
    )


def output_projection[dtype: DType](p: DecodeProblem[dtype], raw: FPtr) -> Fp8Projection[DType.float32, dtype]:
    """Step 6 as a projection: `output[t, h, :] = rnd(fp8mm(raw[t, h, :], w_uv[h]))`."""
    var rank = p.kv_lora_rank
    var blocks = p.granularity.resolve(p.num_tokens, p.v_head_dim, rank)
    return Fp8Projection[DType.float32, dtype](
        StridedRows(to_global(raw), Int64(rank), Int64(p.num_heads * rank)), to_global(p.w_uv), to_global(p.w_uv_scale),
        StridedRows(to_global(p.output), Int64(p.v_head_dim), Int64(p.num_heads * p.v_head_dim)),
        Int32(p.num_tokens), Int32(p.v_head_dim), Int32(rank), ScaleBlocks.of(blocks),
    )


def q_step_params[
    dtype: DType
](p: DecodeProblem[dtype], q_full: FPtr, cache_rows: CacheRowsParams[dtype], schedule: ScheduleParams) -> QStepParams[dtype]:
    """`q_step_kernel`'s parameters for `p` (its tile grid set at launch, `enqueue_q_step`)."""
    return QStepParams[dtype](
        q_projection(p, q_full), to_global(p.freqs_cis), DeviceBatch.of(p.batch), Int32(p.nope_dim),
        Int32(p.rope_dim), Int32(p.kv_lora_rank), TileGrid.unset(), cache_rows, schedule,
    )


def out_step_params[dtype: DType](p: DecodeProblem[dtype], raw: FPtr, quant: QuantizedRows) -> OutStepParams[dtype]:
    """`out_step_kernel`'s parameters for `p` (its tile grid set at launch, `enqueue_out_step`)."""
    return OutStepParams[dtype](
        output_projection(p, raw), to_global(p.attention_output), Int32(1 if p.has_attention_output else 0),
        TileGrid.unset(), quant,
    )


def gpu_fp8_batched_matmul[
    in_dtype: DType, out_dtype: DType, //, value_dtype: DType
](ctx: DeviceContext, proj: Fp8Projection[in_dtype, out_dtype], groups: Int) raises:
    """Steps 3 and 6 on float32 FMA units: `proj` for every group (head) `g < groups`, values rounded to `value_dtype`.

    Two launches (quantize, then matmul) with a workspace of `G M K` floats.
    The path of float32 (whose products the tensor-core path would sum with a
    shorter accumulator than its float32 tolerance allows) and of sizes whose
    tiles do not fit in shared memory; bf16 / f16 take `q_step_kernel` /
    `out_step_kernel`.
    """
    var rows = Int(proj.rows)
    var n_out = Int(proj.n_out)
    var depth = Int(proj.depth)
    if groups == 0 or rows == 0 or n_out == 0:
        return
    var a_dq_buf = ctx.enqueue_create_buffer[DType.float32](groups * rows * depth)
    var a_dq = a_dq_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var m_tile = max(1, min(MATMUL_M_TILE, MATMUL_SMEM_FLOATS // max(depth, 1)))
    var params = FmaProjectionParams(proj, to_global(a_dq), Int32(groups), Int32(m_tile))
    var quant_blocks = groups * ceil_div(rows, Int(proj.blocks.m)) * ceil_div(depth, Int(proj.blocks.k))
    ctx.enqueue_function[quantize_kernel[in_dtype, out_dtype]](
        params, grid_dim=ceil_div(quant_blocks, QUANT_WARPS), block_dim=QUANT_WARPS * WARP_SIZE
    )
    ctx.enqueue_function[fp8_matmul_kernel[in_dtype, out_dtype, value_dtype]](
        params, grid_dim=(ceil_div(n_out, MATMUL_THREADS), groups, ceil_div(rows, m_tile)), block_dim=MATMUL_THREADS
    )
    _ = a_dq_buf^  # freed in stream order


def gpu_build_q_full[
    dtype: DType
](
    ctx: DeviceContext, p: DecodeProblem[dtype], plan: GpuPlan, q_full: FPtr, cache_rows: CacheRowsParams[dtype],
    schedule: ScheduleParams,
) raises:
    """Steps 1, 3 and 4 on q: `q_full [T, H, R + Dr] = rnd(concat(fp8mm(q_nope, w_uk), rope(q_rope)))`,
    steps 1-2 on `cache_rows` (`count` 0: none; see `cache_rows_params`), and step 5's split
    schedule when `schedule` is active.

    A tile of `plan.q_tile`: one launch of `q_step_kernel` (tensor cores, bf16 /
    f16), the schedule one more block of it; `FMA_PATH`: `schedule_kernel`,
    `rope_norm_cache_kernel`, `rope_q_kernel` and the FMA matmul (`gpu_fp8_batched_matmul`).
    """
    if p.num_tokens == 0 or p.num_heads == 0:
        return
    comptime if dtype != DType.float32:
        if plan.q_tile >= 0:
            var params = q_step_params(p, q_full, cache_rows, schedule)
            comptime for i in range(len(PROJ_TILES)):
                if plan.q_tile == i:
                    enqueue_q_step[dtype, PROJ_TILES[i]](ctx, params, p.num_heads)
            return
    enqueue_schedule(ctx, schedule)
    gpu_rotate_and_normalize_new_rows[dtype](ctx, cache_rows)
    ctx.enqueue_function[rope_q_kernel[dtype]](
        RopeQParams[dtype](
            to_global(p.q), DeviceBatch.of(p.batch), to_global(p.freqs_cis), to_global(q_full),
            Int32(p.num_heads), Int32(p.nope_dim), Int32(p.rope_dim), Int32(p.kv_lora_rank),
        ),
        grid_dim=p.num_tokens,
        block_dim=ELEMENTWISE_THREADS,
    )
    gpu_fp8_batched_matmul[dtype](ctx, q_projection(p, q_full), p.num_heads)


struct AttentionWorkspace(Movable):
    """Step 5's split-KV workspaces: the schedule's tables (schedule.mojo), the partitions' outputs
    `[grid rows_per_block, R]`, maxima and sums `[grid rows_per_block]`; one int and float each
    without a split.

    The op creates it before its first launch and releases it after its last, so that no
    allocation or release sits between two of its kernels (the PDL chain, pdl.mojo).
    """

    var grid: Int  # attention blocks of the split; 0: no split
    var rows_per_block: Int
    var num_heads: Int
    var target: Int  # blocks the split aims at
    var forced_partitions: Int  # > 0: every request that many (tests; 1 with the LSE)
    var tables: DeviceBuffer[DType.int32]
    var part_out: DeviceBuffer[DType.float32]
    var part_max: DeviceBuffer[DType.float32]
    var part_sum: DeviceBuffer[DType.float32]

    def __init__[dtype: DType](out self, ctx: DeviceContext, p: DecodeProblem[dtype], plan: GpuPlan) raises:
        self.rows_per_block = plan.rows_per_block
        self.num_heads = p.num_heads
        self.target = plan.split_target
        self.forced_partitions = min(plan.num_partitions, MAX_PARTITIONS)  # SPLIT_BY_WORK (0): by the schedule's shares
        self.grid = 0
        if plan.num_partitions != 1 or p.has_lse:  # the LSE comes from the merge
            var slots = attention_slots(p.num_tokens, p.num_heads, p.batch.num_requests, plan.rows_per_block)
            self.grid = schedule_grid(slots, self.target, self.forced_partitions)
        var partial_rows = self.grid * self.rows_per_block
        self.tables = ctx.enqueue_create_buffer[DType.int32](
            schedule_ints(self.grid, p.num_tokens) if self.grid > 0 else 1
        )
        self.part_out = ctx.enqueue_create_buffer[DType.float32](max(partial_rows * p.kv_lora_rank, 1))
        self.part_max = ctx.enqueue_create_buffer[DType.float32](max(partial_rows, 1))
        self.part_sum = ctx.enqueue_create_buffer[DType.float32](max(partial_rows, 1))

    def split(self) -> Bool:
        return self.grid > 0

    def schedule(self) -> SplitSchedule:
        """The schedule's tables (inactive without a split)."""
        var tables = self.tables.unsafe_ptr().unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()
        return SplitSchedule.over(to_global(tables), self.grid, self.rows_per_block, self.num_heads)

    def schedule_params[dtype: DType](self, p: DecodeProblem[dtype]) -> ScheduleParams:
        """What builds the schedule of `p` in this workspace (inactive without a split)."""
        return ScheduleParams(DeviceBatch.of(p.batch), self.schedule(), Int32(self.target), Int32(self.forced_partitions))

    def build_schedule[dtype: DType](self, ctx: DeviceContext, p: DecodeProblem[dtype]) raises:
        """Enqueues `schedule_kernel` for `p` (with a split; step 5 alone, tests)."""
        enqueue_schedule(ctx, self.schedule_params(p))


def enqueue_schedule(ctx: DeviceContext, schedule: ScheduleParams) raises:
    """Builds step 5's split schedule with a launch of its own (`schedule_kernel`; inactive: nothing)."""
    if schedule.active():
        ctx.enqueue_function[schedule_kernel](schedule, grid_dim=1, block_dim=SCHEDULE_THREADS)


def gpu_attention[dtype: DType](ctx: DeviceContext, p: DecodeProblem[dtype], plan: GpuPlan, q_full: FPtr, raw: FPtr) raises:
    """Step 5: `raw [T, H, R]` from `q_full [T, H, R + Dr]` and the paged cache, with the plan's kernel and split."""
    var ws = AttentionWorkspace(ctx, p, plan)
    ws.build_schedule(ctx, p)
    gpu_attention_into[dtype](ctx, p, plan, q_full, raw, ws, QuantizedRows.none(to_global(raw)))
    _ = ws^  # freed in stream order


def gpu_attention_into[
    dtype: DType
](
    ctx: DeviceContext, p: DecodeProblem[dtype], plan: GpuPlan, q_full: FPtr, raw: FPtr, ws: AttentionWorkspace,
    quant: QuantizedRows,
) raises:
    """`gpu_attention` in workspace `ws` (made for `plan`, its schedule built); with `quant` active the merge
    quantizes the rows for step 6 (`merge_quantizes`) instead of writing `raw`."""
    comptime for i in range(len(ATTENTION_VARIANTS)):
        if plan.attention == i:
            gpu_attention_with[dtype, ATTENTION_VARIANTS[i]](ctx, p, q_full, raw, ws, plan.pdl, plan.merge_ahead, quant)


def gpu_attention_with[
    dtype: DType, variant: Tuple[Int, Int, Int]
](
    ctx: DeviceContext,
    p: DecodeProblem[dtype],
    q_full: FPtr,
    raw: FPtr,
    ws: AttentionWorkspace,
    pdl: Bool,
    merge_ahead: Bool,
    quant: QuantizedRows,
) raises:
    """Step 5 with attention kernel `variant` (see `ATTENTION_VARIANTS`) in workspace `ws` (made for a
    plan of that variant, its schedule built).

    With a split (`ws.split()`) every partition's output and row statistics
    go to `ws`, merged by log-sum-exp (`merge_kernel`). The LSE (`has_lse`)
    comes from that merge: the plan splits when it is asked for. With `pdl` the
    attention kernel and the merge start early (programmatic dependent launch, pdl.mojo); `merge_ahead`
    takes the merge's instance for rows that fit one wave (`GpuPlan.merge_ahead`).
    With `quant` active (only with a merge) the merge writes step 6's quantized rows and the
    attention output (`has_attention_output`), not `raw`.
    An `fp8_ds_mla` cache (bfloat16) takes the tensor-core kernels' fp8 instances.
    """
    comptime groups, kt, gw = variant[0], variant[1], variant[2]
    comptime if groups > 0 and dtype != DType.bfloat16 and dtype != DType.float16:
        raise Error("pymla gpu: the tensor-core attention kernels take bf16 / f16 caches")
    else:
        if p.fp8_cache.active and (groups == 0 or dtype != DType.bfloat16):
            raise Error("pymla gpu: fp8_ds_mla rows are read by the tensor-core attention kernels of bfloat16 ops only")
        var num_tokens = p.num_tokens
        if num_tokens == 0 or p.num_heads == 0:
            return
        var key_dim = p.key_dim()
        var rank = p.kv_lora_rank
        var rows = num_tokens * p.num_heads
        var part_out = ws.part_out.unsafe_ptr().unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()
        var part_max = ws.part_max.unsafe_ptr().unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()
        var part_sum = ws.part_sum.unsafe_ptr().unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()
        var params = AttentionParams[dtype](
            q_full, device_cache(p), DeviceFp8Rows.of(p.fp8_cache), DeviceBatch.of(p.batch), Int32(p.num_heads),
            Int32(rank), ws.schedule(), p.scale, Int32(p.mask.kind), Int32(p.mask.window), Int32(p.score_mod),
            raw, part_out, part_max, part_sum,
        )
        # The TMA kernel's epilogue quantizes the rows of one partition itself (K blocks of S9_QUANT_BLOCK).
        var epilogue_quantizes = gw == SM90_SHAPE[2] and quant.active != 0 and Int(quant.block_k) == S9_QUANT_BLOCK
        var epilogue = quant if epilogue_quantizes else QuantizedRows.none(to_global(raw))
        comptime if groups > 0 and dtype == DType.bfloat16:
            if p.fp8_cache.active:
                enqueue_attention_variant[variant, fp8=True](ctx, p, params, num_tokens, key_dim, fp8_row_bytes(p), pdl, epilogue)
            else:
                enqueue_attention_variant[variant, fp8=False](ctx, p, params, num_tokens, key_dim, 0, pdl, epilogue)
        else:
            enqueue_attention_variant[variant, fp8=False](ctx, p, params, num_tokens, key_dim, 0, pdl, epilogue)
        if ws.split():
            var merge = MergeParams[dtype](
                to_global(part_out), to_global(part_max), to_global(part_sum), to_global(raw), ws.schedule(), Int32(rank), to_global(p.lse), Int32(1 if p.has_lse else 0),
                quant, to_global(p.attention_output), Int32(1 if p.has_attention_output else 0),
                Int32(1 if epilogue_quantizes else 0),
            )
            if quant.active != 0:
                enqueue_merge[dtype, True](ctx, merge, rows, pdl, merge_ahead)
            else:
                enqueue_merge[dtype, False](ctx, merge, rows, pdl, merge_ahead)


def enqueue_merge[
    dtype: DType, quantize: Bool
](ctx: DeviceContext, merge: MergeParams[dtype], rows: Int, pdl: Bool, ahead: Bool) raises:
    """Launches `merge_kernel` over `rows` rows, one block each (`pdl`: after the attention kernel; `ahead`:
    its instance loading the partitions ahead of the weights, `GpuPlan.merge_ahead`)."""
    if ahead:
        ctx.enqueue_function[merge_kernel[dtype, quantize, True]](
            merge, grid_dim=rows, block_dim=MERGE_THREADS, attributes=launch_attributes(pdl)
        )
    else:
        ctx.enqueue_function[merge_kernel[dtype, quantize, False]](
            merge, grid_dim=rows, block_dim=MERGE_THREADS, attributes=launch_attributes(pdl)
        )


def enqueue_attention_variant[
    dtype: DType, //, variant: Tuple[Int, Int, Int], fp8: Bool
](
    ctx: DeviceContext, p: DecodeProblem[dtype], params: AttentionParams[dtype], num_tokens: Int, key_dim: Int,
    fp8_rows: Int, pdl: Bool, epilogue: QuantizedRows,
) raises:
    """Launches attention kernel `variant` of problem `p` on `params` (`fp8`: its instance reading `fp8_ds_mla`
    rows of `fp8_rows` bytes); with `pdl`, programmatic dependent launch (pdl.mojo). `epilogue` active
    (the TMA kernel): the rows of one partition go out quantized for step 6 (`store_quantized_rows`)."""
    comptime groups, kt, gw = variant[0], variant[1], variant[2]
    comptime if gw < 0:
        comptime if fp8:
            comptime if dtype == DType.bfloat16:
                var tma = TmaAttentionParams[dtype].create_fp8(ctx, p.fp8_cache, params).quantizing(
                    epilogue, to_global(p.attention_output), p.has_attention_output
                )
                enqueue_tma_attention[gw, True](ctx, tma, params, num_tokens, pdl)
            else:
                raise Error("pymla gpu: fp8_ds_mla rows serve bfloat16 ops, got ", dtype)
        else:
            var tma = TmaAttentionParams[dtype].create(ctx, p.cache, params).quantizing(
                epilogue, to_global(p.attention_output), p.has_attention_output
            )
            enqueue_tma_attention[gw, False](ctx, tma, params, num_tokens, pdl)
    elif groups == 0:
        var smem = attention_smem_bytes[dtype](key_dim)
        if Int(params.kv_lora_rank) <= 2 * ATT_THREADS:
            enqueue_attention[attention_fma_kernel[dtype, 2], ATT_ROWS](ctx, params, num_tokens, ATT_THREADS, smem, pdl)
        else:
            enqueue_attention[attention_fma_kernel[dtype, 4], ATT_ROWS](ctx, params, num_tokens, ATT_THREADS, smem, pdl)
    elif gw == 0:
        enqueue_attention[attention_wgmma_kernel[dtype, kt, fp8], WG_ROWS](
            ctx, params, num_tokens, WG_BLOCK_THREADS, attention_wgmma_smem_bytes[dtype](kt, key_dim, fp8_rows), pdl
        )
    else:
        enqueue_attention[attention_mma_kernel[dtype, groups, kt, gw, fp8], MMA_ROWS * groups](
            ctx, params, num_tokens, WARP_SIZE * gw * groups, attention_mma_smem_bytes[dtype](groups, kt, gw, key_dim, fp8_rows),
            pdl,
        )


def enqueue_tma_attention[
    dtype: DType, //, gw: Int, fp8: Bool
](ctx: DeviceContext, tma: TmaAttentionParams[dtype], params: AttentionParams[dtype], num_tokens: Int, pdl: Bool) raises:
    """Launches the TMA kernel that `gw` marks (`NARROW_SHAPE`: the narrow kernel, else the 64-row one) on
    `tma` (`fp8`: its instance reading `fp8_ds_mla` rows)."""
    comptime if gw == NARROW_SHAPE[2]:
        enqueue_attention_with[attention_narrow_kernel[dtype, fp8], N9_ROWS](
            ctx, tma, params, num_tokens, S9_THREADS, attention_narrow_smem_bytes[fp8](), pdl
        )
    else:
        enqueue_attention_with[attention_sm90_kernel[dtype, fp8], S9_ROWS](
            ctx, tma, params, num_tokens, S9_THREADS, attention_sm90_smem_bytes[fp8](), pdl
        )


def merge_quantizes[dtype: DType](p: DecodeProblem[dtype], plan: GpuPlan, split: Bool) -> Bool:
    """Whether the partition merge quantizes step 6's activations (`QuantizedRows`): asked by the plan
    (`quantize_in_merge`), a merge runs (`split`), the tensor-core output step follows, scales
    per row (`bm == 1`: one merged row per block) over K blocks of multiples of 64 that tile
    kv_lora_rank (the plain layout `stage_quantized` copies), and a row fits the merge's shared memory."""
    comptime if dtype == DType.float32:
        return False
    var blocks = p.granularity.resolve(p.num_tokens, p.v_head_dim, p.kv_lora_rank)
    return (
        plan.quantize_in_merge
        and split
        and plan.out_tile >= 0
        and p.has_output
        and blocks.m == 1
        and blocks.k % KCHUNK == 0
        and p.kv_lora_rank % blocks.k == 0
        and p.kv_lora_rank <= MERGE_QUANT_RANK
    )


def gpu_project_output[
    dtype: DType
](ctx: DeviceContext, p: DecodeProblem[dtype], plan: GpuPlan, raw: FPtr, quant: QuantizedRows) raises:
    """Step 6: `output[t, h, :] = rnd(fp8mm(raw[t, h, :], w_uv[h]))`; with `has_attention_output`
    also `attention_output = raw` as dtype. Without `has_output`, only that store.

    A tile of `plan.out_tile`: one launch of `out_step_kernel` (tensor cores,
    bf16 / f16); `FMA_PATH`: `store_kernel` and the FMA matmul. With `quant` active
    (`merge_quantizes`: the merge quantized raw and stored the attention output) the output
    step reads those rows, not `raw`.
    """
    if p.num_tokens == 0 or p.num_heads == 0:
        return
    comptime if dtype != DType.float32:
        if plan.out_tile >= 0 and p.has_output:
            var params = out_step_params(p, raw, quant)
            comptime for i in range(len(PROJ_TILES)):
                comptime if not is_wg_tile(PROJ_TILES[i]):  # the q step's alone (plan.mojo)
                    if plan.out_tile == i:
                        enqueue_out_step[dtype, PROJ_TILES[i]](ctx, params, p.num_heads, plan.pdl)
            return
    if p.has_attention_output:
        var count = p.num_tokens * p.num_heads * p.kv_lora_rank
        ctx.enqueue_function[store_kernel[dtype]](
            StoreParams[dtype](to_global(raw), to_global(p.attention_output), Int64(count)),
            grid_dim=ceil_div(count, ELEMENTWISE_THREADS),
            block_dim=ELEMENTWISE_THREADS,
        )
    if p.has_output:
        gpu_fp8_batched_matmul[dtype](ctx, output_projection(p, raw), p.num_heads)


def mla_decode_branch_fp8_gpu[dtype: DType](p: DecodeProblem[dtype], ctx: DeviceContext) raises:
    """All six steps on the GPU of `ctx`; every pointer of `p` is device memory.

    Enqueues the kernels on `ctx`'s stream and returns without waiting;
    reads nothing back to the host: the key partitioning is the device
    schedule's (`GpuPlan`, schedule.mojo), from the sizes alone on the host.
    """
    if p.num_tokens == 0 or p.num_heads == 0:
        return
    if p.batch.shard.count > 1 and p.score_mod == SCORE_MOD_ALIBI_POS:
        raise Error("pymla gpu: ALiBi on a shard of the cache is not supported on the GPU yet")
    var limits = DeviceLimits.read(ctx)
    check_gpu_shapes[dtype](p, limits)
    gpu_run_plan[dtype](ctx, p, GpuPlan.create(p, limits))


def gpu_run_plan[dtype: DType](ctx: DeviceContext, p: DecodeProblem[dtype], plan: GpuPlan) raises:
    """The op's launches for `p` under `plan` (`mla_decode_branch_fp8_gpu` after its checks; tests pin a plan)."""
    var rows = p.num_tokens * p.num_heads
    if p.project_only:  # step 6 alone, on the attention output given (widened to float32)
        var given_buf = ctx.enqueue_create_buffer[DType.float32](rows * p.kv_lora_rank)
        var given = given_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var count = rows * p.kv_lora_rank
        ctx.enqueue_function[widen_kernel[dtype]](
            WidenParams[dtype](to_global(p.attention_output), to_global(given), Int64(count)),
            grid_dim=ceil_div(count, ELEMENTWISE_THREADS),
            block_dim=ELEMENTWISE_THREADS,
        )
        var projection = p
        projection.has_attention_output = False  # read, not written
        gpu_project_output[dtype](ctx, projection, plan, given, QuantizedRows.none(to_global(given)))
        _ = given_buf^  # freed in stream order
        return
    # Every workspace before the first launch, every release after the last: nothing but
    # kernels between them (their programmatic dependent launch with `plan.pdl`, pdl.mojo).
    var q_full_buf = ctx.enqueue_create_buffer[DType.float32](rows * p.key_dim())
    var raw_buf = ctx.enqueue_create_buffer[DType.float32](rows * p.kv_lora_rank)
    var ws = AttentionWorkspace(ctx, p, plan)
    var quantized = merge_quantizes(p, plan, ws.split())
    var block_k = p.granularity.resolve(p.num_tokens, p.v_head_dim, p.kv_lora_rank).k
    var k_blocks = ceil_div(p.kv_lora_rank, block_k)
    var values_buf = ctx.enqueue_create_buffer[DType.float16](rows * p.kv_lora_rank if quantized else 1)
    var scales_buf = ctx.enqueue_create_buffer[DType.float32](rows * k_blocks if quantized else 1)
    var q_full = q_full_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var raw = raw_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var quant = QuantizedRows.none(to_global(raw))
    if quantized:
        quant = QuantizedRows(
            to_global(values_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()),
            to_global(scales_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()),
            Int32(block_k), Int32(p.num_heads), 1,
        )

    # Steps 1-4: the new cache rows and q_full, one launch (bf16 / f16), and step 5's split-KV
    # schedule (from the batch alone): a block of that launch, or a launch of its own before it.
    var schedule = ws.schedule_params(p)
    if not plan.schedule_in_q_step:
        enqueue_schedule(ctx, schedule)
        schedule = ScheduleParams.nothing(schedule.batch)
    gpu_build_q_full[dtype](ctx, p, plan, q_full, cache_rows_params(p, p.num_tokens), schedule)
    gpu_attention_into[dtype](ctx, p, plan, q_full, raw, ws, quant)
    # Step 6 and the optional attention-output store, one launch (bf16 / f16).
    gpu_project_output[dtype](ctx, p, plan, raw, quant)

    # The workspaces are freed in stream order, after the kernels above.
    _ = q_full_buf^
    _ = raw_buf^
    _ = ws^
    _ = values_buf^
    _ = scales_buf^
