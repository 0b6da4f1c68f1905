"""`pymla.mla_decode_branch_fp8`: the fused MLA decode branch with fp8 weights.

The math is specified once, in `pymla/reference.py`. `execute` unpacks the
op's tensors into a `DecodeProblem` and dispatches on the target: the CPU
pipeline (`cpu_pipeline.mojo`) or the GPU one (`gpu/pipeline.mojo`); each runs the
six steps as named stages.

fp8 weights arrive as uint8 (MAX has no fp8 on CPU) and are widened from
their e4m3 bits exactly (`fp8.mojo`). The cache's blocks are of the op's
dtype, or uint8 for rows in the `fp8_ds_mla` format (bfloat16 only; on the GPU
read by the tensor-core attention kernels).
"""

import extensibility
from extensibility import InputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext

from .cpu.pipeline import mla_decode_branch_fp8_cpu
from .gpu.pipeline import mla_decode_branch_fp8_gpu
from .paged_cache import CacheShard, Fp8LatentRows, PagedLatentRows, RaggedBatch
from .problem import DecodeProblem
from .spec import Granularity, MaskSpec


@extensibility.register("pymla.mla_decode_branch_fp8")
struct MLADecodeBranchFP8:
    """MAX custom op: all six steps in one call, on the CPU or an NVIDIA GPU.

    Writes every element of `output [T, H, v_head_dim]` (zero tokens: stop
    after step 5) and, in place, the new tokens' rows of `kv_blocks`; reads
    everything else. `attention_output` (`[T, H, kv_lora_rank]`, or zero
    tokens when not wanted) receives step 5's result and `lse` (`[T, H]`
    float32, or zero tokens) its log-sum-exp; `new_rows` (`[T, kv_lora_rank + rope_dim]`, or zero rows) holds the
    new tokens' raw cache rows when they were not appended beforehand. The scalar options
    arrive as host values; see `pymla/graph.py` for their codes. `first_step` 6
    runs step 6 alone, from `attention_output` (read, not written; the cache
    untouched): a context-parallel rank projects its merged attention output. `shard_rank`,
    `num_shards` and `shard_interleave` say which positions this cache holds
    (`paged_cache.CacheShard`; 0, 1, 1: all of them).
    """

    @staticmethod
    def execute[
        dtype: DType,
        cache_dtype: DType,
        target: StaticString,
    ](
        output: MutableInputTensor[dtype=dtype, rank=3, static_spec=...],
        attention_output: MutableInputTensor[dtype=dtype, rank=3, static_spec=...],
        lse: MutableInputTensor[dtype=DType.float32, rank=2, static_spec=...],
        q: InputTensor[dtype=dtype, rank=3, static_spec=...],
        input_row_offsets: InputTensor[dtype=DType.uint32, rank=1, static_spec=...],
        freqs_cis: InputTensor[dtype=dtype, rank=2, static_spec=...],
        kv_norm_gamma: InputTensor[dtype=dtype, rank=1, static_spec=...],
        new_rows: InputTensor[dtype=dtype, rank=2, static_spec=...],
        kv_blocks: MutableInputTensor[dtype=cache_dtype, rank=6, static_spec=...],
        cache_lengths: InputTensor[dtype=DType.uint32, rank=1, static_spec=...],
        lookup_table: InputTensor[dtype=DType.uint32, rank=2, static_spec=...],
        layer_idx: UInt32,
        first_step: Int32,
        scale: Float32,
        epsilon: Float32,
        mask: Int32,
        score_mod: Int32,
        local_window_size: Int32,
        shard_rank: Int32,
        num_shards: Int32,
        shard_interleave: Int32,
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
        var blocks = kv_blocks.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var lookup = lookup_table.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var rows = PagedLatentRows[dtype].create(
            blocks.unsafe_bitcast[Scalar[dtype]](), lookup, lookup_table.dim_size(1), kv_blocks.dim_size(2),
            kv_blocks.dim_size(3), kv_blocks.dim_size(5), Int(layer_idx),
        )
        var fp8_cache = Fp8LatentRows.absent(rows)
        comptime if cache_dtype == DType.uint8:
            comptime assert dtype == DType.bfloat16, "kv_blocks: uint8 (fp8_ds_mla rows) serves bfloat16 ops"
            fp8_cache = Fp8LatentRows.create(
                blocks.unsafe_bitcast[UInt8](), lookup, lookup_table.dim_size(1), kv_blocks.dim_size(2),
                kv_blocks.dim_size(3), kv_blocks.dim_size(5), Int(layer_idx), w_uk.dim_size(1),
            )
        else:
            comptime assert cache_dtype == dtype, "kv_blocks: the op's dtype, or uint8 for fp8_ds_mla rows"
        var problem = DecodeProblem[dtype](
            output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            output.dim_size(0) > 0,
            q.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            RaggedBatch(
                input_row_offsets.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
                cache_lengths.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
                input_row_offsets.dim_size(0) - 1,
                CacheShard(Int(shard_rank), Int(num_shards), Int(shard_interleave)),
            ),
            freqs_cis.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            kv_norm_gamma.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            rows,
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
            attention_output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            attention_output.dim_size(0) > 0,
            lse.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            lse.dim_size(0) > 0,
            new_rows.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            new_rows.dim_size(0) > 0,
            Int(first_step) == 6,
            fp8_cache,
        )
        comptime if target == "gpu":
            mla_decode_branch_fp8_gpu[dtype](problem, ctx)
        else:
            comptime assert target == "cpu", "pymla.mla_decode_branch_fp8: target must be cpu or gpu"
            mla_decode_branch_fp8_cpu[dtype](problem)
