"""Steps 1-4 and step 6 on the GPU as one launch each, fp8 projections on tensor cores.

* `q_step_kernel`: the new cache rows' RMSNorm + RoPE (`cache_rows.count` blocks,
  `rope_norm_cache_row`), after them one block that builds step 5's split schedule when
  there is one (`build_schedule`, schedule.mojo), before them one block per (head, row tile, column
  tile) of `q_full[:, :, :R] = rnd(fp8mm(q_nope, w_uk))` (`projection_mma.mojo`);
  the blocks of column tile 0 also write `q_full[:, :, R:] = rnd(rope(q_rope))`.
* `out_step_kernel`: one block per (head, row tile, column tile) of
  `output = rnd(fp8mm(raw, w_uv))`; the blocks of column tile 0 also store the
  attention output (`raw` as dtype) when it is wanted. When the partition merge
  quantized raw already (`QuantizedRows`, merge.mojo) the block copies those
  rows and scales instead (`stage_quantized`), and the merge stored the attention output.

With programmatic dependent launch (`GpuPlan.pdl`, pdl.mojo) the output step
stages its weights before waiting for the attention kernel or merge, and the
q step lets the attention kernel launch early.

Each launch takes one parameter struct (`QStepParams`, `OutStepParams`; `params.mojo`).

The tile shape is a compile-time `(warps_m, warps_n, tm, tn)`: a block of
`warps_m x warps_n` warps, each owning `16 tm` rows x `8 tn` columns (`project_tile`),
or the q step's wgmma tile `(warpgroups, m64 tiles per warpgroup, rows, 0)`
(`project_tile_wg`, projection_wgmma.mojo); the plan picks it from `PROJ_TILES` (`plan.mojo`).
"""

from max.gpu import WARP_SIZE, barrier, block_idx, grid_dim, thread_idx
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.memory import AddressSpace, async_copy_wait_all, external_memory

from ..common import ceil_div, div_u32
from .params import DeviceBatch, GPtr, KernelParams
from .pdl import allow_dependents, launch_attributes, wait_for_producers
from .attention_block import fence_async_proxy
from .projection_mma import (
    Fp8Projection,
    QuantizedRows,
    TileLayout,
    TileSmem,
    project_tile,
    stage_activations,
    stage_quantized,
    stage_weights,
)
from .projection_wgmma import WG_THREADS, WG_TILE_COLS, project_tile_wg
from .rope_norm import CacheRowsParams, rope_norm_cache_row, rope_q_pairs
from .schedule import ScheduleParams, build_schedule, schedule_smem_bytes


def is_wg_tile(tile: Tuple[Int, Int, Int, Int]) -> Bool:
    """Whether `tile` is a wgmma tile `(warpgroups, m64 tiles per warpgroup, rows, 0)` (projection_wgmma.mojo, the
    q step alone) rather than an mma.sync tile `(warps_m, warps_n, tm, tn)`."""
    return tile[3] == 0


def tile_rows(tile: Tuple[Int, Int, Int, Int]) -> Int:
    return tile[2] if is_wg_tile(tile) else tile[0] * tile[2] * 16


def tile_cols(tile: Tuple[Int, Int, Int, Int]) -> Int:
    return WG_TILE_COLS * tile[0] * tile[1] if is_wg_tile(tile) else tile[1] * tile[3] * 8


def tile_threads(tile: Tuple[Int, Int, Int, Int]) -> Int:
    return WG_THREADS * tile[0] if is_wg_tile(tile) else tile[0] * tile[1] * WARP_SIZE


@fieldwise_init
struct TileGrid(TrivialRegisterPassable):
    """A projection step's tiles per group (head): `m_tiles` row tiles x `n_tiles` column tiles (`fit` sets them)."""

    var m_tiles: Int32
    var n_tiles: Int32

    @staticmethod
    def unset() -> Self:
        return Self(0, 0)

    def fit[
        in_dtype: DType, out_dtype: DType, //, tile: Tuple[Int, Int, Int, Int]
    ](mut self, proj: Fp8Projection[in_dtype, out_dtype]) -> Int:
        """Sets the tile counts of `proj` in tiles of `tile`; returns a block's dynamic shared memory."""
        var grid = proj.tile_grid(tile_rows(tile), tile_cols(tile))
        self.m_tiles = Int32(grid[0])
        self.n_tiles = Int32(grid[1])
        return grid[2]

    def blocks(self, groups: Int) -> Int:
        return groups * Int(self.m_tiles) * Int(self.n_tiles)


@fieldwise_init
struct QStepParams[dtype: DType](KernelParams):
    """Parameters of `q_step_kernel`: steps 1-4 (q_full) and steps 1-2 (the new cache rows)."""

    var proj: Fp8Projection[Self.dtype, DType.float32]  # a = q_nope (q [T, H, Dn + Dr]), c = q_full [T, H, R + Dr]
    var freqs_cis: GPtr[Self.dtype]  # [positions, Dr]
    var batch: DeviceBatch
    var nope_dim: Int32  # Dn
    var rope_dim: Int32  # Dr
    var kv_lora_rank: Int32  # R
    var tiles: TileGrid
    var cache_rows: CacheRowsParams[Self.dtype]  # count = 0: no cache rows in this launch
    var schedule: ScheduleParams  # active: one more block builds step 5's split schedule (schedule.mojo)


