"""The six steps on the CPU, as named stages over host memory.

1. RoPE on q and on the new tokens' cache rows  (`rope_query_head`,
   `rotate_and_normalize_new_rows`)
2. RMSNorm of those rows' latent part            (`rotate_and_normalize_new_rows`)
3. fp8 q_nope projection                         (`project_q_nope`)
4. concat(q_nope_proj, q_rope) into `q_full`     (steps 1 and 3 write its two slices)
5. paged MLA decode attention                    (`attend_partitions`, then `merge_head` per head)
6. fp8 output projection                         (`project_output`)

Four parallel stages: the new cache rows (steps 1-2), q per head (steps 1, 3, 4: `rope_query_head`
as the prologue of step 3's task for the head), step 5's tasks, and per head the merge of its rows
and step 6 (`merge_head` as the prologue of step 6's task; `merge_partitions` alone where no step 6
follows). Each stage costs the task runner about 25 us on 16 cores, more where its workers slept.
"""

from std.os import getenv
from std.sys import num_physical_cores

from ..common import DPtr, FPtr, U8Ptr, ceil_div
from ..paged_cache import RaggedBatch, partitions_by_work
from ..problem import DecodeProblem
from ..spec import Granularity
from .amx import HAS_AMX, amx_permitted
from .attention import PATH_AMX, PATH_AVX512BF16, PATH_F32, attend_partitions
from .bf16 import HAS_AVX512_BF16
from .amx_matmul import HeadPrologue, NoPrologue, fp8_projection, projection_on_amx
from .fp8_matmul import StridedMatrices
from .merge import AttentionShape, PartialResults, TaskPlan, merge_head, merge_partitions
from .rope_norm import rope_query_head, rotate_and_normalize_new_rows, rotate_normalize_and_quantize_new_rows
from .scratch import Scratch

comptime TASKS_PER_WORKER = 4
comptime MAX_HEADS_PER_TASK = 128


def project_q_nope[
    Prologue: HeadPrologue, //, dtype: DType
](
    q: DPtr[dtype],
    w_uk: U8Ptr,
    w_uk_scale: FPtr,
    q_full: DPtr[dtype],
    num_tokens: Int,
    num_heads: Int,
    nope_dim: Int,
    rope_dim: Int,
    kv_lora_rank: Int,
    granularity: Granularity,
    path: Int,
    prologue: Prologue,
) raises:
    """Step 3: `q_full[t, h, :R] = rnd(fp8mm(q[t, h, :nope], w_uk[h]))`, a task per head `h` that runs
    `prologue.run(h)` first (`fp8_projection`); on AMX tiles where `projection_on_amx`, else on the
    AVX512-BF16 unit where step 5 takes a bf16 path."""
    var a = StridedMatrices[dtype](q, nope_dim + rope_dim, num_heads * (nope_dim + rope_dim))
    var c = StridedMatrices[dtype](
        q_full, kv_lora_rank + rope_dim, num_heads * (kv_lora_rank + rope_dim)
    )
    var blocks = granularity.resolve(num_tokens, kv_lora_rank, nope_dim)
    fp8_projection[dtype, dtype](
        a, w_uk, w_uk_scale, c, num_heads, num_tokens, kv_lora_rank, nope_dim, blocks,
        projection_on_amx(path, num_tokens), path != PATH_F32, prologue,
    )


def project_output[
    Prologue: HeadPrologue, //, dtype: DType
](
    raw: DPtr[dtype],
    w_uv: U8Ptr,
    w_uv_scale: FPtr,
    output: DPtr[dtype],
    num_tokens: Int,
    num_heads: Int,
    kv_lora_rank: Int,
    v_head_dim: Int,
    granularity: Granularity,
    path: Int,
    prologue: Prologue,
) raises:
    """Step 6: `output[t, h, :] = rnd(fp8mm(raw[t, h, :], w_uv[h]))`, a task per head `h` that runs
    `prologue.run(h)` first (the merge of its rows, `MergeRows`); on AMX tiles where `projection_on_amx`,
    else on the AVX512-BF16 unit where step 5 takes a bf16 path."""
    var a = StridedMatrices[dtype](raw, kv_lora_rank, num_heads * kv_lora_rank)
    var c = StridedMatrices[dtype](output, v_head_dim, num_heads * v_head_dim)
    var blocks = granularity.resolve(num_tokens, v_head_dim, kv_lora_rank)
    fp8_projection[dtype, dtype](
        a, w_uv, w_uv_scale, c, num_heads, num_tokens, v_head_dim, kv_lora_rank, blocks,
        projection_on_amx(path, num_tokens), path != PATH_F32, prologue,
    )


