"""Steps 1, 2 and 4: RoPE on q and on the new cache rows, RMSNorm of their latent part.

An `fp8_ds_mla` cache gets its new rows through a bfloat16 staging row:
read (from `new_rows`, or the cache row's values), normalized and rotated
there as in place, then quantized into the cache row (`Fp8LatentRows.store_row`).
"""

from std.math import sqrt

from ..common import DPtr
from ..paged_cache import Fp8LatentRows, PagedLatentRows, RaggedBatch
from ..spec import rope_pair
from .scratch import Scratch
from .simd import F32_WIDTH, run_tasks


def rope_interleaved[
    in_dtype: DType, freq_dtype: DType, out_dtype: DType
](src: DPtr[in_dtype], freqs: DPtr[freq_dtype], dst: DPtr[out_dtype], width: Int):
    """Rotates interleaved pairs: `(x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)`.

    `freqs` is one row `[cos0, sin0, cos1, sin1, ...]`; `dst` may equal `src`.
    """
    for j in range(0, width, 2):
        var x0 = src.unsafe_load(j).cast[DType.float32]()
        var x1 = src.unsafe_load(j + 1).cast[DType.float32]()
        var c = freqs.unsafe_load(j).cast[DType.float32]()
        var s = freqs.unsafe_load(j + 1).cast[DType.float32]()
        var y = rope_pair(x0, x1, c, s)
        dst.unsafe_store(j, y[0].cast[out_dtype]())
        dst.unsafe_store(j + 1, y[1].cast[out_dtype]())


def rms_norm_in_place[
    dtype: DType
](row: DPtr[dtype], gamma: DPtr[dtype], width: Int, epsilon: Float32):
    """`row = row / sqrt(mean(row^2) + epsilon) * gamma`, in float32, stored as `dtype`."""
    comptime W = F32_WIDTH
    var acc = SIMD[DType.float32, W](0)
    var i = 0
    while i + W <= width:
        var x = row.unsafe_load[width=W](i).cast[DType.float32]()
        acc += x * x
        i += W
    var sum_sq = acc.reduce_add()
    while i < width:
        var x = row.unsafe_load(i).cast[DType.float32]()
        sum_sq += x * x
        i += 1
    var inv = Float32(1.0) / sqrt(sum_sq / Float32(width) + epsilon)
    i = 0
    while i + W <= width:
        var x = row.unsafe_load[width=W](i).cast[DType.float32]()
        var g = gamma.unsafe_load[width=W](i).cast[DType.float32]()
        row.unsafe_store(i, (x * inv * g).cast[dtype]())
        i += W
    while i < width:
        var x = row.unsafe_load(i).cast[DType.float32]()
        var g = gamma.unsafe_load(i).cast[DType.float32]()
        row.unsafe_store(i, (x * inv * g).cast[dtype]())
        i += 1


def rotate_and_normalize_new_rows[
    dtype: DType
](
    cache: PagedLatentRows[dtype],
    batch: RaggedBatch,
    freqs_cis: DPtr[dtype],
    gamma: DPtr[dtype],
    epsilon: Float32,
    kv_lora_rank: Int,
    rope_dim: Int,
) raises:
    """Steps 1 and 2 on the cache, in place, for every new token of every request.

    With a shard of the cache, only the tokens this rank holds, at their local slots.
    """
    var num_requests = batch.num_requests

    def request_task(b: Int) {var cache, var batch, var freqs_cis, var gamma, var epsilon, var kv_lora_rank, var rope_dim}:
        for t in range(batch.start(b), batch.stop(b)):
            var pos = batch.position(b, t)
            if not batch.shard.owns(pos):
                continue
            var row = cache.row(b, batch.shard.local_count(pos))
            rms_norm_in_place[dtype](row, gamma, kv_lora_rank, epsilon)
            rope_interleaved[dtype, dtype, dtype](
                row.unsafe_offset(kv_lora_rank),
                freqs_cis.unsafe_offset(pos * rope_dim),
                row.unsafe_offset(kv_lora_rank),
                rope_dim,
            )

    var rows = batch.stop(num_requests - 1) - batch.start(0) if num_requests > 0 else 0
    run_tasks(request_task, num_requests, rows * (kv_lora_rank + rope_dim))


def rotate_normalize_and_quantize_new_rows[
    dtype: DType
](
    cache: Fp8LatentRows,
    batch: RaggedBatch,
    freqs_cis: DPtr[dtype],
    gamma: DPtr[dtype],
    epsilon: Float32,
    new_rows: DPtr[dtype],
    has_new_rows: Bool,
) raises:
    """Steps 1 and 2 for an `fp8_ds_mla` cache: each new token's row (from `new_rows` when given,
    else the cache row's values), normalized and rotated in a `dtype` (bfloat16) staging row, quantized into the cache.
    """
    var num_requests = batch.num_requests
    var rank = cache.kv_lora_rank
    var rope_dim = cache.rope_dim
    var width = rank + rope_dim

    def request_task(b: Int) {var cache, var batch, var freqs_cis, var gamma, var epsilon, var new_rows, var has_new_rows, var rank, var rope_dim, var width}:
        var mem = Scratch()
        var row = mem.take[dtype](width)
        for t in range(batch.start(b), batch.stop(b)):
            var pos = batch.position(b, t)
            if not batch.shard.owns(pos):
                continue
            var slot = batch.shard.local_count(pos)
            if has_new_rows:
                for d in range(width):
                    row.unsafe_store(d, new_rows.unsafe_load(t * width + d))
            else:
                cache.dequantize_row[dtype](b, slot, row)
            rms_norm_in_place[dtype](row, gamma, rank, epsilon)
            rope_interleaved[dtype, dtype, dtype](
                row.unsafe_offset(rank), freqs_cis.unsafe_offset(pos * rope_dim), row.unsafe_offset(rank), rope_dim
            )
            cache.store_row[dtype](b, slot, row)
        _ = mem^

    var rows = batch.stop(num_requests - 1) - batch.start(0) if num_requests > 0 else 0
    run_tasks(request_task, num_requests, rows * width)


def rope_query_head[
    dtype: DType
](
    q: DPtr[dtype],
    batch: RaggedBatch,
    freqs_cis: DPtr[dtype],
    q_full: DPtr[dtype],
    h: Int,
    num_heads: Int,
    nope_dim: Int,
    rope_dim: Int,
    kv_lora_rank: Int,
):
    """Steps 1 and 4 on head `h` of q: rotates `q[t, h, nope:]` into `q_full[t, h, kv_lora_rank:]` for
    every token (the prologue of step 3's task for head `h`).

    `q_full [T, H, kv_lora_rank + rope_dim]` is the concatenation of step 4;
    step 3 fills its first `kv_lora_rank` columns.
    """
    for b in range(batch.num_requests):
        for t in range(batch.start(b), batch.stop(b)):
            var row = t * num_heads + h
            rope_interleaved[dtype, dtype, dtype](
                q.unsafe_offset(row * (nope_dim + rope_dim) + nope_dim),
                freqs_cis.unsafe_offset(batch.position(b, t) * rope_dim),
                q_full.unsafe_offset(row * (kv_lora_rank + rope_dim) + kv_lora_rank),
                rope_dim,
            )