@fieldwise_init
struct OutStepParams[dtype: DType](KernelParams):
    """Parameters of `out_step_kernel`: step 6 and the optional attention-output store."""

    var proj: Fp8Projection[DType.float32, Self.dtype]  # a = raw [T, H, R], c = output [T, H, Dv]
    var attention_output: GPtr[Self.dtype]  # [T, H, R] when has_attention_output
    var has_attention_output: Int32
    var tiles: TileGrid
    var quant: QuantizedRows  # active: the merge quantized raw (and stored the attention output)


@always_inline
def tile_of_block(blk: Int, tiles: TileGrid) -> Tuple[Int, Int, Int]:
    """(group, row tile, column tile) of projection block `blk`; neighbours share their weight tile."""
    var m_tiles = Int(tiles.m_tiles)
    var per_group = m_tiles * Int(tiles.n_tiles)
    var group = div_u32(blk, per_group)
    var rest = blk - group * per_group
    var col = div_u32(rest, m_tiles)
    return (group, rest - col * m_tiles, col)


def q_step_kernel[dtype: DType, warps_m: Int, warps_n: Int, tm: Int, tn: Int](p: QStepParams[dtype]):
    """Grid `H m_tiles n_tiles + cache_rows.count (+ 1 with a schedule)`, `tile_threads` threads,
    `smem_bytes` dynamic (at least `schedule_smem_bytes`). A wgmma tile (`is_wg_tile`: `tn` 0) projects
    with `project_tile_wg` (warpgroups `warps_m`, m64 tiles `warps_n` each, rows `tm`)."""
    comptime TILE = (warps_m, warps_n, tm, tn)
    comptime WG = is_wg_tile(TILE)
    comptime THREADS = tile_threads(TILE)
    comptime MT = tile_rows(TILE)
    comptime NT = tile_cols(TILE)
    var blk = block_idx.x
    # The cache rows are the last blocks but one: latency-bound (one scattered cache row each),
    # they fill the projection's last, partial wave instead of holding SMs at the start. The
    # very last builds step 5's split schedule when there is one.
    var schedule_blocks = 1 if p.schedule.active() else 0
    if schedule_blocks == 1 and blk == grid_dim.x - 1:
        build_schedule[THREADS](p.schedule, external_memory[Int64, address_space=AddressSpace.SHARED, alignment=16]())
        return
    var proj_blocks = grid_dim.x - schedule_blocks - Int(p.cache_rows.count)
    if blk >= proj_blocks:
        rope_norm_cache_row[dtype, THREADS](p.cache_rows, blk - proj_blocks)
        return
    var tile = tile_of_block(blk, p.tiles)
    var g = tile[0]
    var m0 = tile[1] * MT
    var n0 = tile[2] * NT
    var lay = TileLayout.create(Int(p.proj.depth), Int(p.proj.blocks.k))
    # 1024-byte aligned: a wgmma tile's activations are 128-byte-swizzled boxes.
    var sm = TileSmem.carve(external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=1024](), lay, MT, NT)

    stage_weights[dtype, DType.float32, THREADS](p.proj, lay, sm, g, n0, NT)
    stage_activations[dtype, DType.float32, DType.float32, THREADS // WARP_SIZE, swizzled=WG](
        p.proj, lay, sm, g, m0, MT, p.proj.c.ptr, 0, 0, False
    )
    if tile[2] == 0:
        rope_q_tile[THREADS](p, g, m0, min(MT, Int(p.proj.rows) - m0))
    async_copy_wait_all()
    comptime if WG:
        fence_async_proxy()  # the activations' stores, before wgmma reads them
    barrier()
    comptime if WG:
        project_tile_wg[dtype, warps_n, tm](p.proj, lay, sm, g, m0, n0)
    else:
        project_tile[dtype, DType.float32, dtype, warps_m, warps_n, tm, tn](p.proj, lay, sm, g, m0, n0)


