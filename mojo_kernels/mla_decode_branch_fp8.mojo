"""`pymla.mla_decode_branch_fp8`: the fused MLA decode branch with fp8 weights.

The math is specified once, in `pymla/reference.py`. `execute` unpacks the
op's tensors into a `DecodeProblem` and hands it to the CPU pipeline below
or to the GPU one (`gpu.mojo`). The CPU pipeline runs the six steps as named
stages:

1. RoPE on q and on the new tokens' cache rows  (`rope_queries_into_q_full`,
   `rotate_and_normalize_new_rows`)
2. RMSNorm of those rows' latent part            (`rotate_and_normalize_new_rows`)
3. fp8 q_nope projection                         (`project_q_nope`)
4. concat(q_nope_proj, q_rope) into `q_full`     (steps 1 and 3 write its two slices)
5. paged MLA decode attention                    (`attend_partitions`, `merge_partitions`)
6. fp8 output projection                         (`project_output`)

fp8 weights arrive as uint8 (MAX has no fp8 on CPU) and are widened from
their e4m3 bits exactly (`fp8.mojo`).
"""

import extensibility
from extensibility import InputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext
from std.sys import num_physical_cores

from .attention import AttentionShape, MaskSpec, PartialResults, attend_partitions, merge_partitions
from .common import DPtr, FPtr, U8Ptr, ceil_div, scratch
from .fp8_matmul import Granularity, StridedMatrices, fp8_batched_matmul
from .gpu import mla_decode_branch_fp8_gpu
from .paged_cache import PagedLatentRows, RaggedBatch
from .problem import DecodeProblem
from .rope_norm import rope_queries_into_q_full, rotate_and_normalize_new_rows

comptime MIN_KEYS_PER_PARTITION = 256
comptime TASKS_PER_WORKER = 4
comptime MAX_HEADS_PER_TASK = 128


def project_q_nope[
    dtype: DType
](
    q: DPtr[dtype],
    w_uk: U8Ptr,
    w_uk_scale: FPtr,
    q_full: FPtr,
    num_tokens: Int,
    num_heads: Int,
    nope_dim: Int,
    rope_dim: Int,
    kv_lora_rank: Int,
    granularity: Granularity,
) raises:
    """Step 3: `q_full[t, h, :R] = fp8mm(q[t, h, :nope], w_uk[h])`."""
    var a = StridedMatrices[dtype](q, nope_dim + rope_dim, num_heads * (nope_dim + rope_dim))
    var c = StridedMatrices[DType.float32](
        q_full, kv_lora_rank + rope_dim, num_heads * (kv_lora_rank + rope_dim)
    )
    var blocks = granularity.resolve(num_tokens, kv_lora_rank, nope_dim)
    fp8_batched_matmul[dtype, DType.float32](
        a, w_uk, w_uk_scale, c, num_heads, num_tokens, kv_lora_rank, nope_dim, blocks
    )


def project_output[
    dtype: DType
](
    raw: FPtr,
    w_uv: U8Ptr,
    w_uv_scale: FPtr,
    output: DPtr[dtype],
    num_tokens: Int,
    num_heads: Int,
    kv_lora_rank: Int,
    v_head_dim: Int,
    granularity: Granularity,
) raises:
    """Step 6: `output[t, h, :] = fp8mm(raw[t, h, :], w_uv[h])`."""
    var a = StridedMatrices[DType.float32](raw, kv_lora_rank, num_heads * kv_lora_rank)
    var c = StridedMatrices[dtype](output, v_head_dim, num_heads * v_head_dim)
    var blocks = granularity.resolve(num_tokens, v_head_dim, kv_lora_rank)
    fp8_batched_matmul[DType.float32, dtype](
        a, w_uv, w_uv_scale, c, num_heads, num_tokens, v_head_dim, kv_lora_rank, blocks
    )


def plan_attention(batch: RaggedBatch, num_tokens: Int, num_heads: Int, kv_lora_rank: Int, key_dim: Int) -> AttentionShape:
    """Splits work so every core is busy: head groups, then key partitions for long contexts."""
    var workers = num_physical_cores()
    var heads_per_group = min(num_heads, MAX_HEADS_PER_TASK)
    var head_groups = ceil_div(num_heads, heads_per_group)
    var longest = 0
    for b in range(batch.num_requests):
        longest = max(longest, batch.visible(b))
    var tasks = max(batch.num_requests * head_groups, 1)
    var partitions = ceil_div(workers * TASKS_PER_WORKER, tasks)
    partitions = max(1, min(partitions, ceil_div(longest, MIN_KEYS_PER_PARTITION)))
    return AttentionShape(num_tokens, num_heads, kv_lora_rank, key_dim, heads_per_group, partitions)



