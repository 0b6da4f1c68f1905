# GPU smoke test of mojo_kernels/gpu/: every stage against plain CPU loops.
#
# Run on a machine with an NVIDIA GPU, from the repository root:
#     mojo run -I . tests/gpu/gpu_smoke.mojo            # correctness cases
#     mojo run -I . tests/gpu/gpu_smoke.mojo bench      # plus timings of DeepSeek-sized decode steps
#     mojo run -I . tests/gpu/gpu_smoke.mojo bench-only 64:128:8191:5   # timings only, BATCH:HEADS:CACHE_LEN[:ITERS]
#     mojo run -I . tests/gpu/gpu_smoke.mojo proj 64:128:0:50   # steps 1-4 on q and step 6 alone, every tile shape
# Build without a GPU (checks that every kernel compiles for sm_90, emits PTX):
#     mojo build --target-accelerator=sm_90 --emit asm -I . tests/gpu/gpu_smoke.mojo -o /tmp/smoke/smoke.s
#
# Each case checks, in order:
#   cache   rows rotated + normalized in place (CPU loops on the same inputs), other bytes unchanged
#   q_full  concat(fp8mm(q_nope, w_uk), rope(q_rope)) against the blockwise fp8 formula of pymla/quant.py
#   raw     attention from the GPU's own q_full and cache (float64 on the CPU), for 1 and several partitions
#   output  output projection of the GPU's raw (CPU fp8mm), then the whole op against the CPU pipeline
#           with the tolerance of pymla/parity.py
# Exit status 1 if any check fails.

from std.math import cos, exp, log, sin, sqrt
from std.memory import bitcast
from std.sys import argv, has_accelerator, size_of
from std.time import perf_counter_ns

from max.gpu.host import DeviceBuffer, DeviceContext

from mojo_kernels.common import DPtr
from mojo_kernels.gpu.pipeline import (
    NO_TILE,
    WGMMA_SHAPE,
    cache_rows_args,
    gpu_attention,
    gpu_build_q_full,
    gpu_project_output,
    gpu_rotate_and_normalize_new_rows,
    mla_decode_branch_fp8_gpu,
)
from mojo_kernels.gpu.steps_fused import PROJ_TILES, tile_fits
from mojo_kernels.gpu.attention_wgmma import wgmma_supported
from mojo_kernels.paged_cache import PagedLatentRows, RaggedBatch
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


# ---------------------------------------------------------------------------
# CPU reference pieces (the docstring of pymla/reference.py)
# ---------------------------------------------------------------------------


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


