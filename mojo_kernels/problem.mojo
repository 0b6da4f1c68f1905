"""One op call's inputs as raw pointers, sizes and options: what both targets consume."""

from .common import DPtr, FPtr, U8Ptr
from .paged_cache import Fp8LatentRows, PagedLatentRows, RaggedBatch
from .spec import Granularity, MaskSpec


@fieldwise_init
struct DecodeProblem[dtype: DType](TrivialRegisterPassable):
    """Everything `execute` received, unpacked once.

    Pointers are host memory for the CPU target and device memory for the
    GPU target (only the sizes and options are always host values).

    Optional tensors (a flag says whether each was given): `output`
    receives step 6 (without it the op stops after step 5: a context-parallel
    rank merges its partial result first); `attention_output` receives the
    attention output before step 6 (in dtype); `lse` its natural log-sum-exp
    per row (float32); `new_rows` holds each new token's raw latent row, which the op
    normalizes, rotates and writes into its cache row (without it the rows
    were appended to the cache beforehand and are updated in place).
    """

    var output: DPtr[Self.dtype]  # [T, H, v_head_dim], when wanted
    var has_output: Bool
    var q: DPtr[Self.dtype]  # [T, H, nope_dim + rope_dim]
    var batch: RaggedBatch  # input_row_offsets, cache_lengths
    var freqs_cis: DPtr[Self.dtype]  # [max_seq_len, rope_dim]
    var kv_norm_gamma: DPtr[Self.dtype]  # [kv_lora_rank]
    var cache: PagedLatentRows[Self.dtype]  # the layer's rows
    var num_tokens: Int
    var num_heads: Int
    var nope_dim: Int
    var rope_dim: Int
    var kv_lora_rank: Int
    var v_head_dim: Int
    var scale: Float32
    var epsilon: Float32
    var mask: MaskSpec
    var score_mod: Int
    var granularity: Granularity
    var w_uk: U8Ptr  # [H, kv_lora_rank, nope_dim] fp8 e4m3 bytes
    var w_uk_scale: FPtr
    var w_uv: U8Ptr  # [H, v_head_dim, kv_lora_rank] fp8 e4m3 bytes
    var w_uv_scale: FPtr
    var attention_output: DPtr[Self.dtype]  # [T, H, kv_lora_rank]: step 5's result, when wanted
    var has_attention_output: Bool
    var lse: FPtr  # [T, H]: log-sum-exp of step 5's scores, when wanted
    var has_lse: Bool
    var new_rows: DPtr[Self.dtype]  # [T, kv_lora_rank + rope_dim]: raw new cache rows, when given
    var has_new_rows: Bool
    var project_only: Bool  # step 6 alone, from `attention_output` (first_step 6)
    var fp8_cache: Fp8LatentRows  # the layer's rows in the fp8_ds_mla format, when active (then not `cache`)

    def key_dim(self) -> Int:
        """Width of a cache row: the keys; values are its first `kv_lora_rank`."""
        return self.kv_lora_rank + self.rope_dim