@fieldwise_init
struct RopeQuery[dtype: DType](HeadPrologue, TrivialRegisterPassable):
    """Step 3's prologue for head `h`: steps 1 and 4 on its q rows (`rope_query_head`)."""

    var p: DecodeProblem[Self.dtype]
    var q_full: DPtr[Self.dtype]

    def run(self, h: Int):
        var p = self.p
        rope_query_head[Self.dtype](
            p.q, p.batch, p.freqs_cis, self.q_full, h, p.num_heads, p.nope_dim, p.rope_dim, p.kv_lora_rank
        )


@fieldwise_init
struct MergeRows[dtype: DType](HeadPrologue, TrivialRegisterPassable):
    """Step 6's prologue for head `h`: the merge of its rows' key partitions into `raw` (`merge_head`)."""

    var partials: PartialResults
    var shape: AttentionShape
    var raw: DPtr[Self.dtype]
    var lse: FPtr
    var has_lse: Bool

    def run(self, h: Int):
        merge_head[Self.dtype](self.partials, self.shape, h, self.raw, self.lse, self.has_lse)


def plan_attention(
    batch: RaggedBatch, num_tokens: Int, num_heads: Int, kv_lora_rank: Int, key_dim: Int, partitions: Int = 0
) -> TaskPlan:
    """Splits step 5 so every core is busy: head groups, then each request's keys into partitions in
    proportion to its work (keys x new tokens), about TASKS_PER_WORKER tasks per core of equal work
    in all, a partition keeping at least MIN_KEYS_PER_PARTITION keys; a request without new tokens
    gets none. `partitions` > 0 (tests): that many for every request with new tokens.
    """
    var workers = num_physical_cores()
    var heads_per_group = min(num_heads, MAX_HEADS_PER_TASK)
    var head_groups = ceil_div(num_heads, heads_per_group)
    var total_work = 0
    for b in range(batch.num_requests):
        total_work += batch.local_keys(b) * batch.num_tokens(b)
    var target = workers * TASKS_PER_WORKER
    var mem = Scratch()
    var parts = mem.take_ints(batch.num_requests)
    for b in range(batch.num_requests):
        if batch.num_tokens(b) == 0:
            continue
        if partitions > 0:
            parts.unsafe_store(b, partitions)
            continue
        var keys = batch.local_keys(b)
        parts.unsafe_store(
            b, partitions_by_work(keys, keys * batch.num_tokens(b), total_work, target, head_groups, round_up=True)
        )
    return TaskPlan(mem^, parts, batch, num_tokens, num_heads, kv_lora_rank, key_dim, heads_per_group)


def attention_path[dtype: DType]() raises -> Int:
    """The products of step 5 (a PATH_* code) from `PYMLA_CPU_PATH`: `auto`, `f32`, `avx512bf16`, `amx`.

    `auto` (or unset) takes, for bfloat16 caches, AMX where the CPU the op is
    compiled for has it and Linux grants the tile registers, else the
    AVX512-BF16 unit where it has that; `f32` widens keys to float32 (same
    results up to summation order); `avx512bf16` and `amx` insist and fail
    where the kernel (or Linux, for AMX) lacks them. float16 and float32
    caches always take the float32 path. Called before any cache row changes.
    """
    var path = getenv("PYMLA_CPU_PATH", "auto")
    if path == "avx512bf16":
        if not HAS_AVX512_BF16:
            raise Error("PYMLA_CPU_PATH=avx512bf16: this CPU has no AVX512-BF16 unit")
    elif path == "amx":
        if not HAS_AMX:
            raise Error("PYMLA_CPU_PATH=amx: the kernel was compiled for a CPU without AMX (amx-tile, amx-bf16)")
    elif path != "auto" and path != "f32" and path != "":
        raise Error("PYMLA_CPU_PATH: expected auto, f32, avx512bf16 or amx, got ", path)
    if dtype != DType.bfloat16 or path == "f32":
        return PATH_F32
    if path == "amx" or (path != "avx512bf16" and HAS_AMX):
        if amx_permitted():
            return PATH_AMX
        if path == "amx":
            raise Error(
                "PYMLA_CPU_PATH=amx: Linux refused this process the AMX tile registers "
                "(arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA))"
            )
    return PATH_AVX512BF16 if HAS_AVX512_BF16 else PATH_F32


