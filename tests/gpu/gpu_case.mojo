# The cases of the GPU checks (gpu_smoke.mojo) and timings (gpu_bench.mojo): random inputs on
# the host (`Case`), the same on the device with each step launched alone (`DeviceCase`).
# A case with `fp8` holds its cache as fp8_ds_mla rows (`fp8_bytes`, pymla/cache_format.py);
# its `blocks` are then those rows' values (e4m3 x scale, exact bfloat16 values).

from std.math import cos, log, sin, sqrt
from std.memory import bitcast

from max.gpu.host import DeviceBuffer, DeviceContext

from mojo_kernels.common import DPtr
from mojo_kernels.fp8 import cache_block_scale, e4m3_bytes, round_to_e4m3, widen_e4m3
from mojo_kernels.gpu.pipeline import (
    cache_rows_params,
    gpu_attention,
    gpu_build_q_full,
    gpu_project_output,
    gpu_run_plan,
    mla_decode_branch_fp8_gpu,
)
from mojo_kernels.gpu.params import DeviceBatch, to_global
from mojo_kernels.gpu.schedule import ScheduleParams
from mojo_kernels.gpu.plan import ATTENTION_VARIANTS, DeviceLimits, GpuPlan
from mojo_kernels.gpu.projection_mma import QuantizedRows
from mojo_kernels.paged_cache import CacheShard, Fp8LatentRows, PagedLatentRows, RaggedBatch
from mojo_kernels.problem import DecodeProblem
from mojo_kernels.spec import Granularity, MaskSpec

comptime UNUSED_PAGE = UInt32(0xFFFFFFFF)
comptime FP8_MAX: Float32 = 448.0


struct Rng(Movable):
    var state: UInt64

    def __init__(out self, seed: Int):
        self.state = UInt64(seed) * 6364136223846793005 + 1442695040888963407
        if self.state == 0:
            self.state = 1

    def next(mut self) -> UInt64:
        var x = self.state
        x ^= x >> 12
        x ^= x << 25
        x ^= x >> 27
        self.state = x
        return x * 2685821657736338717

    def uniform(mut self) -> Float32:
        return Float32(Int(self.next() >> 40)) / Float32(1 << 24)

    def normal(mut self) -> Float32:
        var u1 = max(self.uniform(), Float32(1e-7))
        var u2 = self.uniform()
        return sqrt(Float32(-2.0) * log(u1)) * cos(Float32(6.283185307) * u2)

    def below(mut self, n: Int) -> Int:
        return Int(self.next() >> 33) % n


def ceil_div(a: Int, b: Int) -> Int:
    return (a + b - 1) // b


def extent(g: Int, size: Int) -> Int:
    """Elements per scale block along an axis (0 = the whole axis)."""
    return max(size, 1) if g == 0 else g


def fp8_value(x: Float32) -> Float32:
    return x.cast[DType.float8_e4m3fn]().cast[DType.float32]()


def fp8_byte(x: Float32) -> UInt8:
    return bitcast[DType.uint8, 1](x.cast[DType.float8_e4m3fn]())


def round_to[dtype: DType](x: Float32) -> Float32:
    return x.cast[dtype]().cast[DType.float32]()


