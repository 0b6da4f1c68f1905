"""Planning of the GPU launches: one `GpuPlan` per op call, from the sizes and the device.

The plan names which attention kernel runs (`ATTENTION_VARIANTS`, each with
its `attention_supported` predicate), how many rows a block takes, that the
keys split by work (each request's share is the device schedule's,
schedule.mojo; a request of one partition is written normalized, no merge of
it) and how many blocks that split aims at (a wave), and
which tile shape the fused q and output steps take (`PROJ_TILES`,
`choose_proj_tile`; `FMA_PATH` for the float32 FMA path), and whether the
kernels after the q step start early (`pdl`, programmatic dependent launch) and
whether the partition merge quantizes step 6's activations (`quantize_in_merge`) and which of its
instances runs (`merge_ahead`). The device's
multiprocessor count, shared memory and registers come from its
`DeviceContext` (`DeviceLimits.read`; an H200 reads 132 SMs, 228 KiB per SM,
227 KiB per block). Tests pin a kernel or tile by building a plan.
"""

from max.gpu import WARP_SIZE
from max.gpu.host import DeviceAttribute, DeviceContext

from ..common import ceil_div
from ..problem import DecodeProblem
from ..spec import BlockShape
from .attention_fma import ATT_ROWS, ATT_THREADS, attention_smem_bytes
from .attention_mma import MMA_ROWS, attention_mma_smem_bytes, mma_supported
from .attention_narrow import N9_ROWS
from .attention_sm90 import sm90_supported
from .attention_wgmma import WG_ROWS, wgmma_supported
from .tma_smem import S9_ROWS
from .projection import MATMUL_SMEM_FLOATS
from .projection_mma import TileLayout
from .projection_wgmma import wg_tile_supported
from .steps_fused import is_wg_tile, tile_cols, tile_rows