def cpu_fp8mm(
    a: List[Float32], groups: Int, m_rows: Int, k_cols: Int, w: QuantWeights, gm: Int, gk: Int
) -> List[Float32]:
    """`out[g, m, n]` of pymla.quant.fp8_batched_matmul for `a [G, M, K]` (float64 sums)."""
    var bm = extent(gm, m_rows)
    var bk = extent(gk, k_cols)
    var mb_count = ceil_div(m_rows, bm)
    var kb_count = ceil_div(k_cols, bk)
    var aq = List[Float32](length=groups * m_rows * k_cols, fill=0)
    var sa = List[Float32](length=groups * mb_count * kb_count, fill=0)
    for g in range(groups):
        for mb in range(mb_count):
            for kb in range(kb_count):
                var amax = Float32(0)
                for m in range(mb * bm, min((mb + 1) * bm, m_rows)):
                    for k in range(kb * bk, min((kb + 1) * bk, k_cols)):
                        amax = max(amax, abs(a[(g * m_rows + m) * k_cols + k]))
                var s = amax / FP8_MAX if amax > 0 else Float32(1)
                sa[(g * mb_count + mb) * kb_count + kb] = s
                for m in range(mb * bm, min((mb + 1) * bm, m_rows)):
                    for k in range(kb * bk, min((kb + 1) * bk, k_cols)):
                        var x = min(max(a[(g * m_rows + m) * k_cols + k] / s, -FP8_MAX), FP8_MAX)
                        aq[(g * m_rows + m) * k_cols + k] = fp8_value(x)
    var out = List[Float32](length=groups * m_rows * w.n, fill=0)
    for g in range(groups):
        for m in range(m_rows):
            for n in range(w.n):
                var acc = Float64(0)
                for kb in range(kb_count):
                    var part = Float64(0)
                    for k in range(kb * bk, min((kb + 1) * bk, k_cols)):
                        part += Float64(aq[(g * m_rows + m) * k_cols + k]) * Float64(w.values[(g * w.n + n) * k_cols + k])
                    acc += part * Float64(sa[(g * mb_count + m // bm) * kb_count + kb]) * Float64(w.scale(g, n, kb))
                out[(g * m_rows + m) * w.n + n] = Float32(acc)
    return out^


def key_range(kind: Int, window: Int, p: Int, visible: Int) -> Tuple[Int, Int]:
    if kind == 0:
        return (0, visible)
    if kind == 2:
        return (max(0, p - window + 1), p + 1)
    if kind == 3:
        return ((p // window) * window, p + 1)
    return (0, p + 1)


def alibi(h: Int, heads: Int) -> Float64:
    var n = 1
    while n * 2 <= heads:
        n *= 2
    if h < n:
        return Float64(2.0) ** (-8.0 * Float64(h + 1) / Float64(n))
    return Float64(2.0) ** (-8.0 * Float64(2 * (h - n) + 1) / Float64(2 * n))


# ---------------------------------------------------------------------------
# A test case: inputs on the host, CPU reference, GPU buffers
# ---------------------------------------------------------------------------


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
    ):
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
        var row_elems = self.num_blocks * num_layers * page_size * self.key_dim
        self.blocks = List[Float32](length=row_elems, fill=0)
        for i in range(row_elems):
            self.blocks[i] = round_to[dtype](rng.normal() * 2 + 0.5)
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

    # Steps 1 and 2 on a copy of the blocks.
    def cpu_cache_rows[dtype: DType](self) -> List[Float32]:
        var out = self.blocks.copy()
        for t in range(self.num_tokens):
            var pos = self.position(t)
            var off = self.row_offset(self.request_of(t), pos)
            var ss = Float64(0)
            for i in range(self.rank):
                ss += Float64(self.blocks[off + i]) * Float64(self.blocks[off + i])
            var inv = Float32(1.0 / sqrt(ss / Float64(self.rank) + Float64(self.epsilon)))
            for i in range(self.rank):
                out[off + i] = round_to[dtype](self.blocks[off + i] * inv * self.gamma[i])
            for j in range(self.rope // 2):
                var x0 = self.blocks[off + self.rank + 2 * j]
                var x1 = self.blocks[off + self.rank + 2 * j + 1]
                var c = self.freqs[pos * self.rope + 2 * j]
                var s = self.freqs[pos * self.rope + 2 * j + 1]
                out[off + self.rank + 2 * j] = round_to[dtype](x0 * c - x1 * s)
                out[off + self.rank + 2 * j + 1] = round_to[dtype](x0 * s + x1 * c)
        return out^

    # Steps 1, 3 and 4.
    def cpu_q_full[dtype: DType](self) -> List[Float32]:
        var heads = self.heads
        var tokens = self.num_tokens
        var qs = self.nope + self.rope
        var a = List[Float32](length=heads * tokens * self.nope, fill=0)
        for h in range(heads):
            for t in range(tokens):
                for k in range(self.nope):
                    a[(h * tokens + t) * self.nope + k] = self.q[(t * heads + h) * qs + k]
        var proj = cpu_fp8mm(a, heads, tokens, self.nope, self.w_uk, self.gm, self.gk)
        var out = List[Float32](length=tokens * heads * self.key_dim, fill=0)
        for t in range(tokens):
            var pos = self.position(t)
            for h in range(heads):
                var dst = (t * heads + h) * self.key_dim
                for n in range(self.rank):
                    out[dst + n] = round_to[dtype](proj[(h * tokens + t) * self.rank + n])
                for j in range(self.rope // 2):
                    var x0 = self.q[(t * heads + h) * qs + self.nope + 2 * j]
                    var x1 = self.q[(t * heads + h) * qs + self.nope + 2 * j + 1]
                    var c = self.freqs[pos * self.rope + 2 * j]
                    var s = self.freqs[pos * self.rope + 2 * j + 1]
                    out[dst + self.rank + 2 * j] = round_to[dtype](x0 * c - x1 * s)
                    out[dst + self.rank + 2 * j + 1] = round_to[dtype](x0 * s + x1 * c)
        return out^

    # Step 5, in float64 with the op's rounding points (P and raw rounded to dtype), from any
    # q_full and cache blocks.
    def cpu_attention[dtype: DType](self, q_full: List[Float32], blocks: List[Float32]) -> List[Float32]:
        var heads = self.heads
        var raw = List[Float32](length=self.num_tokens * heads * self.rank, fill=0)
        var scores = List[Float64]()
        var acc = List[Float64](length=self.rank, fill=0)
        for t in range(self.num_tokens):
            var b = self.request_of(t)
            var p = self.position(t)
            var visible = Int(self.lengths[b]) + Int(self.offsets[b + 1]) - Int(self.offsets[b])
            var r = key_range(self.mask_kind, self.window, p, visible)
            for h in range(heads):
                var qrow = (t * heads + h) * self.key_dim
                var slope = alibi(h, heads) if self.score_mod == 1 else Float64(0)
                scores.clear()
                var top = Float64(-1e300)
                for j in range(r[0], r[1]):
                    var off = self.row_offset(b, j)
                    var s = Float64(0)
                    for i in range(self.key_dim):
                        s += Float64(q_full[qrow + i]) * Float64(blocks[off + i])
                    s = s * Float64(self.scale) - slope * Float64(p - j)
                    scores.append(s)
                    top = max(top, s)
                var total = Float64(0)
                for i in range(self.rank):
                    acc[i] = 0
                for j in range(r[0], r[1]):
                    var e = exp(scores[j - r[0]] - top)
                    total += e
                    var e_rounded = Float64(round_to[dtype](Float32(e)))
                    var off = self.row_offset(b, j)
                    for i in range(self.rank):
                        acc[i] += e_rounded * Float64(blocks[off + i])
                for i in range(self.rank):
                    raw[(t * heads + h) * self.rank + i] = round_to[dtype](Float32(acc[i] / total))
        return raw^

    # Step 6 from any raw [T, H, R].
    def cpu_output(self, raw: List[Float32]) -> List[Float32]:
        var heads = self.heads
        var tokens = self.num_tokens
        var a = List[Float32](length=heads * tokens * self.rank, fill=0)
        for h in range(heads):
            for t in range(tokens):
                for k in range(self.rank):
                    a[(h * tokens + t) * self.rank + k] = raw[(t * heads + h) * self.rank + k]
        var proj = cpu_fp8mm(a, heads, tokens, self.rank, self.w_uv, self.gm, self.gk)
        var out = List[Float32](length=tokens * heads * self.v_dim, fill=0)
        for t in range(tokens):
            for h in range(heads):
                for n in range(self.v_dim):
                    out[(t * heads + h) * self.v_dim + n] = proj[(h * tokens + t) * self.v_dim + n]
        return out^


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
    var q: DeviceBuffer[Self.dtype]
    var offsets: DeviceBuffer[DType.uint32]
    var lengths: DeviceBuffer[DType.uint32]
    var lookup: DeviceBuffer[DType.uint32]
    var freqs: DeviceBuffer[Self.dtype]
    var gamma: DeviceBuffer[Self.dtype]
    var blocks: DeviceBuffer[Self.dtype]
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
        self.w_uk = upload_u8(ctx, c.w_uk.bytes)
        self.w_uk_scale = upload[DType.float32](ctx, c.w_uk.scales)
        self.w_uv = upload_u8(ctx, c.w_uv.bytes)
        self.w_uv_scale = upload[DType.float32](ctx, c.w_uv.scales)
        self.output = ctx.enqueue_create_buffer[Self.dtype](max(c.num_tokens * c.heads * c.v_dim, 1))

    def cache(self, c: Case) -> PagedLatentRows[Self.dtype]:
        return PagedLatentRows[Self.dtype].create(
            untracked(self.blocks), untracked(self.lookup), c.pages_per_request,
            c.num_layers, c.page_size, c.key_dim, c.layer,
        )

    def attention[
        groups: Int = 0, kt: Int = 32, gw: Int = 4
    ](
        self, ctx: DeviceContext, c: Case, q_full: DeviceBuffer[DType.float32], raw: DeviceBuffer[DType.float32],
        parts: Int, force_fma: Bool = False,
    ) raises:
        """Step 5 alone on this case's cache (`gpu_attention`'s parameters; `parts` 0 = planned)."""
        gpu_attention[Self.dtype, groups, kt, gw](
            ctx, untracked(q_full), self.cache(c), untracked(self.offsets), untracked(self.lengths), c.num_requests,
            c.num_tokens, c.heads, c.rank, parts, c.pages_per_request * c.page_size, c.scale,
            MaskSpec(c.mask_kind, c.window), c.score_mod, untracked(raw), force_fma=force_fma,
        )

    def build_q_full[
        tile: Tuple[Int, Int, Int, Int] = NO_TILE
    ](self, ctx: DeviceContext, c: Case, q_full: DeviceBuffer[DType.float32], force_fma: Bool = False) raises:
        """Steps 1, 3, 4 on q alone (no cache rows): `gpu_build_q_full` with `tile` pinned (0: the op's choice)."""
        var no_rows = cache_rows_args[Self.dtype](
            self.cache(c), untracked(self.offsets), untracked(self.lengths), c.num_requests, 0,
            untracked(self.freqs), untracked(self.gamma), c.epsilon, c.rank, c.rope, untracked(self.q), False,
        )
        gpu_build_q_full[Self.dtype, tile](
            ctx, untracked(self.q), untracked(self.offsets), untracked(self.lengths), c.num_requests, c.num_tokens, c.heads,
            c.nope, c.rope, c.rank, untracked(self.freqs), untracked(self.w_uk), untracked(self.w_uk_scale),
            Granularity(c.gm, c.gn, c.gk), untracked(q_full), no_rows, force_fma=force_fma,
        )

    def project_output[
        tile: Tuple[Int, Int, Int, Int] = NO_TILE
    ](
        self, ctx: DeviceContext, c: Case, raw: DeviceBuffer[DType.float32], att_out: DeviceBuffer[Self.dtype],
        force_fma: Bool = False,
    ) raises:
        """Step 6 alone into `self.output`, storing the attention output in `att_out`."""
        gpu_project_output[Self.dtype, tile](
            ctx, untracked(raw), untracked(self.w_uv), untracked(self.w_uv_scale), untracked(self.output),
            c.num_tokens, c.heads, c.rank, c.v_dim, Granularity(c.gm, c.gn, c.gk), untracked(att_out), True,
            force_fma=force_fma,
        )

    def run_op(self, ctx: DeviceContext, c: Case) raises:
        var problem = DecodeProblem[Self.dtype](
            untracked(self.output), untracked(self.q),
            RaggedBatch(untracked(self.offsets), untracked(self.lengths), c.num_requests),
            untracked(self.freqs), untracked(self.gamma), self.cache(c),
            c.num_tokens, c.heads, c.nope, c.rope, c.rank, c.v_dim,
            c.scale, c.epsilon, MaskSpec(c.mask_kind, c.window), c.score_mod,
            Granularity(c.gm, c.gn, c.gk),
            untracked(self.w_uk), untracked(self.w_uk_scale), untracked(self.w_uv), untracked(self.w_uv_scale),
            untracked(self.output).unsafe_bitcast[Scalar[Self.dtype]](), False,  # no attention_output
            untracked(self.q), False,  # no new_rows: the rows are in the cache
        )
        mla_decode_branch_fp8_gpu[Self.dtype](problem, ctx)


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def max_abs(values: List[Float32]) -> Float32:
    var m = Float32(0)
    for v in values:
        m = max(m, abs(v))
    return m


def report(name: String, ok: Bool, detail: String) -> Bool:
    print("  ", "PASS" if ok else "FAIL", name, detail)
    return ok


def check_close(name: String, got: List[Float32], want: List[Float32], rel_tol: Float32) -> Bool:
    var top = max_abs(want)
    var worst = Float32(0)
    var worst_i = 0
    var nans = 0
    for i in range(len(want)):
        var e = abs(got[i] - want[i])
        if e != e:
            nans += 1
            continue
        if e > worst:
            worst = e
            worst_i = i
    var rel = worst / top if top > 0 else worst
    var ok = rel <= rel_tol and nans == 0
    return report(
        name, ok,
        String("max err ", rel, " x max|ref| (tol ", rel_tol, ") at ", worst_i, ": got ", got[worst_i] if len(got) > 0 else Float32(0),
               " want ", want[worst_i] if len(want) > 0 else Float32(0), ", NaN ", nans),
    )


def ulp_of[dtype: DType]() -> Float32:
    comptime if dtype == DType.bfloat16:
        return Float32(2.0) ** -7
    elif dtype == DType.float16:
        return Float32(2.0) ** -10
    else:
        return Float32(2.0) ** -23


def raw_tolerance[dtype: DType]() -> Float32:
    """Step 5 vs the float64 loop, x max|ref|: pymla/parity.py's per-element bound at its largest
    (2u M + 2^(1-p) |raw| with M, |raw| <= max|V|), or float32 sums in another order."""
    comptime if dtype == DType.float32:
        return Float32(1e-4)
    else:
        return 2 * ulp_of[dtype]()


def check_parity[dtype: DType](name: String, got: List[Float32], want: List[Float32]) -> Bool:
    """As pymla/parity.py: all within 2 ulp + 1e-6 + 2^-8, 95% within 2 ulp + 1e-6 (x max|ref|)."""
    var top = max_abs(want)
    var ulp_bound = 2 * ulp_of[dtype]() + Float32(1e-6)
    var worst = Float32(0)
    var within = 0
    var nans = 0
    for i in range(len(want)):
        var e = abs(got[i] - want[i])
        if e != e:
            nans += 1
            continue
        worst = max(worst, e)
        if e <= ulp_bound * top:
            within += 1
    var rel = worst / top if top > 0 else worst
    var bulk = Float32(within) / Float32(max(len(want), 1))
    var ok = nans == 0 and rel <= ulp_bound + Float32(2.0) ** -8 and bulk >= 0.95
    return report(name, ok, String("max err ", rel, " x max|ref|, ", bulk * 100, "% within ", ulp_bound, ", NaN ", nans))


def cache_tolerance[dtype: DType]() -> Float32:
    comptime if dtype == DType.bfloat16:
        return Float32(2.0) ** -7
    elif dtype == DType.float16:
        return Float32(2.0) ** -10
    else:
        return Float32(2.0) ** -20


def check_cache[dtype: DType](c: Case, got: List[Float32], want: List[Float32]) -> Bool:
    var mask = c.new_row_mask()
    var top = Float32(0)
    var worst = Float32(0)
    var changed = 0
    for i in range(len(want)):
        if mask[i]:
            top = max(top, abs(want[i]))
    for i in range(len(want)):
        if mask[i]:
            worst = max(worst, abs(got[i] - want[i]))
        elif got[i] != c.blocks[i]:
            changed += 1
    var rel = worst / top if top > 0 else worst
    var ok = rel <= cache_tolerance[dtype]() and changed == 0
    return report("cache", ok, String("max err ", rel, " x max|ref| (tol ", cache_tolerance[dtype](), "), other elements changed: ", changed))


def run_case[dtype: DType](ctx: DeviceContext, name: String, c: Case) raises -> Bool:
    print(name, "dtype", dtype, "T", c.num_tokens, "H", c.heads, "R", c.rank, "Dr", c.rope, "Dn", c.nope, "Dv", c.v_dim,
          "mask", c.mask_kind, "window", c.window, "score_mod", c.score_mod, "gran", c.gm, c.gn, c.gk)
    var ok = True
    var rows = c.num_tokens * c.heads

    # Stage by stage, each from the GPU's previous results.
    var d = DeviceCase[dtype](ctx, c)
    var cache = d.cache(c)
    gpu_rotate_and_normalize_new_rows[dtype](
        ctx,
        cache_rows_args[dtype](
            cache, untracked(d.offsets), untracked(d.lengths), c.num_requests, c.num_tokens,
            untracked(d.freqs), untracked(d.gamma), c.epsilon, c.rank, c.rope, untracked(d.q), False,
        ),
    )
    var gpu_blocks = download[dtype](ctx, d.blocks, len(c.blocks))
    var ref_blocks = c.cpu_cache_rows[dtype]()
    ok = check_cache[dtype](c, gpu_blocks, ref_blocks) and ok

    var q_full_buf = ctx.enqueue_create_buffer[DType.float32](max(rows * c.key_dim, 1))
    var raw_buf = ctx.enqueue_create_buffer[DType.float32](max(rows * c.rank, 1))
    var ref_q_full = c.cpu_q_full[dtype]()
    # q_full: dtype values; a float32 sum in another order may round one ulp the other way.
    # Every tile shape of the tensor-core kernel and the FMA path, then the op's own choice (kept).
    comptime if dtype != DType.float32:
        var q_bk = Granularity(c.gm, c.gn, c.gk).resolve(c.num_tokens, c.rank, c.nope).k
        comptime for i in range(len(PROJ_TILES)):
            if tile_fits(PROJ_TILES[i], c.nope, q_bk):
                d.build_q_full[PROJ_TILES[i]](ctx, c, q_full_buf)
                ok = check_close(String("q_full (tile ", PROJ_TILES[i][0], "x", PROJ_TILES[i][1], "x", PROJ_TILES[i][2], "x", PROJ_TILES[i][3], ")"),
                                 download[DType.float32](ctx, q_full_buf, rows * c.key_dim), ref_q_full, ulp_of[dtype]()) and ok
            else:
                print("  q_full: tile", i, "does not fit in shared memory, skipped")
        d.build_q_full(ctx, c, q_full_buf, force_fma=True)
        ok = check_close("q_full (FMA path)", download[DType.float32](ctx, q_full_buf, rows * c.key_dim), ref_q_full, ulp_of[dtype]()) and ok
    d.build_q_full(ctx, c, q_full_buf)
    var gpu_q_full = download[DType.float32](ctx, q_full_buf, rows * c.key_dim)
    ok = check_close("q_full", gpu_q_full, ref_q_full, ulp_of[dtype]()) and ok

    var raw_from_gpu = c.cpu_attention[dtype](gpu_q_full, gpu_blocks)
    var gpu_raw = List[Float32]()
    # 0 = the partitions the op would plan itself (last, so gpu_raw is the op's).
    for parts in [1, 3, 0]:
        d.attention(ctx, c, q_full_buf, raw_buf, parts)
        gpu_raw = download[DType.float32](ctx, raw_buf, rows * c.rank)
        ok = check_close(String("raw (", "planned" if parts == 0 else String(parts), " partitions)"), gpu_raw, raw_from_gpu, raw_tolerance[dtype]()) and ok
    comptime if dtype != DType.float32:
        # The FMA kernel too (the op uses tensor cores for this dtype when sizes allow).
        d.attention(ctx, c, q_full_buf, raw_buf, 2, force_fma=True)
        ok = check_close("raw (FMA kernel, 2 partitions)", download[DType.float32](ctx, raw_buf, rows * c.rank), raw_from_gpu, raw_tolerance[dtype]()) and ok
        # The tensor-core shape for small kv_lora_rank (the op picks it only when the others do not fit).
        d.attention[1, 32, 4](ctx, c, q_full_buf, raw_buf, 2)
        ok = check_close("raw (tensor cores 1 x 32 x 4, 2 partitions)", download[DType.float32](ctx, raw_buf, rows * c.rank), raw_from_gpu, raw_tolerance[dtype]()) and ok
        # The warpgroup (wgmma) kernel on every case it supports, whatever the head count.
        if wgmma_supported[dtype](c.key_dim, c.rank):
            for parts in [1, 3]:
                d.attention[WGMMA_SHAPE[0], WGMMA_SHAPE[1], 0](ctx, c, q_full_buf, raw_buf, parts)
                ok = check_close(String("raw (wgmma, ", parts, " partitions)"), download[DType.float32](ctx, raw_buf, rows * c.rank), raw_from_gpu, raw_tolerance[dtype]()) and ok
        # Restore the op's own raw for the output stage.
        d.attention(ctx, c, q_full_buf, raw_buf, 0)

    var ref_out_stage = c.cpu_output(gpu_raw)
    for i in range(len(ref_out_stage)):
        ref_out_stage[i] = round_to[dtype](ref_out_stage[i])
    var att_out = ctx.enqueue_create_buffer[dtype](max(rows * c.rank, 1))
    comptime if dtype != DType.float32:
        var o_bk = Granularity(c.gm, c.gn, c.gk).resolve(c.num_tokens, c.v_dim, c.rank).k
        comptime for i in range(len(PROJ_TILES)):
            if tile_fits(PROJ_TILES[i], c.rank, o_bk):
                d.project_output[PROJ_TILES[i]](ctx, c, raw_buf, att_out)
                ok = check_parity[dtype](String("output stage (tile ", PROJ_TILES[i][0], "x", PROJ_TILES[i][1], "x", PROJ_TILES[i][2], "x", PROJ_TILES[i][3], ")"),
                                         download[dtype](ctx, d.output, rows * c.v_dim), ref_out_stage) and ok
            else:
                print("  output stage: tile", i, "does not fit in shared memory, skipped")
        d.project_output(ctx, c, raw_buf, att_out, force_fma=True)
        ok = check_parity[dtype]("output stage (FMA path)", download[dtype](ctx, d.output, rows * c.v_dim), ref_out_stage) and ok
    ctx.enqueue_memset(att_out, Scalar[dtype](0))
    d.project_output(ctx, c, raw_buf, att_out)
    var gpu_out_stage = download[dtype](ctx, d.output, rows * c.v_dim)
    ok = check_parity[dtype]("output stage", gpu_out_stage, ref_out_stage) and ok
    # The attention output the op stores on request: raw as dtype, exactly.
    ok = check_close("attention output store", download[dtype](ctx, att_out, rows * c.rank), gpu_raw, 0) and ok

    # The whole op on fresh inputs against the CPU pipeline.
    var d2 = DeviceCase[dtype](ctx, c)
    d2.run_op(ctx, c)
    var out = download[dtype](ctx, d2.output, rows * c.v_dim)
    var blocks_after = download[dtype](ctx, d2.blocks, len(c.blocks))
    var ref_raw = c.cpu_attention[dtype](ref_q_full, ref_blocks)
    var ref_out = c.cpu_output(ref_raw)
    for i in range(len(ref_out)):
        ref_out[i] = round_to[dtype](ref_out[i])
    comptime if dtype == DType.float32:
        ok = check_parity[dtype]("op output", out, ref_out) and ok
    else:
        # End to end, step 6 re-quantizes an attention output that differs by the rounding of
        # the probabilities: pymla/parity.py's end-to-end element bound (2 ulp + 2^-5).
        ok = check_close("op output (end to end)", out, ref_out, 2 * ulp_of[dtype]() + Float32(2.0) ** -5) and ok
    ok = check_cache[dtype](c, blocks_after, ref_blocks) and ok
    _ = q_full_buf^
    _ = raw_buf^
    _ = att_out^
    return ok


def ints(*values: Int) -> List[Int]:
    var out = List[Int]()
    for v in values:
        out.append(v)
    return out^


def correctness(ctx: DeviceContext) raises -> Bool:
    var ok = True
    ok = run_case[DType.bfloat16](ctx, "decode bf16", Case.__init__[DType.bfloat16](1, 16, ints(130, 1, 0, 64), ints(1, 4, 2, 1))) and ok
    ok = run_case[DType.float32](ctx, "decode f32", Case.__init__[DType.float32](2, 16, ints(130, 1, 0, 64), ints(1, 4, 2, 1))) and ok
    ok = run_case[DType.float16](ctx, "decode f16 page 1", Case.__init__[DType.float16](3, 8, ints(40, 7), ints(2, 1), page_size=1)) and ok
    ok = run_case[DType.bfloat16](ctx, "zero-token request", Case.__init__[DType.bfloat16](4, 16, ints(12, 50, 7), ints(2, 0, 1))) and ok
    ok = run_case[DType.bfloat16](
        ctx, "alibi, 3 heads, null mask", Case.__init__[DType.bfloat16](5, 3, ints(20, 33), ints(3, 1), mask_kind=0, score_mod=1)
    ) and ok
    ok = run_case[DType.float32](
        ctx, "sliding window", Case.__init__[DType.float32](6, 16, ints(100, 5), ints(2, 3), mask_kind=2, window=17)
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, "chunked, per_tensor", Case.__init__[DType.bfloat16](7, 20, ints(70, 9), ints(4, 2), mask_kind=3, window=32, gm=0, gn=0, gk=0)
    ) and ok
    ok = run_case[DType.float32](
        ctx, "per_channel, small dims",
        Case.__init__[DType.float32](8, 4, ints(10, 31), ints(1, 2), rank=256, nope=64, rope=32, v_dim=64, gm=1, gn=1, gk=0),
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, "odd blocks (3, 20, 24)", Case.__init__[DType.bfloat16](9, 6, ints(25, 3), ints(5, 2), gm=3, gn=20, gk=24)
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, "long context", Case.__init__[DType.bfloat16](10, 16, ints(4000), ints(2), page_size=64)
    ) and ok
    ok = run_case[DType.bfloat16](
        ctx, "128 heads", Case.__init__[DType.bfloat16](11, 128, ints(300, 17), ints(1, 2), page_size=64)
    ) and ok
    # Small dims on tensor cores: per-channel K blocks of 64 (q) and 256 (output: two float32x4
    # slots per lane and item in `stage_activations`).
    ok = run_case[DType.bfloat16](
        ctx, "per_channel, small dims, bf16",
        Case.__init__[DType.bfloat16](13, 4, ints(10, 31), ints(1, 2), rank=256, nope=64, rope=32, v_dim=64, gm=1, gn=1, gk=0),
    ) and ok
    # Several row tiles of every projection tile shape (73 tokens), f16, per-channel scales.
    ok = run_case[DType.float16](
        ctx, "73 tokens, per_channel", Case.__init__[DType.float16](12, 4, ints(5, 60, 0), ints(33, 40, 0), gm=1, gn=1, gk=0)
    ) and ok
    return ok


def bench_copy(ctx: DeviceContext, iters: Int) raises:
    """The device-to-device copy rate (bytes read + written per second): the HBM yardstick."""
    comptime N = 1 << 28  # 1 GiB of float32
    var src = ctx.enqueue_create_buffer[DType.float32](N)
    var dst = ctx.enqueue_create_buffer[DType.float32](N)
    ctx.enqueue_memset(src, Float32(1))
    ctx.enqueue_copy(dst_buf=dst, src_buf=src)
    ctx.synchronize()
    var t0 = perf_counter_ns()
    for _ in range(iters):
        ctx.enqueue_copy(dst_buf=dst, src_buf=src)
    ctx.synchronize()
    var s = Float64(perf_counter_ns() - t0) / 1e9 / Float64(iters)
    print("copy", 2.0 * Float64(N * 4) / s / 1e9, "GB/s (bytes read + written, 1 GiB device-to-device)")


def bench[dtype: DType](ctx: DeviceContext, batch: Int, heads: Int, cache_len: Int, iters: Int) raises:
    """Times the whole op on a DeepSeek-sized decode step (one new token per request)."""
    var lengths = List[Int]()
    var news = List[Int]()
    for _ in range(batch):
        lengths.append(cache_len)
        news.append(1)
    # Random inputs without the CPU reference (large).
    var c = Case.__init__[dtype](99, heads, lengths, news, page_size=64, num_layers=1, layer=0)
    var d = DeviceCase[dtype](ctx, c)
    d.run_op(ctx, c)
    ctx.synchronize()
    var t0 = perf_counter_ns()
    for _ in range(iters):
        d.run_op(ctx, c)
    ctx.synchronize()
    var us = Float64(perf_counter_ns() - t0) / Float64(iters) / 1000.0
    var cache_bytes = Float64(batch * (cache_len + 1) * c.key_dim * size_of[dtype]())
    var weight_bytes = Float64(len(c.w_uk.bytes) + len(c.w_uv.bytes))
    var flops = 2.0 * Float64(batch * heads) * Float64(cache_len + 1) * Float64(c.key_dim + c.rank)
    print(
        "bench", dtype, "B", batch, "H", heads, "L", cache_len + 1, ":", us, "us per call,",
        (cache_bytes + weight_bytes) / us / 1e3, "GB/s of cache+weights,", flops / us / 1e6, "TFLOP/s attention",
    )


def bench_attention[
    dtype: DType, groups: Int, kt: Int, gw: Int = 4
](
    ctx: DeviceContext, c: Case, d: DeviceCase[dtype], q_full: DeviceBuffer[DType.float32],
    raw: DeviceBuffer[DType.float32], iters: Int, expected: List[Float32],
) raises:
    """Times step 5 alone with the tensor-core kernel pinned to `groups` x `kt` (0 = the op's choice)."""
    var t0 = 0
    for it in range(iters + 1):  # the first run is a warm-up
        if it == 1:
            ctx.synchronize()
            t0 = perf_counter_ns()
        d.attention[groups, kt, gw](ctx, c, q_full, raw, 0)
    ctx.synchronize()
    var us = Float64(perf_counter_ns() - t0) / Float64(iters) / 1000.0
    var cache_bytes = Float64(c.num_requests * (Int(c.lengths[0]) + 1) * c.key_dim * size_of[dtype]())
    var line = String(
        "  attention groups ", groups, " kt ", kt, " warps/group ", gw, " : ", us, " us, ", cache_bytes / us / 1e3,
        " GB/s of cache",
    )
    if len(expected) > 0:  # a pinned variant: compared with the op's own kernel
        var got = download[DType.float32](ctx, raw, c.num_tokens * c.heads * c.rank)
        var diff = Float32(0)
        var top = Float32(0)
        for i in range(len(got)):
            diff = max(diff, abs(got[i] - expected[i]))
            top = max(top, abs(expected[i]))
        line += String("; max |diff| vs the op's kernel ", diff / top, " x max|raw|")
    print(line)


def bench_variants[dtype: DType](ctx: DeviceContext, batch: Int, heads: Int, cache_len: Int, iters: Int) raises:
    """Step 5 alone, the op's choice and pinned tensor-core variants, on one decode step."""
    var lengths = List[Int]()
    var news = List[Int]()
    for _ in range(batch):
        lengths.append(cache_len)
        news.append(1)
    var c = Case.__init__[dtype](99, heads, lengths, news, page_size=64, num_layers=1, layer=0)
    var d = DeviceCase[dtype](ctx, c)
    var rows = c.num_tokens * c.heads
    var q_host = List[Float32]()
    var rng = Rng(5)
    for _ in range(rows * c.key_dim):
        q_host.append(rng.normal())
    var q_full = upload[DType.float32](ctx, q_host)
    var raw = ctx.enqueue_create_buffer[DType.float32](rows * c.rank)
    print("variants B", batch, "H", heads, "L", cache_len + 1)
    bench_attention[dtype, 0, 0](ctx, c, d, q_full, raw, iters, List[Float32]())  # the op's choice
    var expected = download[DType.float32](ctx, raw, rows * c.rank)
    # (groups, kt, warps per group): a launch that asks for too many registers is reported, not fatal.
    comptime VARIANTS = [(1, 32, 4), (2, 32, 4), (2, 64, 4), (1, 32, 8), (1, 64, 8), (4, 32, 0), (4, 64, 0)]
    comptime for v in VARIANTS:
        try:
            bench_attention[dtype, v[0], v[1], v[2]](ctx, c, d, q_full, raw, iters, expected)
        except e:
            print("  attention groups", v[0], "kt", v[1], "warps/group", v[2], ": launch failed:", e)


def time_us(ctx: DeviceContext, start: Int) raises -> Float64:
    ctx.synchronize()
    return Float64(perf_counter_ns() - start) / 1000.0


def bench_proj_tile[
    dtype: DType, tile: Tuple[Int, Int, Int, Int]
](
    ctx: DeviceContext, c: Case, d: DeviceCase[dtype], q_full: DeviceBuffer[DType.float32],
    raw: DeviceBuffer[DType.float32], att_out: DeviceBuffer[dtype], iters: Int, force_fma: Bool = False,
) raises:
    """Times steps 1-4 on q (`gpu_build_q_full`) and step 6 (`gpu_project_output`) alone, `tile` pinned."""
    d.build_q_full[tile](ctx, c, q_full, force_fma=force_fma)
    ctx.synchronize()
    var t0 = perf_counter_ns()
    for _ in range(iters):
        d.build_q_full[tile](ctx, c, q_full, force_fma=force_fma)
    var q_us = time_us(ctx, t0) / Float64(iters)
    d.project_output[tile](ctx, c, raw, att_out, force_fma=force_fma)
    ctx.synchronize()
    t0 = perf_counter_ns()
    for _ in range(iters):
        d.project_output[tile](ctx, c, raw, att_out, force_fma=force_fma)
    var o_us = time_us(ctx, t0) / Float64(iters)
    var name = String("FMA path") if force_fma else (String("op's choice") if tile[0] == 0 else String("tile ", tile[0], "x", tile[1], "x", tile[2], "x", tile[3]))
    print("  ", name, ": q_full", q_us, "us, output (+attention output)", o_us, "us")


def bench_proj[dtype: DType](ctx: DeviceContext, batch: Int, heads: Int, iters: Int) raises:
    """Steps 1-4 on q and step 6 alone on one decode step (one token per request), every tile shape."""
    var lengths = List[Int]()
    var news = List[Int]()
    for _ in range(batch):
        lengths.append(15)
        news.append(1)
    var c = Case.__init__[dtype](99, heads, lengths, news, page_size=64, num_layers=1, layer=0)
    var d = DeviceCase[dtype](ctx, c)
    var rows = c.num_tokens * c.heads
    var q_full = ctx.enqueue_create_buffer[DType.float32](rows * c.key_dim)
    var raw_host = List[Float32]()
    var rng = Rng(7)
    for _ in range(rows * c.rank):
        raw_host.append(round_to[dtype](rng.normal()))
    var raw = upload[DType.float32](ctx, raw_host)
    var att_out = ctx.enqueue_create_buffer[dtype](rows * c.rank)
    print("proj B", batch, "H", heads, "(time per call, launch included)")
    bench_proj_tile[dtype, NO_TILE](ctx, c, d, q_full, raw, att_out, iters)
    comptime for i in range(len(PROJ_TILES)):
        bench_proj_tile[dtype, PROJ_TILES[i]](ctx, c, d, q_full, raw, att_out, iters)
    bench_proj_tile[dtype, NO_TILE](ctx, c, d, q_full, raw, att_out, iters, force_fma=True)


def main() raises:
    comptime if not has_accelerator():
        print("gpu_smoke: no GPU in this build (compile with --target-accelerator=sm_90 on a GPU machine)")
        return
    else:
        var ctx = DeviceContext()
        var args = argv()
        var mode = String(args[1]) if len(args) > 1 else String("")
        var ok = True
        if mode != "bench-only" and mode != "variants" and mode != "proj":
            ok = correctness(ctx)
        if mode == "proj":
            for i in range(2, len(args)):
                var f = String(args[i]).split(":")
                bench_proj[DType.bfloat16](ctx, Int(f[0]), Int(f[1]), Int(f[3]) if len(f) > 3 else 50)
        if mode == "variants":
            for i in range(2, len(args)):
                var f = String(args[i]).split(":")
                bench_variants[DType.bfloat16](ctx, Int(f[0]), Int(f[1]), Int(f[2]), Int(f[3]) if len(f) > 3 else 10)
        if mode == "bench" or mode == "bench-only":
            bench_copy(ctx, 10)
            if len(args) > 2:
                # Configurations BATCH:HEADS:CACHE_LEN[:ITERS], e.g. 64:128:8191:5
                for i in range(2, len(args)):
                    var f = String(args[i]).split(":")
                    var iters = Int(f[3]) if len(f) > 3 else 10
                    bench[DType.bfloat16](ctx, Int(f[0]), Int(f[1]), Int(f[2]), iters)
            else:
                bench[DType.bfloat16](ctx, 64, 16, 4095, 20)
                bench[DType.bfloat16](ctx, 64, 128, 4095, 5)
                bench[DType.bfloat16](ctx, 1, 128, 32767, 20)
                bench[DType.bfloat16](ctx, 256, 16, 1023, 20)
        print("ALL PASS" if ok else "SOME CHECKS FAILED")
        if not ok:
            raise Error("gpu_smoke failed")
