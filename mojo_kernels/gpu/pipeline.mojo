"""GPU (NVIDIA sm_90) implementation of `pymla.mla_decode_branch_fp8`: the launchers.

Same math as the CPU stages and `pymla/reference.py`, as a chain of small
kernels on the stream of the op's `DeviceContext` (entry:
`mla_decode_branch_fp8_gpu`, given the `DecodeProblem` that `execute` unpacked).
This file plans and launches; the kernels live in one file per concern:

1-4. `q_step_kernel`          (steps_fused.mojo) one launch for bf16 / f16: RMSNorm + RoPE of each
                                new token's cache row (extra blocks, `rope_norm_cache_row` of
                                rope_norm.mojo), RoPE of q's rope part into `q_full[:, :, R:]`, and
                                `q_full[:, :, :R] = fp8mm(q_nope, w_uk)` per head on tensor cores
                                (projection_mma.mojo: dynamic fp8 quantization of q_nope, the scale
                                rule of `pymla/quant.py` bit for bit, once per activation tile)
     float32 (and tiles too large for shared memory): `rope_norm_cache_kernel`,
                                `rope_q_kernel` (rope_norm.mojo), `quantize_kernel` +
                                `fp8_matmul_kernel` (projection.mojo, float32 FMA)
5.   `attention_wgmma_kernel`   (attention_wgmma.mojo) Hopper warpgroup tensor cores,
                                64 packed rows per block (many heads), or
     `attention_mma_kernel`     (attention_mma.mojo) tensor cores, bf16 / f16 caches, or
     `attention_fma_kernel`     (attention_fma.mojo) float32 FMA (float32 caches, other
                                sizes): one block per (request, tile of rows, key partition);
                                all (token, head) rows of the block share each key tile
     `merge_kernel`             (merge.mojo) log-sum-exp merge of the key partitions
6.   `out_step_kernel`          (steps_fused.mojo) one launch for bf16 / f16: quantization of the
                                attention output + `fp8mm(raw, w_uv)` on tensor cores, and the
                                optional attention-output store; float32: `store_kernel` +
                                `quantize_kernel` + `fp8_matmul_kernel`.

Rounding points are the reference's: `q_full` and the attention output
hold dtype values (in float32 buffers), the probabilities enter P V rounded
to dtype.

Nothing is read back to the host: a block finds its request on the device
from `input_row_offsets`; sizes the host cannot know (tokens per request,
cache lengths) only bound grids whose spare blocks exit at once.
Kernel arguments are raw pointers and fixed-width scalars (`Int` is not
`DevicePassable` in this version); the fused steps take one parameter struct
per launch (`QStepParams`, `OutStepParams`). Workspaces come from
`ctx.enqueue_create_buffer` and are released in stream order.
"""

from std.math import exp

from max.gpu import WARP_SIZE
from max.gpu.host import DeviceContext

from ..spec import MaskSpec
from .addressing import ELEMENTWISE_THREADS
from ..common import DPtr, FPtr, U32Ptr, U8Ptr, ceil_div
from .attention_block import AttentionParams, enqueue_attention
from .attention_mma import MMA_ROWS, attention_mma_kernel, attention_mma_smem_bytes, mma_supported
from .attention_wgmma import (
    WG_BLOCK_THREADS,
    WG_ROWS,
    attention_wgmma_kernel,
    attention_wgmma_smem_bytes,
    wgmma_supported,
)
from .attention_fma import ATT_ROWS, ATT_THREADS, attention_fma_kernel, attention_smem_bytes
from .projection import MATMUL_M_TILE, MATMUL_SMEM_FLOATS, MATMUL_THREADS, QUANT_WARPS, fp8_matmul_kernel, quantize_kernel
from .projection_mma import Fp8Projection
from .merge import MAX_PARTITIONS, MERGE_THREADS, merge_kernel, store_kernel
from .rope_norm import CacheRowsArgs, rope_norm_cache_kernel, rope_q_kernel
from .steps_fused import (
    PROJ_TILES,
    OutStepParams,
    QStepParams,
    choose_proj_tile,
    enqueue_out_step,
    enqueue_q_step,
    tile_fits,
)
from ..spec import Granularity
from ..paged_cache import PagedLatentRows
from ..problem import DecodeProblem