def copy_new_rows_into_cache[dtype: DType](p: DecodeProblem[dtype]):
    """Stores `new_rows[t]` into the cache row of each new token `t` this shard holds (before steps 1 and 2 on it)."""
    var width = p.key_dim()
    for b in range(p.batch.num_requests):
        for t in range(p.batch.start(b), p.batch.stop(b)):
            var pos = p.batch.position(b, t)
            if not p.batch.shard.owns(pos):
                continue
            var dst = p.cache.row(b, p.batch.shard.local_count(pos))
            var src = p.new_rows.unsafe_offset(t * width)
            for d in range(width):
                dst.unsafe_store(d, src.unsafe_load(d))


def mla_decode_branch_fp8_cpu[dtype: DType](p: DecodeProblem[dtype]) raises:
    """The six steps on the CPU, each a parallel stage over host memory."""
    if p.num_tokens == 0:
        return
    if p.project_only:  # step 6 alone, on the attention output given
        project_output[dtype](
            p.attention_output, p.w_uv, p.w_uv_scale, p.output, p.num_tokens, p.num_heads, p.kv_lora_rank,
            p.v_head_dim, p.granularity, attention_path[dtype](), NoPrologue(),
        )
        return
    # The attention path first: a refused PYMLA_CPU_PATH raises before any cache row changes.
    var path = attention_path[dtype]()
    var key_dim = p.key_dim()

    # Steps 1 and 2 on the cache: the new rows (from `new_rows` when given), rotated and
    # normalized in place; an fp8_ds_mla cache stores them quantized.
    if p.fp8_cache.active:
        rotate_normalize_and_quantize_new_rows[dtype](
            p.fp8_cache, p.batch, p.freqs_cis, p.kv_norm_gamma, p.epsilon, p.new_rows, p.has_new_rows
        )
    else:
        if p.has_new_rows:
            copy_new_rows_into_cache[dtype](p)
        rotate_and_normalize_new_rows[dtype](
            p.cache, p.batch, p.freqs_cis, p.kv_norm_gamma, p.epsilon, p.kv_lora_rank, p.rope_dim
        )

    # Steps 1, 3 and 4 on q: q_full = concat(q_nope @ w_uk, rope(q_rope)), in dtype.
    # The per-call buffers below come from the scratch pool (cpu/scratch.mojo: kept across calls, so no
    # allocation and no page faults once it has grown; at 128 heads the partials are 16 MiB) and are
    # written whole before they are read (q_full by steps 1 and 3, the partials by every task, raw by
    # the merge): no zero fill.
    var mem = Scratch()
    var q_full = mem.take[dtype](p.num_tokens * p.num_heads * key_dim, zero=False)
    project_q_nope[dtype](
        p.q, p.w_uk, p.w_uk_scale, q_full, p.num_tokens, p.num_heads, p.nope_dim, p.rope_dim,
        p.kv_lora_rank, p.granularity, path, RopeQuery[dtype](p, q_full),
    )

    # Step 5: attention, split into partitions, then merged.
    var plan = plan_attention(p.batch, p.num_tokens, p.num_heads, p.kv_lora_rank, key_dim)
    var shape = plan.shape()
    var partials = PartialResults.take(mem, shape)
    attend_partitions[dtype](
        q_full, p.cache, p.batch, shape, p.scale, p.mask, p.score_mod, partials, path, p.fp8_cache
    )
    # The attention output, in dtype: into `attention_output` when the caller wants it.
    var raw = p.attention_output if p.has_attention_output else mem.take[dtype](
        p.num_tokens * p.num_heads * p.kv_lora_rank, zero=False
    )

    # Step 6: output projection, each head's task merging its rows first (a context-parallel rank
    # wants no step 6: it merges across ranks first).
    if p.has_output:
        project_output[dtype](
            raw, p.w_uv, p.w_uv_scale, p.output, p.num_tokens, p.num_heads, p.kv_lora_rank, p.v_head_dim,
            p.granularity, path, MergeRows[dtype](partials, shape, raw, p.lse, p.has_lse),
        )
    else:
        merge_partitions[dtype](partials, shape, raw, p.lse, p.has_lse)
    _ = mem^
    _ = plan^