# Attention kernels as (16-row groups per block, keys per tile, warps per group): the fastest of
# the variants timed on the H200 (benchmarks/results/gpu_variants.log; `gpu_bench variants`).
# The warpgroup kernel (attention_wgmma.mojo): 4 groups = its 64 rows, 0 warps per group marks it
# (two warpgroups of 4 warps); the default from WGMMA_MIN_HEADS heads (H200: 2.1x the MMA kernel
# at 128 heads, half its speed at 16 heads; benchmarks/results/h200-2026-12-03-wgmma/gpu_variants.log).
comptime WGMMA_SHAPE = (WG_ROWS // MMA_ROWS, 64, 0)
comptime WGMMA_MIN_HEADS = 64
# The TMA kernel with a producer warpgroup (attention_sm90.mojo): its 64 rows, 64-key blocks, -1
# warps per group marks it. The default from SM90_MIN_HEADS heads where it handles the sizes
# (it comes first). H200, step 5 alone (`gpu_bench variants`, 2026-12-05,
# benchmarks/results/h200-2026-12-05e/): 128 heads b64 8k 346 us against the wgmma kernel's
# 680, b8 8k 69 against 118; at 16 heads it wins at batch 64 (225 against the mma kernel's 245
# us) and 128, and loses at batch 8 (69 against 49), so below 64 heads the mma kernels stay.
comptime SM90_SHAPE = (S9_ROWS // MMA_ROWS, 64, -1)
# Since step 5 is split by work (more blocks per request) it wins at 16 heads too (H200,
# 2026-12-05, seventh session, benchmarks/results/h200-2026-12-05g/variants_fp8.log, step 5
# alone): b64 8k 188 us against the mma kernel's 250, b8 8k 44 against 49.
comptime SM90_MIN_HEADS = 16
# The narrow TMA kernel (attention_narrow.mojo): keys as the M of its wgmmas, 16 rows per block, -2
# warps per group marks it. The op's choice for an fp8_ds_mla cache at up to N9_ROWS heads (one
# block's rows per token), where the 64-row kernel is bound by its padded math, not by the bytes.
# H100, 2026-12-05, tenth session (benchmarks/results/h100-2026-12-05k/), fp8 rows, 16 h b64 8k:
# step 5 187.5 us against the 64-row kernel's 257.0; the whole op 16 h b8 8k / b64 8k / b128 32k
# 74.6 / 281.5 / 1898 -> 62.6 / 209.9 / 1417 us. On bf16 rows 227.7 against 231.5 us (not taken:
# within run-to-run spread), at 128 heads b8 2x slower.
comptime NARROW_SHAPE = (N9_ROWS // MMA_ROWS, 64, -2)
comptime NARROW_MAX_HEADS = N9_ROWS
comptime MMA_MANY_HEADS = (2, 64, 4)  # 32 heads or more: two groups share every key tile
comptime MMA_FEW_HEADS = (1, 64, 8)  # fewer heads; needs kv_lora_rank % 128 == 0
# (H200, 16 heads, B128 L32k, step 5: 1798.5 us; (1, 32, 4) 1895 us; (1, 32, 8) 2262 us, and
# 2230-2256 us with a ring of 3-5 cp.async key buffers: deeper prefetch does not help;
# benchmarks/results/h200-2026-12-03-attn/)
comptime MMA_FEW_HEADS_SMALL_RANK = (1, 32, 4)  # fewer heads, kv_lora_rank % 64 == 0
comptime FMA_SHAPE = (0, 0, 0)  # attention_fma.mojo: float32 FMA, any dtype and size
# The op takes the first variant its head count reaches whose kernel handles the sizes.
comptime ATTENTION_VARIANTS = (
    NARROW_SHAPE, SM90_SHAPE, WGMMA_SHAPE, MMA_MANY_HEADS, MMA_FEW_HEADS, MMA_FEW_HEADS_SMALL_RANK, FMA_SHAPE
)
comptime ATTENTION_MIN_HEADS = (0, SM90_MIN_HEADS, WGMMA_MIN_HEADS, 2 * MMA_ROWS, 0, 0, 0)
comptime FMA_ATTENTION = len(ATTENTION_VARIANTS) - 1

comptime MMA_REGISTERS = 256  # registers per thread the tensor-core kernels use (ptxas: 208-255)
comptime SPLIT_BY_WORK = 0  # GpuPlan.num_partitions: each request's share of the work (schedule.mojo)

# Projection tile shapes (warps_m, warps_n, m16 tiles per warp, n8 tiles per warp), smallest first:
# 16 x 32, 16 x 64 (4 warps) and 32 x 128 (8 warps). Chosen on the H200 (2026-12-03, build
# 93ae151, ncu GPU time of each step alone, bf16, `gpu_bench proj`): 128 heads, 64 tokens:
# q step 81.6 / 51.7 / 36.8 us, output step 61.5 / 39.3 / 23.1 us; 16 heads, 8 tokens: q 8.4 /
# 8.6 / 9.5 us, output 15.9 / 17.5 / 23.1 us. A 64 x 128 tile (2, 4, 2, 4; 168 registers,
# one block per SM) lost everywhere (q 44.9 and 14.3 us, output 27.1 and 40.3 us) and was dropped.
# A larger tile replaces a smaller one when its grid still has a block per SM and fewer of them
# (fewer re-staged activations and weights); the smallest tile is the default. 16 x 128 (1, 4, 1,
# 4), a head's output columns per block, joined on the H200 (2026-12-05, seventh session,
# benchmarks/results/h200-2026-12-05g/): where it ties 32 x 128 on blocks (128 heads, 8 tokens:
# 16 rows hold them) the q step takes 12.6 us against 20.9 (H100) and the whole op 101 -> 93 us;
# 16 heads b8 unchanged (64.5 -> 64.5 us, its grid is too small for this tile).
# The q step's wgmma tile (warpgroups, m64 tiles per warpgroup, rows, 0; `is_wg_tile`; projection_wgmma.mojo):
# two warpgroups of two m64 tiles over 64 rows, where it handles the projection (`wg_tile_supported`:
# DeepSeek's q projection, one K block, per-row scales) and a head has at least WG_MIN_ROWS tokens, by the
# same rule of blocks. H100, 2026-12-07 (benchmarks/results/h100-2026-12-07g-wgmma-q/, `gpu_bench proj`, the
# step alone, two rounds): 128 h b64 8k 29.1 -> 22.4-22.9 us; at 16 h b8 the mma.sync tiles stay faster
# (6.5 us against 7.2-13.9 for wgmma tiles of 16 or 64 rows), and step 6 on wgmma (tried: its quantized
# rows copied into the swizzled operand by loads and stores) took 47 against 16 us at 128 h b64. The whole
# op alternated with main (same folder, call 3): 128 h b64 8k 359.3 / 359.7 -> 355.6 / 356.9 us, 128 h b128
# 32k 2412 / 2413 -> 2394 / 2396 us, the shapes where the tile is not taken level; capped at 80 registers
# for 3 blocks an SM (the launch's 65 light blocks in the same wave; 184 bytes spilled) it was level with main.
comptime PROJ_TILES = ((1, 4, 1, 1), (1, 4, 1, 2), (1, 4, 1, 4), (2, 4, 1, 4), (2, 2, 64, 0))
comptime WG_MIN_ROWS = 32
comptime FMA_PATH = -1  # a projection on float32 FMA units: float32, or no tile fits in shared memory

# Programmatic dependent launch (pdl.mojo) of the attention kernel, the merge and the output step,
# each after the kernel ahead of it. Off: on the H200 (2026-12-05, bf16, `gpu_bench bench`, best of
# 2 alternated rounds; benchmarks/results/h200-2026-12-05b/bench_pdl.log) it cost 1.8-2.3 us per
# call (16 h b8 8k: 73.4 -> 75.2 us; 128 h b64 8k: 737.6 -> 739.9 us): today's kernels have
# little prologue to overlap. With every kernel letting its dependents in at entry it cost 6-10 us
# (H100, 2026-12-05h, 16 h b8 8k 69.6 -> 77.6, 128 h b8 8k 98.1 -> 106.3). The kernels now trigger
# late (pdl.mojo), and PDL on is faster at every shape measured: 3-6 us on the H100 (2026-12-05j and
# k) and 1.5-6.6 us on the H200 (2026-12-05l gpu_both.log, bf16 and fp8_ds_mla caches, 16 and 128
# heads, b8 to b128). The cuda parity grid (147 passed) and the serving tests (CUDA-graph replay,
# 4 passed) ran through MAX with it on (H200, 2026-12-05l): on.
comptime PDL_DEFAULT = True
# Step 6's activation quantization in the partition merge (merge.mojo, `QuantizedRows`) where the
# sizes allow it (`pipeline.merge_quantizes`). On: same H200 run, 16 h b8 8k 73.4 -> 65.8 us per
# call (-7.6 us, -10%), 128 h b64 8k 737.6 -> 737.3 us; gpu_smoke checks the op both ways.
comptime QUANTIZE_IN_MERGE_DEFAULT = True
# The split-KV schedule (schedule.mojo) built by one more block of the q step's launch (bf16 / f16),
# not by a launch of its own before it: the own launch cost 7-10 us more per call (H100, 2026-12-05,
# `gpu_bench bench`, 16 h b8 8k 73.7 against 66.4 us, 128 h b8 8k 125.0 against 115.2 us;
# benchmarks/results/h100-2026-12-05f/).
comptime SCHEDULE_IN_Q_STEP_DEFAULT = True


@fieldwise_init
struct DeviceLimits(TrivialRegisterPassable):
    """What the plan reads from the device: multiprocessors, shared memory, registers."""

    var sm_count: Int
    var smem_per_sm: Int
    var smem_per_block: Int  # opt-in dynamic shared memory per block
    var registers_per_sm: Int

    @staticmethod
    def read(ctx: DeviceContext) raises -> Self:
        return Self(
            ctx.get_attribute(DeviceAttribute.MULTIPROCESSOR_COUNT),
            ctx.get_attribute(DeviceAttribute.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
            ctx.get_attribute(DeviceAttribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            ctx.get_attribute(DeviceAttribute.MAX_REGISTERS_PER_MULTIPROCESSOR),
        )


def attention_supported[
    dtype: DType, v: Tuple[Int, Int, Int]
](key_dim: Int, kv_lora_rank: Int, page_size: Int) -> Bool:
    """Whether the attention kernel of variant `v` handles these sizes (the FMA kernel: always)."""
    comptime if v[0] == 0:
        return True
    elif v[2] < 0:
        return sm90_supported[dtype](key_dim, kv_lora_rank, page_size)
    elif v[2] == 0:
        return wgmma_supported[dtype](key_dim, kv_lora_rank)
    else:
        return mma_supported[dtype, v[2]](key_dim, kv_lora_rank)


def choose_attention[
    dtype: DType
](num_heads: Int, key_dim: Int, kv_lora_rank: Int, page_size: Int, fp8: Bool = False) -> Int:
    """Index in ATTENTION_VARIANTS of the op's attention kernel: the first whose head counts take
    `num_heads` and whose kernel handles the sizes (every tensor-core kernel reads `fp8_ds_mla` rows; the
    narrow kernel is taken for them alone, `fp8`, at up to NARROW_MAX_HEADS heads)."""
    comptime for i in range(len(ATTENTION_VARIANTS)):
        comptime v = ATTENTION_VARIANTS[i]
        var heads_ok = num_heads >= ATTENTION_MIN_HEADS[i]
        comptime if v[2] == NARROW_SHAPE[2]:
            heads_ok = fp8 and num_heads <= NARROW_MAX_HEADS
        if heads_ok and attention_supported[dtype, v](key_dim, kv_lora_rank, page_size):
            return i
    return FMA_ATTENTION


def attention_rows_per_block(v: Tuple[Int, Int, Int]) -> Int:
    """(token, head) rows one block of variant `v` takes."""
    if v[0] == 0:
        return ATT_ROWS
    if v[2] == NARROW_SHAPE[2]:
        return N9_ROWS
    if v[2] < 0:
        return S9_ROWS
    if v[2] == 0:
        return WG_ROWS
    return v[0] * MMA_ROWS


def fp8_row_bytes[dtype: DType](p: DecodeProblem[dtype]) -> Int:
    """Bytes per `fp8_ds_mla` cache row of `p`, 0 for a cache of `dtype` rows."""
    return p.fp8_cache.row_bytes if p.fp8_cache.active else 0


def attention_blocks_per_sm[
    dtype: DType
](v: Tuple[Int, Int, Int], key_dim: Int, limits: DeviceLimits, fp8_rows: Int = 0) -> Int:
    """Blocks of variant `v` one SM holds (FMA: 256 threads at up to 255 registers; wgmma, sm90: one);
    `fp8_rows`: the bytes of an `fp8_ds_mla` cache's rows."""
    if v[0] == 0 or v[2] <= 0:
        return 1
    var threads = v[0] * v[2] * WARP_SIZE
    var smem = attention_mma_smem_bytes[dtype](v[0], v[1], v[2], key_dim, fp8_rows)
    return max(1, min(limits.registers_per_sm // (MMA_REGISTERS * threads), limits.smem_per_sm // (smem + 1024)))


def attention_split[
    dtype: DType
](p: DecodeProblem[dtype], v: Tuple[Int, Int, Int], limits: DeviceLimits) -> Tuple[Int, Int]:
    """`GpuPlan.num_partitions` and `split_target` for variant `v` on problem `p`: split by work, aiming
    at one wave of blocks.

    Always: the host knows no request's length, only the sizes, and the device schedule gives a
    request one partition where the batch already fills the wave (its rows then go out normalized,
    `AttentionBlock.normalized`). Deciding from the sizes alone kept one long request beside short
    ones in one block per row slot. H100, 128 h b64, 1 x 8k + 63 x 512: step 5 97 us against 361
    without a split, the whole op 159 against 397 us; the uniform 8k batch pays the merge's launch,
    step 5 362 against 349 us, the whole op 426 against 404 us
    (benchmarks/results/h100-2026-12-05h/split-always/).
    """
    var blocks_per_sm = attention_blocks_per_sm[dtype](v, p.key_dim(), limits, fp8_row_bytes(p))
    return (SPLIT_BY_WORK, limits.sm_count * blocks_per_sm)


def tile_fits(tile: Tuple[Int, Int, Int, Int], depth: Int, block_k: Int, smem_per_block: Int) -> Bool:
    """Whether a block of `tile` on a projection of depth `depth`, K blocks `block_k`, fits in shared memory."""
    return TileLayout.create(depth, block_k).smem_bytes(tile_rows(tile), tile_cols(tile)) <= smem_per_block


def proj_tile_supported(
    tile: Tuple[Int, Int, Int, Int], n_out: Int, depth: Int, blocks: BlockShape, smem_per_block: Int, wgmma: Bool
) -> Bool:
    """Whether a projection (`n_out` x `depth` weights, scale `blocks`) can take `tile`: it fits in shared memory
    and, a wgmma tile, `wgmma` allows one (the q step) and `wg_tile_supported` holds."""
    if is_wg_tile(tile) and not (wgmma and wg_tile_supported(tile_rows(tile), tile_cols(tile), n_out, depth, blocks.m, blocks.k)):
        return False
    return tile_fits(tile, depth, blocks.k, smem_per_block)


comptime PROJ_FILL_SIXTEENTHS = 15
"""A projection's tile is the one with the fewest blocks that still give this many sixteenths of the SMs a
block (the first tile that fits where none does). 15 rather than 16 (all of them): at 16 h b8 the q step's
16 x 64 tile (128 blocks on 132 SMs) instead of 16 x 32 (256), at 16 h b64 32 x 128 (128) instead of 16 x
128 (256). H100, 2026-12-07 (benchmarks/results/h100-2026-12-07e-rl3/, call 13), whole op alternated, two
rounds: 16 h b8 8k on fp8 rows 52.7 / 52.9 -> 51.6 / 51.2 us, bf16 rows and 16 h b64 level, 128 heads
unchanged (the same tiles)."""


def choose_proj_tile[
    dtype: DType
](groups: Int, rows: Int, n_out: Int, depth: Int, blocks: BlockShape, limits: DeviceLimits, wgmma: Bool) -> Int:
    """Index in PROJ_TILES of the tile for a projection, or FMA_PATH (float32, or no tile fits): the wgmma tile
    where `wgmma` allows it (the q step), `rows` (tokens a head) reach WG_MIN_ROWS and it handles the
    projection and its grid has the fewest blocks that still fill the SMs, else an mma.sync tile."""
    comptime if dtype == DType.float32:
        return FMA_PATH
    var smem = limits.smem_per_block
    var best = FMA_PATH
    var best_blocks = 0
    var enough = limits.sm_count * PROJ_FILL_SIXTEENTHS // 16
    comptime for i in range(len(PROJ_TILES)):
        comptime t = PROJ_TILES[i]
        var rows_ok = not is_wg_tile(t) or rows >= WG_MIN_ROWS
        if rows_ok and proj_tile_supported(t, n_out, depth, blocks, smem, wgmma):
            var blocks = groups * ceil_div(rows, tile_rows(t)) * ceil_div(n_out, tile_cols(t))
            if best < 0 or (blocks >= enough and blocks < best_blocks):
                best = i
                best_blocks = blocks
    return best


@fieldwise_init
struct GpuPlan(TrivialRegisterPassable):
    """How one op call runs on the GPU: its attention kernel and partitions, its projection tiles."""

    var attention: Int  # index in ATTENTION_VARIANTS
    var rows_per_block: Int  # of the attention kernel
    # 1: no split (each block writes its rows normalized, no merge); SPLIT_BY_WORK: the device
    # schedule's partitions aiming at `split_target` blocks; n > 1 (tests): n for every request.
    var num_partitions: Int
    var split_target: Int  # attention blocks a split aims at: one wave
    var q_tile: Int  # steps 1-4: index in PROJ_TILES, or FMA_PATH
    var out_tile: Int  # step 6: index in PROJ_TILES, or FMA_PATH
    var pdl: Bool  # launch step 5, the merge and step 6 with programmatic dependent launch (pdl.mojo)
    var quantize_in_merge: Bool  # the merge quantizes step 6's activations, where the sizes allow
    var schedule_in_q_step: Bool  # the split's schedule built in the q step's launch (bf16 / f16)
    # The merge's instance that loads a row's partitions ahead of their weights (merge.mojo): where each
    # row's block has an SM to itself (rows <= SMs), so its registers cost no blocks.
    var merge_ahead: Bool

    @staticmethod
    def create[dtype: DType](p: DecodeProblem[dtype], limits: DeviceLimits) -> Self:
        """The op's plan for `p` on a device of `limits`."""
        var attention = choose_attention[dtype](
            p.num_heads, p.key_dim(), p.kv_lora_rank, p.cache.page_size, p.fp8_cache.active
        )
        return Self.with_attention(p, limits, attention)

    @staticmethod
    def with_attention[dtype: DType](p: DecodeProblem[dtype], limits: DeviceLimits, attention: Int) -> Self:
        """The plan for `p` around attention kernel `attention` (an index in ATTENTION_VARIANTS)."""
        var rows_per_block = 0
        var split = (1, 0)
        comptime for i in range(len(ATTENTION_VARIANTS)):
            if attention == i:
                rows_per_block = attention_rows_per_block(ATTENTION_VARIANTS[i])
                split = attention_split(p, ATTENTION_VARIANTS[i], limits)
        var q_blocks = p.granularity.resolve(p.num_tokens, p.kv_lora_rank, p.nope_dim)
        var out_blocks = p.granularity.resolve(p.num_tokens, p.v_head_dim, p.kv_lora_rank)
        return Self(
            attention,
            rows_per_block,
            split[0],
            split[1],
            choose_proj_tile[dtype](p.num_heads, p.num_tokens, p.kv_lora_rank, p.nope_dim, q_blocks, limits, True),
            choose_proj_tile[dtype](p.num_heads, p.num_tokens, p.v_head_dim, p.kv_lora_rank, out_blocks, limits, False),
            PDL_DEFAULT,
            QUANTIZE_IN_MERGE_DEFAULT,
            SCHEDULE_IN_Q_STEP_DEFAULT,
            p.num_tokens * p.num_heads <= limits.sm_count,
        )


def check_gpu_shapes[dtype: DType](p: DecodeProblem[dtype], limits: DeviceLimits) raises:
    """Raises for sizes the GPU kernels do not handle."""
    var key_dim = p.key_dim()
    if p.fp8_cache.active:
        check_fp8_shapes(p)
    elif p.cache.head_dim != key_dim:
        raise Error("pymla gpu: cache head_dim ", p.cache.head_dim, " != kv_lora_rank + rope_dim = ", key_dim)
    if p.kv_lora_rank % 4 != 0 or p.rope_dim % 4 != 0:
        raise Error("pymla gpu: kv_lora_rank and rope_dim must be multiples of 4")
    if p.nope_dim > MATMUL_SMEM_FLOATS or p.kv_lora_rank > MATMUL_SMEM_FLOATS:
        raise Error("pymla gpu: nope_dim and kv_lora_rank must be at most ", MATMUL_SMEM_FLOATS)
    if p.kv_lora_rank > 4 * ATT_THREADS:
        raise Error("pymla gpu: kv_lora_rank must be at most ", 4 * ATT_THREADS)
    var smem = attention_smem_bytes[dtype](key_dim)
    if smem > limits.smem_per_block:
        raise Error("pymla gpu: key dim ", key_dim, " needs ", smem, " bytes of shared memory")


def check_fp8_shapes[dtype: DType](p: DecodeProblem[dtype]) raises:
    """Raises for `fp8_ds_mla` rows the GPU does not read: a dtype other than bfloat16, a row size other than
    `R + 4 R / 128 + 2 Dr`, or sizes no tensor-core attention kernel takes (the FMA kernel reads no fp8 rows)."""
    comptime if dtype != DType.bfloat16:
        raise Error("pymla gpu: fp8_ds_mla rows serve bfloat16 ops, got ", dtype)
    var rank = p.kv_lora_rank
    var row_bytes = rank + 4 * (rank // 128) + 2 * p.rope_dim
    if rank % 128 != 0 or p.fp8_cache.row_bytes != row_bytes:
        raise Error("pymla gpu: fp8_ds_mla rows of ", p.fp8_cache.row_bytes, " bytes, expected ", row_bytes, " (kv_lora_rank a multiple of 128)")
    if choose_attention[dtype](p.num_heads, p.key_dim(), rank, p.cache.page_size) == FMA_ATTENTION:
        raise Error(
            "pymla gpu: fp8_ds_mla rows need a tensor-core attention kernel: key dim ", p.key_dim(),
            " (a multiple of 16, at most 576) and kv_lora_rank ", rank, " (at most 512)",
        )