# Partition planning.
comptime NUM_SMS = 132  # H200 (SXM)
comptime MIN_KEYS_PER_PARTITION = 256


# Tensor-core attention (attention_mma.mojo) for bf16 / f16 caches; False forces the FMA kernel.
comptime USE_TENSOR_CORES = True
# Its shapes, (16-row groups per block, keys per tile, warps per group), the fastest of the
# variants timed on the H200 (benchmarks/results/gpu_variants.log; `gpu_smoke.mojo variants`):
comptime MMA_MANY_HEADS = (2, 64, 4)  # 32 heads or more: two groups share every key tile
comptime MMA_FEW_HEADS = (1, 64, 8)  # fewer heads; needs kv_lora_rank % 128 == 0
# (H200, 16 heads, B128 L32k, step 5: 1798.5 us; (1, 32, 4) 1895 us; (1, 32, 8) 2262 us, and
# 2230-2256 us with a ring of 3-5 cp.async key buffers: deeper prefetch does not help;
# benchmarks/results/h200-2026-12-03-attn/)
comptime MMA_FEW_HEADS_SMALL_RANK = (1, 32, 4)  # fewer heads, kv_lora_rank % 64 == 0
# The warpgroup kernel (attention_wgmma.mojo) in the same tuple: 4 groups = its 64 rows,
# keys per tile, 0 warps per group marks it (two warpgroups of 4 warps).
comptime WGMMA_SHAPE = (WG_ROWS // MMA_ROWS, 64, 0)
comptime WGMMA_MIN_HEADS = 64  # heads from which it is the default (H200: 2.1x the MMA kernel at 128 heads,
# half its speed at 16 heads; benchmarks/results/h200-2026-12-03-wgmma/gpu_variants.log)
comptime MMA_REGISTERS = 256  # registers per thread the tensor-core kernels use (ptxas: 208-255)
comptime SM_REGISTERS = 65536
comptime SM_SHARED_MEMORY = 228 * 1024
comptime ATT_MAX_SMEM = 227 * 1024  # opt-in shared memory per block on sm_90



# ---------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------


def plan_partitions(
    num_tokens: Int, num_heads: Int, rows_per_block: Int, blocks_per_sm: Int, max_cache_length_hint: Int
) -> Int:
    """Key partitions per request: enough blocks for one full wave, none past it.

    Row tiles are estimated as `T H / rows_per_block`; a partition keeps at
    least MIN_KEYS_PER_PARTITION keys of `max_cache_length_hint` (at most 16
    partitions when the hint is unknown, i.e. not positive).
    """
    var wave = NUM_SMS * blocks_per_sm
    var tiles = max(1, ceil_div(num_tokens * num_heads, rows_per_block))
    var parts = max(1, wave // tiles)
    if max_cache_length_hint > 0:
        parts = min(parts, ceil_div(max_cache_length_hint, MIN_KEYS_PER_PARTITION))
    else:
        parts = min(parts, 16)
    return max(1, min(parts, MAX_PARTITIONS))


def check_gpu_shapes[
    dtype: DType
](cache: PagedLatentRows[dtype], nope_dim: Int, rope_dim: Int, kv_lora_rank: Int) raises:
    """Raises for sizes the GPU kernels do not handle."""
    var key_dim = kv_lora_rank + rope_dim
    if cache.head_dim != key_dim:
        raise Error("pymla gpu: cache head_dim ", cache.head_dim, " != kv_lora_rank + rope_dim = ", key_dim)
    if kv_lora_rank % 4 != 0 or rope_dim % 4 != 0:
        raise Error("pymla gpu: kv_lora_rank and rope_dim must be multiples of 4")
    if nope_dim > MATMUL_SMEM_FLOATS or kv_lora_rank > MATMUL_SMEM_FLOATS:
        raise Error("pymla gpu: nope_dim and kv_lora_rank must be at most ", MATMUL_SMEM_FLOATS)
    if kv_lora_rank > 4 * ATT_THREADS:
        raise Error("pymla gpu: kv_lora_rank must be at most ", 4 * ATT_THREADS)
    var smem = attention_smem_bytes[dtype](key_dim)
    if smem > ATT_MAX_SMEM:
        raise Error("pymla gpu: key dim ", key_dim, " needs ", smem, " bytes of shared memory")


def cache_rows_args[
    dtype: DType
](
    cache: PagedLatentRows[dtype],
    input_row_offsets: U32Ptr,
    cache_lengths: U32Ptr,
    num_requests: Int,
    count: Int,
    freqs_cis: DPtr[dtype],
    kv_norm_gamma: DPtr[dtype],
    epsilon: Float32,
    kv_lora_rank: Int,
    rope_dim: Int,
    new_rows: DPtr[dtype],
    has_new_rows: Bool,
) -> CacheRowsArgs[dtype]:
    """Steps 1 and 2 on `count` new tokens' cache rows, as kernel parameters (`count` 0: none)."""
    return CacheRowsArgs[dtype](
        cache.blocks,
        cache.lookup_table,
        Int32(cache.pages_per_request),
        Int32(cache.page_size),
        Int64(cache.page_stride),
        Int64(cache.layer_offset),
        Int32(cache.head_dim),
        input_row_offsets,
        cache_lengths,
        Int32(num_requests),
        freqs_cis,
        kv_norm_gamma,
        epsilon,
        Int32(kv_lora_rank),
        Int32(rope_dim),
        new_rows,
        Int32(1 if has_new_rows else 0),
        Int32(count),
    )


def gpu_rotate_and_normalize_new_rows[dtype: DType](ctx: DeviceContext, rows: CacheRowsArgs[dtype]) raises:
    """Steps 1 and 2 on the new tokens' cache rows alone (`cache_rows_args`; `count` 0: nothing).

    bf16 / f16 fold this into `q_step_kernel`'s launch (`gpu_build_q_full`).
    """
    if rows.count > 0:
        ctx.enqueue_function[rope_norm_cache_kernel[dtype]](rows, grid_dim=Int(rows.count), block_dim=ELEMENTWISE_THREADS)


def gpu_fp8_batched_matmul[
    in_dtype: DType, out_dtype: DType, value_dtype: DType = out_dtype
](
    ctx: DeviceContext,
    a: DPtr[in_dtype],
    a_g_stride: Int,
    a_m_stride: Int,
    w: U8Ptr,
    w_scale: FPtr,
    c: DPtr[out_dtype],
    c_g_stride: Int,
    c_m_stride: Int,
    num_groups: Int,
    num_rows: Int,
    n_out: Int,
    depth: Int,
    granularity: Granularity,
) raises:
    """Steps 3 and 6 on float32 FMA units: `c[g, m, :] = fp8mm(a[g, m, :], w[g])` for every group `g`.

    `a[g, m, k]` sits at `a + g a_g_stride + m a_m_stride + k`, `c[g, m, n]` at
    `c + g c_g_stride + m c_m_stride + n`. Two launches (quantize, then
    matmul) with a workspace of `G M K` floats. The path of float32 (whose
    products the tensor-core path would sum with a shorter accumulator than
    its float32 tolerance allows) and of sizes whose tiles do not fit in
    shared memory; bf16 / f16 take `q_step_kernel` / `out_step_kernel`.
    """
    if num_groups == 0 or num_rows == 0 or n_out == 0:
        return
    var a_dq_buf = ctx.enqueue_create_buffer[DType.float32](num_groups * num_rows * depth)
    var a_dq = a_dq_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var blocks = granularity.resolve(num_rows, n_out, depth)
    var quant_blocks = num_groups * ceil_div(num_rows, blocks.m) * ceil_div(depth, blocks.k)
    ctx.enqueue_function[quantize_kernel[in_dtype]](
        a,
        Int64(a_g_stride),
        Int64(a_m_stride),
        Int32(num_groups),
        Int32(num_rows),
        Int32(depth),
        Int32(blocks.m),
        Int32(blocks.k),
        a_dq,
        grid_dim=ceil_div(quant_blocks, QUANT_WARPS),
        block_dim=QUANT_WARPS * WARP_SIZE,
    )
    var m_tile = max(1, min(MATMUL_M_TILE, MATMUL_SMEM_FLOATS // max(depth, 1)))
    ctx.enqueue_function[fp8_matmul_kernel[out_dtype, value_dtype]](
        a_dq,
        w,
        w_scale,
        Int32(blocks.n),
        Int32(blocks.k),
        c,
        Int64(c_g_stride),
        Int64(c_m_stride),
        Int32(num_groups),
        Int32(num_rows),
        Int32(n_out),
        Int32(depth),
        Int32(m_tile),
        grid_dim=(ceil_div(n_out, MATMUL_THREADS), num_groups, ceil_div(num_rows, m_tile)),
        block_dim=MATMUL_THREADS,
    )
    _ = a_dq_buf^  # freed in stream order


comptime NO_TILE = (0, 0, 0, 0)
"""The `tile` parameter of `gpu_build_q_full` / `gpu_project_output` when the size picks it."""


def proj_tile_choice[
    dtype: DType, tile: Tuple[Int, Int, Int, Int]
](groups: Int, rows: Int, n_out: Int, depth: Int, block_k: Int, force_fma: Bool) raises -> Int:
    """Which launch a projection takes: an index in PROJ_TILES, len(PROJ_TILES) for a pinned
    `tile` (an error when it does not fit in shared memory), or -1 for the FMA path (float32,
    `force_fma`, or no tile fits in shared memory)."""
    comptime if dtype == DType.float32:
        return -1
    if force_fma:
        return -1
    comptime if tile[0] > 0:
        if not tile_fits(tile, depth, block_k):
            raise Error("pymla gpu: projection tile does not fit in shared memory")
        return len(PROJ_TILES)
    return choose_proj_tile(groups, rows, n_out, depth, block_k)


def gpu_build_q_full[
    dtype: DType, tile: Tuple[Int, Int, Int, Int] = NO_TILE
](
    ctx: DeviceContext,
    q: DPtr[dtype],
    input_row_offsets: U32Ptr,
    cache_lengths: U32Ptr,
    num_requests: Int,
    num_tokens: Int,
    num_heads: Int,
    nope_dim: Int,
    rope_dim: Int,
    kv_lora_rank: Int,
    freqs_cis: DPtr[dtype],
    w_uk: U8Ptr,
    w_uk_scale: FPtr,
    granularity: Granularity,
    q_full: FPtr,
    new_cache_rows: CacheRowsArgs[dtype],
    force_fma: Bool = False,
) raises:
    """Steps 1, 3 and 4 on q: `q_full [T, H, R + Dr] = rnd(concat(fp8mm(q_nope, w_uk), rope(q_rope)))`,
    and steps 1-2 on `new_cache_rows` (`count` 0: none; see `cache_rows_args`).

    bf16 / f16: one launch of `q_step_kernel` (tensor cores; `tile` pins its
    shape, else `choose_proj_tile`); float32, `force_fma` (tests) or tiles too
    large for shared memory: `rope_norm_cache_kernel`, `rope_q_kernel` and the
    FMA matmul (`gpu_fp8_batched_matmul`).
    """
    if num_tokens == 0 or num_heads == 0:
        return
    var key_dim = kv_lora_rank + rope_dim
    var blocks = granularity.resolve(num_tokens, kv_lora_rank, nope_dim)
    var choice = proj_tile_choice[dtype, tile](num_heads, num_tokens, kv_lora_rank, nope_dim, blocks.k, force_fma)
    if choice < 0:
        gpu_rotate_and_normalize_new_rows[dtype](ctx, new_cache_rows)
        ctx.enqueue_function[rope_q_kernel[dtype]](
            q,
            input_row_offsets,
            cache_lengths,
            Int32(num_requests),
            freqs_cis,
            q_full,
            Int32(num_heads),
            Int32(nope_dim),
            Int32(rope_dim),
            Int32(kv_lora_rank),
            grid_dim=num_tokens,
            block_dim=ELEMENTWISE_THREADS,
        )
        gpu_fp8_batched_matmul[dtype, DType.float32, dtype](
            ctx,
            q,
            nope_dim + rope_dim,
            num_heads * (nope_dim + rope_dim),
            w_uk,
            w_uk_scale,
            q_full,
            key_dim,
            num_heads * key_dim,
            num_heads,
            num_tokens,
            kv_lora_rank,
            nope_dim,
            granularity,
        )
        return
    var params = QStepParams[dtype](
        Fp8Projection[dtype, DType.float32](
            q,
            Int64(nope_dim + rope_dim),
            Int64(num_heads * (nope_dim + rope_dim)),
            w_uk,
            w_uk_scale,
            q_full,
            Int64(key_dim),
            Int64(num_heads * key_dim),
            Int32(num_tokens),
            Int32(kv_lora_rank),
            Int32(nope_dim),
            Int32(blocks.m),
            Int32(blocks.n),
            Int32(blocks.k),
        ),
        freqs_cis,
        input_row_offsets,
        cache_lengths,
        Int32(num_requests),
        Int32(nope_dim),
        Int32(rope_dim),
        Int32(kv_lora_rank),
        Int32(0),
        Int32(0),
        new_cache_rows,
    )
    comptime if tile[0] > 0:
        enqueue_q_step[dtype, tile](ctx, params, num_heads)
    else:
        comptime for i in range(len(PROJ_TILES)):
            if choice == i:
                enqueue_q_step[dtype, PROJ_TILES[i]](ctx, params, num_heads)


def gpu_attention[
    dtype: DType, mma_groups: Int = 0, mma_kt: Int = 32, mma_gw: Int = 4
](
    ctx: DeviceContext,
    q_full: FPtr,
    cache: PagedLatentRows[dtype],
    input_row_offsets: U32Ptr,
    cache_lengths: U32Ptr,
    num_requests: Int,
    num_tokens: Int,
    num_heads: Int,
    kv_lora_rank: Int,
    num_partitions: Int,
    max_cache_length_hint: Int,
    scale: Float32,
    mask: MaskSpec,
    score_mod: Int,
    raw: FPtr,
    force_fma: Bool = False,
) raises:
    """Step 5: `raw [T, H, R]` from `q_full [T, H, R + Dr]` and the paged cache.

    Splits every request's keys into `num_partitions` parts (merged by
    log-sum-exp when more than one); `num_partitions <= 0` plans them from
    the grid size and `max_cache_length_hint` (see `plan_partitions`).
    `force_fma` skips the tensor-core kernel (for tests). `mma_groups > 0`
    pins the tensor-core kernel's shape to (`mma_groups` 16-row groups per
    block, `mma_kt` keys per tile, `mma_gw` warps per group; for timing the
    variants; `mma_gw = 0` pins the warpgroup kernel with `mma_kt` keys per
    tile); by default the shape is `WGMMA_SHAPE` or one of the `MMA_*` constants.
    """
    if num_tokens == 0 or num_heads == 0:
        return
    var key_dim = cache.head_dim
    var rows = num_tokens * num_heads

    # Kernel choice: tensor cores for bf16 / f16 caches of supported sizes, shape by head count.
    comptime PINNED = (mma_groups, mma_kt, mma_gw)
    var shape = (0, 0, 0)  # (groups, kt, gw); groups 0 = the FMA kernel
    comptime if USE_TENSOR_CORES and (dtype == DType.bfloat16 or dtype == DType.float16):
        if not force_fma:
            comptime if mma_groups > 0 and mma_gw == 0:
                if wgmma_supported[dtype](key_dim, kv_lora_rank):
                    shape = PINNED
            elif mma_groups > 0:
                if mma_supported[dtype, mma_gw](key_dim, kv_lora_rank):
                    shape = PINNED
            else:
                if num_heads >= WGMMA_MIN_HEADS and wgmma_supported[dtype](key_dim, kv_lora_rank):
                    shape = WGMMA_SHAPE
                elif num_heads >= 2 * MMA_ROWS and mma_supported[dtype, MMA_MANY_HEADS[2]](key_dim, kv_lora_rank):
                    shape = MMA_MANY_HEADS
                elif mma_supported[dtype, MMA_FEW_HEADS[2]](key_dim, kv_lora_rank):
                    shape = MMA_FEW_HEADS
                elif mma_supported[dtype, MMA_FEW_HEADS_SMALL_RANK[2]](key_dim, kv_lora_rank):
                    shape = MMA_FEW_HEADS_SMALL_RANK
    var rows_per_block = ATT_ROWS
    var blocks_per_sm = 1  # FMA kernel: 256 threads at up to 255 registers
    if shape[0] > 0 and shape[2] == 0:
        rows_per_block = WG_ROWS
    elif shape[0] > 0:
        rows_per_block = shape[0] * MMA_ROWS
        var threads = shape[0] * shape[2] * WARP_SIZE
        var smem = attention_mma_smem_bytes[dtype](shape[0], shape[1], shape[2], key_dim)
        blocks_per_sm = max(1, min(SM_REGISTERS // (MMA_REGISTERS * threads), SM_SHARED_MEMORY // (smem + 1024)))
    var parts = num_partitions
    if parts <= 0:
        parts = plan_partitions(num_tokens, num_heads, rows_per_block, blocks_per_sm, max_cache_length_hint)
    var part_rows = rows * parts if parts > 1 else 1
    var part_out_buf = ctx.enqueue_create_buffer[DType.float32](part_rows * kv_lora_rank if parts > 1 else 1)
    var part_max_buf = ctx.enqueue_create_buffer[DType.float32](part_rows)
    var part_sum_buf = ctx.enqueue_create_buffer[DType.float32](part_rows)
    var part_out = part_out_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var part_max = part_max_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var part_sum = part_sum_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

    var params = AttentionParams[dtype](
        q_full,
        cache.blocks,
        cache.lookup_table,
        Int32(cache.pages_per_request),
        Int32(cache.page_size),
        Int64(cache.page_stride),
        Int64(cache.layer_offset),
        input_row_offsets,
        cache_lengths,
        Int32(num_requests),
        Int32(num_heads),
        Int32(kv_lora_rank),
        Int32(key_dim),
        Int32(parts),
        scale,
        Int32(mask.kind),
        Int32(mask.window),
        Int32(score_mod),
        raw,
        part_out,
        part_max,
        part_sum,
    )

    @always_inline
    def launch_fma[cols_per_thread: Int]() raises {var ctx, var params, var num_tokens, var key_dim}:
        enqueue_attention[attention_fma_kernel[dtype, cols_per_thread], ATT_ROWS](
            ctx, params, num_tokens, ATT_THREADS, attention_smem_bytes[dtype](key_dim)
        )

    @always_inline
    def launch_mma[s: Tuple[Int, Int, Int]]() raises {var ctx, var params, var num_tokens, var key_dim}:
        comptime groups, kt, gw = s[0], s[1], s[2]
        enqueue_attention[attention_mma_kernel[dtype, groups, kt, gw], MMA_ROWS * groups](
            ctx, params, num_tokens, WARP_SIZE * gw * groups, attention_mma_smem_bytes[dtype](groups, kt, gw, key_dim)
        )

    @always_inline
    def launch_wgmma[kt: Int]() raises {var ctx, var params, var num_tokens, var key_dim}:
        enqueue_attention[attention_wgmma_kernel[dtype, kt], WG_ROWS](
            ctx, params, num_tokens, WG_BLOCK_THREADS, attention_wgmma_smem_bytes[dtype](kt, key_dim)
        )

    if shape[0] > 0:
        comptime if dtype == DType.bfloat16 or dtype == DType.float16:
            comptime if mma_groups > 0 and mma_gw == 0:
                launch_wgmma[mma_kt]()
            elif mma_groups > 0:
                launch_mma[PINNED]()
            else:
                if shape == WGMMA_SHAPE:
                    launch_wgmma[WGMMA_SHAPE[1]]()
                elif shape == MMA_MANY_HEADS:
                    launch_mma[MMA_MANY_HEADS]()
                elif shape == MMA_FEW_HEADS:
                    launch_mma[MMA_FEW_HEADS]()
                else:
                    launch_mma[MMA_FEW_HEADS_SMALL_RANK]()
    elif kv_lora_rank <= 2 * ATT_THREADS:
        launch_fma[2]()
    else:
        launch_fma[4]()
    if parts > 1:
        ctx.enqueue_function[merge_kernel[dtype]](
            part_out,
            part_max,
            part_sum,
            raw,
            Int32(rows),
            Int32(parts),
            Int32(kv_lora_rank),
            grid_dim=rows,
            block_dim=MERGE_THREADS,
        )
    # Freed in stream order, after the kernels above.
    _ = part_out_buf^
    _ = part_max_buf^
    _ = part_sum_buf^


def gpu_project_output[
    dtype: DType, tile: Tuple[Int, Int, Int, Int] = NO_TILE
](
    ctx: DeviceContext,
    raw: FPtr,
    w_uv: U8Ptr,
    w_uv_scale: FPtr,
    output: DPtr[dtype],
    num_tokens: Int,
    num_heads: Int,
    kv_lora_rank: Int,
    v_head_dim: Int,
    granularity: Granularity,
    attention_output: DPtr[dtype],
    has_attention_output: Bool,
    force_fma: Bool = False,
) raises:
    """Step 6: `output[t, h, :] = rnd(fp8mm(raw[t, h, :], w_uv[h]))`; with `has_attention_output`
    also `attention_output = raw` as dtype.

    bf16 / f16: one launch of `out_step_kernel` (tensor cores; `tile` pins
    its shape, else `choose_proj_tile`); float32, `force_fma` (tests) or tiles
    too large for shared memory: `store_kernel` and the FMA matmul.
    """
    if num_tokens == 0 or num_heads == 0:
        return
    var rows = num_tokens * num_heads
    var blocks = granularity.resolve(num_tokens, v_head_dim, kv_lora_rank)
    var choice = proj_tile_choice[dtype, tile](num_heads, num_tokens, v_head_dim, kv_lora_rank, blocks.k, force_fma)
    if choice < 0:
        if has_attention_output:
            ctx.enqueue_function[store_kernel[dtype]](
                raw, attention_output, Int64(rows * kv_lora_rank),
                grid_dim=ceil_div(rows * kv_lora_rank, ELEMENTWISE_THREADS), block_dim=ELEMENTWISE_THREADS,
            )
        gpu_fp8_batched_matmul[DType.float32, dtype](
            ctx,
            raw,
            kv_lora_rank,
            num_heads * kv_lora_rank,
            w_uv,
            w_uv_scale,
            output,
            v_head_dim,
            num_heads * v_head_dim,
            num_heads,
            num_tokens,
            v_head_dim,
            kv_lora_rank,
            granularity,
        )
        return
    var params = OutStepParams[dtype](
        Fp8Projection[DType.float32, dtype](
            raw,
            Int64(kv_lora_rank),
            Int64(num_heads * kv_lora_rank),
            w_uv,
            w_uv_scale,
            output,
            Int64(v_head_dim),
            Int64(num_heads * v_head_dim),
            Int32(num_tokens),
            Int32(v_head_dim),
            Int32(kv_lora_rank),
            Int32(blocks.m),
            Int32(blocks.n),
            Int32(blocks.k),
        ),
        attention_output,
        Int32(1 if has_attention_output else 0),
        Int32(0),
        Int32(0),
    )
    comptime if tile[0] > 0:
        enqueue_out_step[dtype, tile](ctx, params, num_heads)
    else:
        comptime for i in range(len(PROJ_TILES)):
            if choice == i:
                enqueue_out_step[dtype, PROJ_TILES[i]](ctx, params, num_heads)


def mla_decode_branch_fp8_gpu[dtype: DType](p: DecodeProblem[dtype], ctx: DeviceContext) raises:
    """All six steps on the GPU of `ctx`; every pointer of `p` is device memory.

    Enqueues the kernels on `ctx`'s stream and returns without waiting;
    reads nothing back to the host. `p.max_visible_keys()` (pages per
    request times page size) bounds every request's visible keys; it only
    shapes the key partitioning.
    """
    var output = p.output
    var q = p.q
    var input_row_offsets = p.batch.offsets
    var cache_lengths = p.batch.cache_lengths
    var num_requests = p.batch.num_requests
    var freqs_cis = p.freqs_cis
    var kv_norm_gamma = p.kv_norm_gamma
    var cache = p.cache
    var num_tokens = p.num_tokens
    var num_heads = p.num_heads
    var nope_dim = p.nope_dim
    var rope_dim = p.rope_dim
    var kv_lora_rank = p.kv_lora_rank
    var v_head_dim = p.v_head_dim
    var max_cache_length_hint = p.max_visible_keys()
    var scale = p.scale
    var epsilon = p.epsilon
    var mask = p.mask
    var score_mod = p.score_mod
    var granularity = p.granularity
    var w_uk = p.w_uk
    var w_uk_scale = p.w_uk_scale
    var w_uv = p.w_uv
    var w_uv_scale = p.w_uv_scale
    if num_tokens == 0 or num_heads == 0:
        return
    check_gpu_shapes[dtype](cache, nope_dim, rope_dim, kv_lora_rank)
    var key_dim = kv_lora_rank + rope_dim
    var rows = num_tokens * num_heads

    # Steps 1-4: the new cache rows and q_full, one launch (bf16 / f16).
    var new_cache_rows = cache_rows_args[dtype](
        cache, input_row_offsets, cache_lengths, num_requests, num_tokens,
        freqs_cis, kv_norm_gamma, epsilon, kv_lora_rank, rope_dim, p.new_rows, p.has_new_rows,
    )
    var q_full_buf = ctx.enqueue_create_buffer[DType.float32](rows * key_dim)
    var raw_buf = ctx.enqueue_create_buffer[DType.float32](rows * kv_lora_rank)
    var q_full = q_full_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var raw = raw_buf.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

    gpu_build_q_full[dtype](
        ctx, q, input_row_offsets, cache_lengths, num_requests, num_tokens, num_heads,
        nope_dim, rope_dim, kv_lora_rank, freqs_cis, w_uk, w_uk_scale, granularity, q_full, new_cache_rows,
    )
    gpu_attention[dtype](
        ctx, q_full, cache, input_row_offsets, cache_lengths, num_requests, num_tokens, num_heads,
        kv_lora_rank, 0, max_cache_length_hint, scale, mask, score_mod, raw,
    )
    # Step 6 and the optional attention-output store, one launch (bf16 / f16).
    gpu_project_output[dtype](
        ctx, raw, w_uv, w_uv_scale, output, num_tokens, num_heads, kv_lora_rank, v_head_dim, granularity,
        p.attention_output, p.has_attention_output,
    )

    # The workspaces are freed in stream order, after the kernels above.
    _ = q_full_buf^
    _ = raw_buf^