def mla_decode_branch_fp8_cpu[dtype: DType](p: DecodeProblem[dtype]) raises:
    """The six steps on the CPU, each a parallel stage over host memory."""
    if p.num_tokens == 0:
        return
    var key_dim = p.key_dim()

    # Steps 1 and 2 on the cache: the new rows, rotated and normalized in place.
    rotate_and_normalize_new_rows[dtype](
        p.cache, p.batch, p.freqs_cis, p.kv_norm_gamma, p.epsilon, p.kv_lora_rank, p.rope_dim
    )

    # Steps 1, 3 and 4 on q: q_full = concat(q_nope @ w_uk, rope(q_rope)).
    var q_full_buf = List[Float32](length=p.num_tokens * p.num_heads * key_dim, fill=0)
    var q_full = scratch(q_full_buf)
    rope_queries_into_q_full[dtype](
        p.q, p.batch, p.freqs_cis, q_full, p.num_heads, p.nope_dim, p.rope_dim, p.kv_lora_rank
    )
    project_q_nope[dtype](
        p.q, p.w_uk, p.w_uk_scale, q_full, p.num_tokens, p.num_heads, p.nope_dim, p.rope_dim,
        p.kv_lora_rank, p.granularity,
    )

    # Step 5: attention, split into partitions, then merged.
    var shape = plan_attention(p.batch, p.num_tokens, p.num_heads, p.kv_lora_rank, key_dim)
    var rows = shape.num_partitions * p.num_tokens * p.num_heads
    var part_out_buf = List[Float32](length=rows * p.kv_lora_rank, fill=0)
    var part_max_buf = List[Float32](length=rows, fill=0)
    var part_sum_buf = List[Float32](length=rows, fill=0)
    var partials = PartialResults(scratch(part_out_buf), scratch(part_max_buf), scratch(part_sum_buf))
    attend_partitions[dtype](q_full, p.cache, p.batch, shape, p.scale, p.mask, p.score_mod, partials)
    var raw_buf = List[Float32](length=p.num_tokens * p.num_heads * p.kv_lora_rank, fill=0)
    var raw = scratch(raw_buf)
    merge_partitions(partials, shape, raw)

    # Step 6: output projection.
    project_output[dtype](
        raw, p.w_uv, p.w_uv_scale, p.output, p.num_tokens, p.num_heads, p.kv_lora_rank, p.v_head_dim,
        p.granularity,
    )
    _ = q_full_buf^
    _ = part_out_buf^
    _ = part_max_buf^
    _ = part_sum_buf^
    _ = raw_buf^


@extensibility.register("pymla.mla_decode_branch_fp8")
struct MLADecodeBranchFP8:
    """MAX custom op: all six steps in one call, on the CPU or an NVIDIA GPU.

    Writes every element of `output [T, H, v_head_dim]` and, in place, the new
    tokens' rows of `kv_blocks`; reads everything else. The scalar options
    arrive as host values; see `pymla/graph.py` for their codes.
    """

    @staticmethod
    def execute[
        dtype: DType,
        target: StaticString,
    ](
        output: MutableInputTensor[dtype=dtype, rank=3, static_spec=...],
        q: InputTensor[dtype=dtype, rank=3, static_spec=...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, static_spec=...],
        freqs_cis: InputTensor[dtype=dtype, rank=2, static_spec=...],
        kv_norm_gamma: InputTensor[dtype=dtype, rank=1, static_spec=...],
        kv_blocks: MutableInputTensor[dtype=dtype, rank=6, static_spec=...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, static_spec=...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=2, static_spec=...],
        layer_idx: UInt32,
        scale: Float32,
        epsilon: Float32,
        mask: Int32,
        score_mod: Int32,
        local_window_size: Int32,
        m_scale_granularity: Int32,
        n_scale_granularity: Int32,
        k_scale_granularity: Int32,
        w_uk: InputTensor[dtype=DType.uint8, rank=3, static_spec=...],
        w_uk_scale: InputTensor[dtype=DType.float32, rank=3, static_spec=...],
        w_uv: InputTensor[dtype=DType.uint8, rank=3, static_spec=...],
        w_uv_scale: InputTensor[dtype=DType.float32, rank=3, static_spec=...],
        ctx: DeviceContext,
    ) raises:
        var nope_dim = w_uk.dim_size(2)
        var problem = DecodeProblem[dtype](
            output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            q.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            RaggedBatch(
                input_row_offsets.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
                cache_lengths.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
                input_row_offsets.dim_size(0) - 1,
            ),
            freqs_cis.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            kv_norm_gamma.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            PagedLatentRows[dtype].create(
                kv_blocks.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
                lookup_table.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
                lookup_table.dim_size(1),
                kv_blocks.dim_size(2),
                kv_blocks.dim_size(3),
                kv_blocks.dim_size(5),
                Int(layer_idx),
            ),
            q.dim_size(0),
            q.dim_size(1),
            nope_dim,
            q.dim_size(2) - nope_dim,
            w_uk.dim_size(1),
            w_uv.dim_size(1),
            scale,
            epsilon,
            MaskSpec(Int(mask), Int(local_window_size)),
            Int(score_mod),
            Granularity(Int(m_scale_granularity), Int(n_scale_granularity), Int(k_scale_granularity)),
            w_uk.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            w_uk_scale.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            w_uv.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            w_uv_scale.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        )
        comptime if target == "gpu":
            mla_decode_branch_fp8_gpu[dtype](problem, ctx)
        else:
            comptime assert target == "cpu", "pymla.mla_decode_branch_fp8: target must be cpu or gpu"
            mla_decode_branch_fp8_cpu[dtype](problem)