def fp8_row_bytes(rank: Int, rope: Int) -> Int:
    """Bytes of an fp8_ds_mla row: R e4m3 bytes, R / 128 float32 scales, Dr bfloat16 values."""
    return rank + 4 * (rank // 128) + 2 * rope


def quantize_row(values: List[Float32], at: Int, rank: Int, rope: Int, mut bytes: List[UInt8], bat: Int):
    """`values[at : at + R + Dr]` (bfloat16 values) into the fp8_ds_mla row `bytes[bat ..]`: the CPU's
    `Fp8LatentRows.store_row` (per 128 values the scale `cache_block_scale(amax)`, e4m3 RNE bytes; rope as bf16)."""
    for blk in range(rank // 128):
        var amax = Float32(0)
        for i in range(128):
            amax = max(amax, abs(values[at + blk * 128 + i]))
        var s = cache_block_scale(amax)
        for i in range(128):
            var x = SIMD[DType.float32, 1](values[at + blk * 128 + i] / s)
            bytes[bat + blk * 128 + i] = e4m3_bytes[1](round_to_e4m3[1](x))[0]
        store_scale(bytes, bat + rank + 4 * blk, s)
    var rope_at = bat + rank + 4 * (rank // 128)
    for d in range(rope):  # bfloat16 bits: the float32 bits' top half (the values are bfloat16 values)
        var bits = bitcast[DType.uint32, 1](SIMD[DType.float32, 1](values[at + rank + d].cast[DType.bfloat16]().cast[DType.float32]()))[0] >> 16
        bytes[rope_at + 2 * d] = UInt8(bits & 0xFF)
        bytes[rope_at + 2 * d + 1] = UInt8(bits >> 8)


def load_scale(bytes: List[UInt8], at: Int) -> Float32:
    """The float32 scale whose bytes start at `bytes[at]` (little-endian)."""
    return bitcast[DType.float32, 1](SIMD[DType.uint8, 4](bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]))[0]


def store_scale(mut bytes: List[UInt8], at: Int, s: Float32):
    """`s` as the float32 bytes at `bytes[at ..]` (little-endian)."""
    var sb = bitcast[DType.uint8, 4](SIMD[DType.float32, 1](s))
    for k in range(4):
        bytes[at + k] = sb[k]


def scale_row(mut bytes: List[UInt8], bat: Int, rank: Int, factor: Float32):
    """Every scale of the fp8_ds_mla row `bytes[bat ..]` times `factor`."""
    for blk in range(rank // 128):
        var at = bat + rank + 4 * blk
        store_scale(bytes, at, load_scale(bytes, at) * factor)


def dequantize_row(bytes: List[UInt8], bat: Int, rank: Int, rope: Int, mut values: List[Float32], at: Int):
    """The values of the fp8_ds_mla row `bytes[bat ..]` into `values[at : at + R + Dr]` (e4m3 x scale rounded to
    bfloat16, as the kernels read it: exact for the scales pymla writes, powers of two; then rope)."""
    for blk in range(rank // 128):
        var s = load_scale(bytes, bat + rank + 4 * blk)
        for i in range(128):
            values[at + blk * 128 + i] = round_to[DType.bfloat16](widen_e4m3[1](SIMD[DType.uint8, 1](bytes[bat + blk * 128 + i]))[0] * s)
    var rope_at = bat + rank + 4 * (rank // 128)
    for d in range(rope):
        var bits = (UInt32(bytes[rope_at + 2 * d + 1]) << 24) | (UInt32(bytes[rope_at + 2 * d]) << 16)
        values[at + rank + d] = bitcast[DType.float32, 1](SIMD[DType.uint32, 1](bits))[0]


struct QuantWeights(Movable):
    """The fp8 weights `[G, N, K]` as bytes and as values, scales `[G, NB, KB]`."""

    var bytes: List[UInt8]
    var values: List[Float32]
    var scales: List[Float32]
    var groups: Int
    var n: Int
    var k: Int
    var bn: Int
    var bk: Int

    def __init__(out self, mut rng: Rng, groups: Int, n: Int, k: Int, gn: Int, gk: Int, std: Float32):
        self.groups = groups
        self.n = n
        self.k = k
        self.bn = extent(gn, n)
        self.bk = extent(gk, k)
        var nb = ceil_div(n, self.bn)
        var kb = ceil_div(k, self.bk)
        var w = List[Float32](length=groups * n * k, fill=0)
        for i in range(len(w)):
            w[i] = rng.normal() * std
        self.bytes = List[UInt8](length=groups * n * k, fill=0)
        self.values = List[Float32](length=groups * n * k, fill=0)
        self.scales = List[Float32](length=groups * nb * kb, fill=0)
        for g in range(groups):
            for ib in range(nb):
                for jb in range(kb):
                    var amax = Float32(0)
                    for i in range(ib * self.bn, min((ib + 1) * self.bn, n)):
                        for j in range(jb * self.bk, min((jb + 1) * self.bk, k)):
                            amax = max(amax, abs(w[(g * n + i) * k + j]))
                    var s = amax / FP8_MAX if amax > 0 else Float32(1)
                    self.scales[(g * nb + ib) * kb + jb] = s
                    for i in range(ib * self.bn, min((ib + 1) * self.bn, n)):
                        for j in range(jb * self.bk, min((jb + 1) * self.bk, k)):
                            var x = min(max(w[(g * n + i) * k + j] / s, -FP8_MAX), FP8_MAX)
                            self.bytes[(g * n + i) * k + j] = fp8_byte(x)
                            self.values[(g * n + i) * k + j] = fp8_value(x)

    def scale(self, g: Int, i: Int, kb: Int) -> Float32:
        var nb = ceil_div(self.n, self.bn)
        var kbs = ceil_div(self.k, self.bk)
        return self.scales[(g * nb + i // self.bn) * kbs + kb]


struct Case(Movable):
    var heads: Int
    var nope: Int
    var rope: Int
    var rank: Int
    var v_dim: Int
    var key_dim: Int
    var page_size: Int
    var num_layers: Int
    var layer: Int
    var num_blocks: Int
    var pages_per_request: Int
    var num_requests: Int
    var num_tokens: Int
    var max_seq: Int
    var mask_kind: Int
    var window: Int
    var score_mod: Int
    var gm: Int
    var gn: Int
    var gk: Int
    var scale: Float32
    var epsilon: Float32
    var offsets: List[UInt32]
    var lengths: List[UInt32]
    var lookup: List[UInt32]
    var q: List[Float32]  # [T, H, Dn + Dr], values already rounded to dtype
    var freqs: List[Float32]  # [S, Dr]
    var gamma: List[Float32]  # [R]
    var blocks: List[Float32]  # [num_blocks, 1, L, ps, 1, D]
    var fp8: Bool  # the cache holds fp8_ds_mla rows (`fp8_bytes`); `blocks` are their values
    var row_bytes: Int  # of an fp8_ds_mla row
    var fp8_bytes: List[UInt8]  # [num_blocks, 1, L, ps, 1, row_bytes] when `fp8`
    var w_uk: QuantWeights
    var w_uv: QuantWeights

    def __init__[
        dtype: DType
    ](
        out self,
        seed: Int,
        heads: Int,
        cache_lengths: List[Int],
        new_tokens: List[Int],
        page_size: Int = 16,
        num_layers: Int = 2,
        layer: Int = 1,
        rank: Int = 512,
        nope: Int = 128,
        rope: Int = 64,
        v_dim: Int = 128,
        mask_kind: Int = 1,
        window: Int = 0,
        score_mod: Int = 0,
        gm: Int = 1,
        gn: Int = 128,
        gk: Int = 128,
        fp8: Bool = False,
        row_pool: Int = 0,
        odd_scales: Bool = False,
    ):
        """`row_pool` > 0 (the benchmarks' large caches, whose timings do not depend on the values): the
        cache's rows are copies of `row_pool` rows drawn at random (a hashed pick per physical row),
        instead of every row drawn (about 24 ns a value on a 2-core AMD EPYC: about a minute for 128
        requests of 32k keys). `odd_scales` (with `fp8`): the rows at page slots `s` with `s % 16 < 4` get
        scales that are not powers of two (each times 0.75; their values e4m3 x scale rounded to bfloat16,
        as every reader rounds them), as a writer other than pymla's quantizer may leave them: the narrow
        kernel's warps holding those rows widen them by `dequantize8`, the others by `widen_pow2`."""
        var rng = Rng(seed)
        self.heads = heads
        self.nope = nope
        self.rope = rope
        self.rank = rank
        self.v_dim = v_dim
        self.key_dim = rank + rope
        self.page_size = page_size
        self.num_layers = num_layers
        self.layer = layer
        self.mask_kind = mask_kind
        self.window = window
        self.score_mod = score_mod
        self.gm = gm
        self.gn = gn
        self.gk = gk
        self.epsilon = 1e-6
        self.scale = Float32(1.0) / sqrt(Float32(nope + rope)) * (1 + Float32(0.2) * rng.uniform())
        self.num_requests = len(cache_lengths)
        self.offsets = List[UInt32](length=self.num_requests + 1, fill=0)
        self.lengths = List[UInt32](length=self.num_requests, fill=0)
        var longest = 1
        for b in range(self.num_requests):
            self.offsets[b + 1] = self.offsets[b] + UInt32(new_tokens[b])
            self.lengths[b] = UInt32(cache_lengths[b])
            longest = max(longest, cache_lengths[b] + new_tokens[b])
        self.num_tokens = Int(self.offsets[self.num_requests])
        self.max_seq = longest + 1
        self.pages_per_request = ceil_div(longest, page_size) + 1
        self.num_blocks = self.num_requests * self.pages_per_request + 3
        # Pages handed out in a shuffled order; unused table entries are UNUSED_PAGE.
        var order = List[Int](length=self.num_blocks, fill=0)
        for i in range(self.num_blocks):
            order[i] = i
        for i in range(self.num_blocks - 1, 0, -1):
            var j = rng.below(i + 1)
            var tmp = order[i]
            order[i] = order[j]
            order[j] = tmp
        self.lookup = List[UInt32](length=self.num_requests * self.pages_per_request, fill=UNUSED_PAGE)
        var next_page = 0
        for b in range(self.num_requests):
            var visible = cache_lengths[b] + new_tokens[b]
            for p in range(ceil_div(visible, page_size)):
                self.lookup[b * self.pages_per_request + p] = UInt32(order[next_page])
                next_page += 1
        var physical_rows = self.num_blocks * num_layers * page_size
        var drawn = physical_rows if row_pool <= 0 else min(row_pool, physical_rows)
        self.blocks = List[Float32](length=drawn * self.key_dim, fill=0)
        for i in range(drawn * self.key_dim):
            self.blocks[i] = round_to[dtype](rng.normal() * 2 + 0.5)
        self.fp8 = fp8
        self.row_bytes = fp8_row_bytes(rank, rope)
        self.fp8_bytes = List[UInt8](length=1, fill=0)
        if fp8:
            self.fp8_bytes = List[UInt8](length=drawn * self.row_bytes, fill=0)
            for r in range(drawn):
                quantize_row(self.blocks, r * self.key_dim, rank, rope, self.fp8_bytes, r * self.row_bytes)
                if odd_scales and (r % page_size) % 16 < 4:
                    scale_row(self.fp8_bytes, r * self.row_bytes, rank, Float32(0.75))
            for r in range(drawn):
                dequantize_row(self.fp8_bytes, r * self.row_bytes, rank, rope, self.blocks, r * self.key_dim)
        if drawn < physical_rows:
            self.blocks = pooled_rows(self.blocks, drawn, physical_rows, self.key_dim)
            if fp8:
                self.fp8_bytes = pooled_rows(self.fp8_bytes, drawn, physical_rows, self.row_bytes)
        self.q = List[Float32](length=self.num_tokens * heads * (nope + rope), fill=0)
        for i in range(len(self.q)):
            self.q[i] = round_to[dtype](rng.normal() * 1.5)
        self.freqs = List[Float32](length=self.max_seq * rope, fill=0)
        for i in range(self.max_seq * rope // 2):
            var angle = rng.uniform() * 6.3
            self.freqs[2 * i] = round_to[dtype](cos(angle))
            self.freqs[2 * i + 1] = round_to[dtype](sin(angle))
        self.gamma = List[Float32](length=rank, fill=0)
        for i in range(rank):
            self.gamma[i] = round_to[dtype](1 + Float32(0.25) * rng.normal())
        var std = Float32(1.0) / sqrt(Float32(rank))
        self.w_uk = QuantWeights(rng, heads, rank, nope, gn, gk, std)
        self.w_uv = QuantWeights(rng, heads, v_dim, rank, gn, gk, std)

    def row_offset(self, b: Int, pos: Int) -> Int:
        var page = Int(self.lookup[b * self.pages_per_request + pos // self.page_size])
        return ((page * self.num_layers + self.layer) * self.page_size + pos % self.page_size) * self.key_dim

    def fp8_row_offset(self, b: Int, pos: Int) -> Int:
        """Byte offset of request `b`'s fp8_ds_mla row at `pos`."""
        return self.row_offset(b, pos) // self.key_dim * self.row_bytes

    def values_of(self, fp8_bytes: List[UInt8]) -> List[Float32]:
        """Every row's values (`blocks`' layout) of a cache of fp8_ds_mla rows."""
        var rows = len(fp8_bytes) // self.row_bytes
        var values = List[Float32](length=rows * self.key_dim, fill=0)
        for r in range(rows):
            dequantize_row(fp8_bytes, r * self.row_bytes, self.rank, self.rope, values, r * self.key_dim)
        return values^

    def quantized_new_rows(self, values: List[Float32]) -> List[UInt8]:
        """`fp8_bytes` with the new tokens' rows quantized from `values` (`blocks`' layout): the expected cache."""
        var out = self.fp8_bytes.copy()
        for t in range(self.num_tokens):
            var b = self.request_of(t)
            var pos = self.position(t)
            quantize_row(values, self.row_offset(b, pos), self.rank, self.rope, out, self.fp8_row_offset(b, pos))
        return out^

    def request_of(self, t: Int) -> Int:
        var b = 0
        while Int(self.offsets[b + 1]) <= t:
            b += 1
        return b

    def position(self, t: Int) -> Int:
        var b = self.request_of(t)
        return Int(self.lengths[b]) + t - Int(self.offsets[b])

    def new_row_mask(self) -> List[Bool]:
        """True at the elements of the rows the op updates."""
        var mask = List[Bool](length=len(self.blocks), fill=False)
        for t in range(self.num_tokens):
            var off = self.row_offset(self.request_of(t), self.position(t))
            for i in range(self.key_dim):
                mask[off + i] = True
        return mask^


# ---------------------------------------------------------------------------
# Host <-> device
# ---------------------------------------------------------------------------


def upload[dtype: DType](ctx: DeviceContext, values: List[Float32]) raises -> DeviceBuffer[dtype]:
    var host = List[Scalar[dtype]](length=max(len(values), 1), fill=0)
    for i in range(len(values)):
        host[i] = values[i].cast[dtype]()
    var buf = ctx.enqueue_create_buffer[dtype](len(host))
    ctx.enqueue_copy(dst_buf=buf, src_ptr=host.unsafe_ptr())
    ctx.synchronize()
    return buf^


def upload_u32(ctx: DeviceContext, values: List[UInt32]) raises -> DeviceBuffer[DType.uint32]:
    var host = values.copy()
    if len(host) == 0:
        host.append(0)
    var buf = ctx.enqueue_create_buffer[DType.uint32](len(host))
    ctx.enqueue_copy(dst_buf=buf, src_ptr=host.unsafe_ptr())
    ctx.synchronize()
    return buf^


def upload_u8(ctx: DeviceContext, values: List[UInt8]) raises -> DeviceBuffer[DType.uint8]:
    var buf = ctx.enqueue_create_buffer[DType.uint8](len(values))
    ctx.enqueue_copy(dst_buf=buf, src_ptr=values.unsafe_ptr())
    ctx.synchronize()
    return buf^


def download_u8(ctx: DeviceContext, buf: DeviceBuffer[DType.uint8]) raises -> List[UInt8]:
    var host = List[UInt8](length=len(buf), fill=0)
    ctx.enqueue_copy(dst_ptr=host.unsafe_ptr(), src_buf=buf)
    ctx.synchronize()
    return host^


def download[dtype: DType](ctx: DeviceContext, buf: DeviceBuffer[dtype], n: Int) raises -> List[Float32]:
    var host = List[Scalar[dtype]](length=max(len(buf), 1), fill=0)
    ctx.enqueue_copy(dst_ptr=host.unsafe_ptr(), src_buf=buf)
    ctx.synchronize()
    var out = List[Float32](length=n, fill=0)
    for i in range(n):
        out[i] = host[i].cast[DType.float32]()
    return out^


def untracked[dtype: DType](buf: DeviceBuffer[dtype]) -> DPtr[dtype]:
    return buf.unsafe_ptr().unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()


struct DeviceCase[dtype: DType](Movable):
    """A case's inputs on the device, and each step launched alone on them under a given plan."""

    var q: DeviceBuffer[Self.dtype]
    var offsets: DeviceBuffer[DType.uint32]
    var lengths: DeviceBuffer[DType.uint32]
    var lookup: DeviceBuffer[DType.uint32]
    var freqs: DeviceBuffer[Self.dtype]
    var gamma: DeviceBuffer[Self.dtype]
    var blocks: DeviceBuffer[Self.dtype]
    var fp8_bytes: DeviceBuffer[DType.uint8]  # the cache when the case is `fp8` (else unused)
    var w_uk: DeviceBuffer[DType.uint8]
    var w_uk_scale: DeviceBuffer[DType.float32]
    var w_uv: DeviceBuffer[DType.uint8]
    var w_uv_scale: DeviceBuffer[DType.float32]
    var output: DeviceBuffer[Self.dtype]

    def __init__(out self, ctx: DeviceContext, c: Case) raises:
        self.q = upload[Self.dtype](ctx, c.q)
        self.offsets = upload_u32(ctx, c.offsets)
        self.lengths = upload_u32(ctx, c.lengths)
        self.lookup = upload_u32(ctx, c.lookup)
        self.freqs = upload[Self.dtype](ctx, c.freqs)
        self.gamma = upload[Self.dtype](ctx, c.gamma)
        self.blocks = upload[Self.dtype](ctx, c.blocks)
        self.fp8_bytes = upload_u8(ctx, c.fp8_bytes)
        self.w_uk = upload_u8(ctx, c.w_uk.bytes)
        self.w_uk_scale = upload[DType.float32](ctx, c.w_uk.scales)
        self.w_uv = upload_u8(ctx, c.w_uv.bytes)
        self.w_uv_scale = upload[DType.float32](ctx, c.w_uv.scales)
        self.output = ctx.enqueue_create_buffer[Self.dtype](max(c.num_tokens * c.heads * c.v_dim, 1))

    def problem(self, c: Case) -> DecodeProblem[Self.dtype]:
        """The op's inputs: no attention output, no new rows (the rows are in the cache, of dtype or,
        for an `fp8` case, fp8_ds_mla rows as the op passes them: `cache` over the bytes, `fp8_cache` active)."""
        var rows = PagedLatentRows[Self.dtype].create(
            untracked(self.blocks), untracked(self.lookup), c.pages_per_request,
            c.num_layers, c.page_size, c.key_dim, c.layer,
        )
        var fp8 = Fp8LatentRows.absent(rows)
        if c.fp8:
            rows = PagedLatentRows[Self.dtype].create(
                untracked(self.fp8_bytes).unsafe_bitcast[Scalar[Self.dtype]](), untracked(self.lookup),
                c.pages_per_request, c.num_layers, c.page_size, c.row_bytes, c.layer,
            )
            fp8 = Fp8LatentRows.create(
                untracked(self.fp8_bytes), untracked(self.lookup), c.pages_per_request, c.num_layers, c.page_size,
                c.row_bytes, c.layer, c.rank,
            )
        return DecodeProblem[Self.dtype](
            untracked(self.output), True, untracked(self.q),
            RaggedBatch(untracked(self.offsets), untracked(self.lengths), c.num_requests, CacheShard.whole()),
            untracked(self.freqs), untracked(self.gamma),
            rows,
            c.num_tokens, c.heads, c.nope, c.rope, c.rank, c.v_dim,
            c.scale, c.epsilon, MaskSpec(c.mask_kind, c.window), c.score_mod,
            Granularity(c.gm, c.gn, c.gk),
            untracked(self.w_uk), untracked(self.w_uk_scale), untracked(self.w_uv), untracked(self.w_uv_scale),
            untracked(self.output), False,  # no attention_output
            untracked(self.w_uk_scale), False,  # no lse
            untracked(self.q), False,  # no new_rows
            False,  # all six steps
            fp8,
        )

    def plan(self, ctx: DeviceContext, c: Case) raises -> GpuPlan:
        """The op's own plan for this case on this device."""
        return GpuPlan.create(self.problem(c), DeviceLimits.read(ctx))

    def attention(
        self, ctx: DeviceContext, c: Case, plan: GpuPlan, q_full: DeviceBuffer[DType.float32], raw: DeviceBuffer[DType.float32]
    ) raises:
        """Step 5 alone on this case's cache."""
        gpu_attention[Self.dtype](ctx, self.problem(c), plan, untracked(q_full), untracked(raw))

    def attention_lse(
        self,
        ctx: DeviceContext,
        c: Case,
        plan: GpuPlan,
        q_full: DeviceBuffer[DType.float32],
        raw: DeviceBuffer[DType.float32],
        lse: DeviceBuffer[DType.float32],
    ) raises:
        """Step 5 alone with its LSE into `lse [T H]`."""
        var p = self.problem(c)
        p.lse = untracked(lse)
        p.has_lse = True
        gpu_attention[Self.dtype](ctx, p, plan, untracked(q_full), untracked(raw))

    def build_q_full(self, ctx: DeviceContext, c: Case, plan: GpuPlan, q_full: DeviceBuffer[DType.float32]) raises:
        """Steps 1, 3, 4 on q alone (no cache rows)."""
        var p = self.problem(c)
        gpu_build_q_full[Self.dtype](
            ctx, p, plan, untracked(q_full), cache_rows_params(p, 0), ScheduleParams.nothing(DeviceBatch.of(p.batch))
        )

    def project_output(
        self, ctx: DeviceContext, c: Case, plan: GpuPlan, raw: DeviceBuffer[DType.float32], att_out: DeviceBuffer[Self.dtype]
    ) raises:
        """Step 6 alone into `self.output`, storing the attention output in `att_out`."""
        var p = self.problem(c)
        p.attention_output = untracked(att_out)
        p.has_attention_output = True
        gpu_project_output[Self.dtype](ctx, p, plan, untracked(raw), QuantizedRows.none(to_global(untracked(raw))))

    def project_only(self, ctx: DeviceContext, c: Case, att: DeviceBuffer[Self.dtype], pdl: Bool = False) raises:
        """The op with first_step 6: step 6 alone into `self.output`, from the attention output `att`
        (`pdl`: the op's plan with programmatic dependent launch)."""
        var p = self.problem(c)
        p.attention_output = untracked(att)
        p.has_attention_output = True
        p.project_only = True
        if pdl:
            var plan = GpuPlan.create(p, DeviceLimits.read(ctx))
            plan.pdl = True
            gpu_run_plan[Self.dtype](ctx, p, plan)
        else:
            mla_decode_branch_fp8_gpu[Self.dtype](p, ctx)

    def run_op(self, ctx: DeviceContext, c: Case) raises:
        mla_decode_branch_fp8_gpu[Self.dtype](self.problem(c), ctx)

    def run_plan(self, ctx: DeviceContext, c: Case, plan: GpuPlan) raises:
        """The whole op under `plan` (e.g. the op's plan with `pdl` set)."""
        gpu_run_plan[Self.dtype](ctx, self.problem(c), plan)

    def run_plan_storing(self, ctx: DeviceContext, c: Case, plan: GpuPlan, att_out: DeviceBuffer[Self.dtype]) raises:
        """The whole op under `plan`, also storing the attention output in `att_out`."""
        var p = self.problem(c)
        p.attention_output = untracked(att_out)
        p.has_attention_output = True
        gpu_run_plan[Self.dtype](ctx, p, plan)


def variant_index[v: Tuple[Int, Int, Int]]() -> Int:
    """Index of attention variant `v` in ATTENTION_VARIANTS (-1 when it is not one of them)."""
    comptime for i in range(len(ATTENTION_VARIANTS)):
        comptime w = ATTENTION_VARIANTS[i]
        if w[0] == v[0] and w[1] == v[1] and w[2] == v[2]:
            return i
    return -1


def pooled_rows[T: ImplicitlyCopyable](pool: List[T], drawn: Int, rows: Int, width: Int) -> List[T]:
    """`rows` rows of `width` values, row `r` a copy of row `hash(r) % drawn` of `pool`."""
    var out = List[T](capacity=rows * width)
    for r in range(rows):
        var src = Int((UInt64(r) * 2654435761 + 12345) % UInt64(drawn)) * width
        for i in range(width):
            out.append(pool[src + i])
    return out^


def decode_case[
    dtype: DType
](batch: Int, heads: Int, cache_len: Int, seed: Int = 99, one_long: Bool = False, fp8: Bool = False) -> Case:
    """A DeepSeek-sized decode step: `batch` requests of `cache_len` cached tokens and one new token each
    (`one_long`: the first request's; the others have `cache_len // 16`, a long request beside short ones;
    `fp8`: the cache in fp8_ds_mla rows). For timings: its rows are copies of 4096 drawn ones (`row_pool`)."""
    var lengths = List[Int]()
    var news = List[Int]()
    for b in range(batch):
        lengths.append(cache_len if b == 0 or not one_long else cache_len // 16)
        news.append(1)
    return Case.__init__[dtype](seed, heads, lengths, news, page_size=64, num_layers=1, layer=0, fp8=fp8, row_pool=4096)