@always_inline
def rope_q_tile[dtype: DType, //, threads: Int](p: QStepParams[dtype], g: Int, m0: Int, rows: Int):
    """`q_full[t, g, R:] = rope(q[t, g, Dn:])` for rows `m0 .. m0 + rows`: items of 8 pairs, spread over the
    block's threads, with vector loads and stores where the offsets allow, else pair by pair (the last
    item of a row may hold fewer); each item looks its row's position up once, and all of a thread's
    items are independent (their loads overlap)."""
    var rope = Int(p.rope_dim)
    var nope = Int(p.nope_dim)
    var rank = Int(p.kv_lora_rank)
    var a = p.proj.a
    var c = p.proj.c
    var vec = (
        rope % 16 == 0 and nope % 8 == 0 and rank % 4 == 0 and Int(a.g_stride) % 8 == 0 and Int(a.m_stride) % 8 == 0
        and Int(c.g_stride) % 4 == 0 and Int(c.m_stride) % 4 == 0
        and Int(a.ptr) % 16 == 0 and Int(c.ptr) % 16 == 0 and Int(p.freqs_cis) % 16 == 0
    )
    comptime ITEM = 8  # pairs
    var pairs = rope // 2
    var per_row = ceil_div(pairs, ITEM)
    for i in range(thread_idx.x, rows * per_row, threads):
        var r = div_u32(i, per_row)
        var j = i - r * per_row
        var t = m0 + r
        var q_row = a.ptr.unsafe_offset(g * Int(a.g_stride) + t * Int(a.m_stride))
        var freqs = p.freqs_cis.unsafe_offset(p.batch.token_position(t) * rope)
        var out_row = c.ptr.unsafe_offset(g * Int(c.g_stride) + t * Int(c.m_stride))
        if vec:
            rope_q_pairs[dtype, ITEM](q_row, freqs, out_row, nope, rank, j)
        else:
            for k in range(ITEM * j, min(ITEM * (j + 1), pairs)):
                rope_q_pairs[dtype, 1](q_row, freqs, out_row, nope, rank, k)


def out_step_kernel[dtype: DType, warps_m: Int, warps_n: Int, tm: Int, tn: Int](p: OutStepParams[dtype]):
    """Grid `H m_tiles n_tiles`, `32 warps_m warps_n` threads, `smem_bytes` dynamic."""
    comptime THREADS = warps_m * warps_n * WARP_SIZE
    comptime MT = warps_m * tm * 16
    comptime NT = warps_n * tn * 8
    var tile = tile_of_block(block_idx.x, p.tiles)
    var g = tile[0]
    var m0 = tile[1] * MT
    var n0 = tile[2] * NT
    var lay = TileLayout.create(Int(p.proj.depth), Int(p.proj.blocks.k))
    var sm = TileSmem.carve(external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=16](), lay, MT, NT)

    stage_weights[DType.float32, dtype, THREADS](p.proj, lay, sm, g, n0, NT)
    # The weights are the op's inputs; raw comes from the attention kernel or the merge (pdl.mojo).
    wait_for_producers()
    allow_dependents()
    if p.quant.active != 0:
        stage_quantized[THREADS](p.quant, lay, sm, g, m0, MT, Int(p.proj.rows))
    else:
        # raw and the attention output share their layout [T, H, R].
        stage_activations[DType.float32, dtype, dtype, THREADS // WARP_SIZE](
            p.proj, lay, sm, g, m0, MT, p.attention_output, Int(p.proj.a.g_stride), Int(p.proj.a.m_stride),
            p.has_attention_output != 0 and tile[2] == 0,
        )
    async_copy_wait_all()
    barrier()
    project_tile[DType.float32, dtype, dtype, warps_m, warps_n, tm, tn](p.proj, lay, sm, g, m0, n0)


# ---------------------------------------------------------------------------
# Host side: one launch each
# ---------------------------------------------------------------------------


def enqueue_tiles[
    P: KernelParams, //, kernel: def(P) thin -> None, tile: Tuple[Int, Int, Int, Int]
](ctx: DeviceContext, params: P, blocks: Int, smem_bytes: Int, pdl: Bool) raises:
    """Launches a projection step of `tile`: `blocks` blocks, `smem_bytes` of dynamic shared memory each;
    with `pdl`, programmatic dependent launch after the kernel ahead of it (pdl.mojo)."""
    ctx.enqueue_function[kernel](
        params,
        grid_dim=blocks,
        block_dim=tile_threads(tile),
        shared_mem_bytes=smem_bytes,
        func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem_bytes)),
        attributes=launch_attributes(pdl),
    )


def enqueue_q_step[dtype: DType, tile: Tuple[Int, Int, Int, Int]](ctx: DeviceContext, p: QStepParams[dtype], groups: Int) raises:
    """Launches `q_step_kernel` with `tile` over `groups` heads (and `p.cache_rows.count` blocks of cache rows,
    and one for the schedule when `p.schedule` is active)."""
    var params = p
    var smem = max(params.tiles.fit[tile](p.proj), schedule_smem_bytes(tile_threads(tile)))
    var blocks = Int(p.cache_rows.count) + params.tiles.blocks(groups) + (1 if p.schedule.active() else 0)
    enqueue_tiles[q_step_kernel[dtype, tile[0], tile[1], tile[2], tile[3]], tile](ctx, params, blocks, smem, False)


def enqueue_out_step[
    dtype: DType, tile: Tuple[Int, Int, Int, Int]
](ctx: DeviceContext, p: OutStepParams[dtype], groups: Int, pdl: Bool) raises:
    """Launches `out_step_kernel` with `tile` over `groups` heads (`pdl`: after the attention kernel or merge, pdl.mojo)."""
    var params = p
    var smem = params.tiles.fit[tile](p.proj)
    enqueue_tiles[out_step_kernel[dtype, tile[0], tile[1], tile[2], tile[3]], tile](
        ctx, params, params.tiles.blocks(groups), smem, pdl
    )
