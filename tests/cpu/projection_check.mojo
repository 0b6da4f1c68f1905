# Steps 3 and 6 on AMX tiles (mojo_kernels/cpu/amx_matmul.mojo) and on the AVX512-BF16 unit (the
# bf16 dots of cpu/fp8_matmul.mojo) against the float32 fp8 matmul (cpu/fp8_matmul.mojo, tested
# against the torch reference by tests/test_op_parity.py); run from tests/cpu/amx_check.mojo.
#
# Checks: random bf16 activations and e4m3 weight bytes, random block scales, for per_tensor,
# per_channel, blockwise and arbitrary (m, n, k) blocks (k blocks of 16, 40, 100, larger than K),
# several (tokens, heads, N, K) with tails (tokens 1..33: one to three 16-token blocks; N and K not
# multiples of 16 or 32), strided activations and outputs like the op's. The tile path runs on
# `EmulatedTiles` everywhere and on the unit where the CPU has AMX, with float32 outputs (NaN before
# the call); the bf16 dots where compiled in: every output within TOLERANCE of the float32 path relative to sum |terms| (the same
# exact products summed in another order), and the gaps between output rows unchanged.
# Timings: steps 3 and 6 alone (pipeline.project_q_nope / project_output, DeepSeek-V3 dims, bf16,
# blockwise weights distributed as quantized model weights: `model_weight_byte`) per path, batch 8 at 16 and 128 heads and batch 1 at 128 heads, with the
# thread count and the largest difference between the paths' bf16 outputs; also the tile matmul
# with no tile instruction (`NoTiles`, wrong results: what it costs besides the unit, on any CPU).

from std.memory import bitcast
from std.sys import num_physical_cores
from std.time import perf_counter_ns

from mojo_kernels.common import DPtr, FPtr, U8Ptr
from mojo_kernels.cpu.amx import AmxTiles, TileUnit
from mojo_kernels.cpu.amx_matmul import NoPrologue, fp8_projection, projection_on_amx
from mojo_kernels.cpu.attention import PATH_AMX, PATH_AVX512BF16, PATH_F32
from mojo_kernels.cpu.bf16 import HAS_AVX512_BF16
from mojo_kernels.cpu.fp8_matmul import StridedMatrices
from mojo_kernels.fp8 import DIVISOR_EXACT_FROM, FP8_MAX, Divisor, activation_scale, e4m3_bytes, into_e4m3_range, round_to_e4m3
from mojo_kernels.cpu.pipeline import project_output, project_q_nope
from mojo_kernels.spec import BlockShape, Granularity

from check_common import EmulatedTiles, NoTiles, Rng, amx_runs

comptime TOLERANCE: Float32 = 1.0 / 4096
"""Largest |tiles - f32| / sum |terms| per output: reordered float32 sums of at most a few hundred
exact products are off by a few ulps (2^-24); a product missed, doubled or misplaced is off by more
than 1/K of the sum."""
comptime GAP = 3
"""Extra elements after each row of the activations and outputs (the op's rows are strided)."""
comptime SENTINEL: Float32 = 12345.0

comptime BF16 = DType.bfloat16
comptime F32 = DType.float32


def untracked[dtype: DType](mut buffer: List[Scalar[dtype]]) -> DPtr[dtype]:
    return buffer.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()


struct Projection(Movable):
    """One fp8 batched matmul's inputs: `a [M, G, K + GAP]` bf16 (token-major, like the op's q),
    `w [G, N, K]` e4m3 bytes, `w_scale [G, NB, KB]`, blocks `(bm, bn, bk)` (0: the whole axis)."""

    var a: List[BFloat16]
    var w: List[UInt8]
    var w_scale: List[Float32]
    var tokens: Int
    var heads: Int
    var n_out: Int
    var depth: Int
    var blocks: BlockShape
    var name: String

    def __init__(out self, seed: Int, tokens: Int, heads: Int, n_out: Int, depth: Int, bm: Int, bn: Int, bk: Int):
        var rng = Rng(seed)
        self.tokens = tokens
        self.heads = heads
        self.n_out = n_out
        self.depth = depth
        self.blocks = Granularity(bm, bn, bk).resolve(tokens, n_out, depth)
        self.a = List[BFloat16](length=max(tokens * heads * (depth + GAP), 1), fill=0)
        for i in range(len(self.a)):
            # magnitudes spread over 2^-6 .. 2^2 so that quantization uses the whole e4m3 range
            self.a[i] = (rng.uniform() * Float32(1 << rng.below(9)) / 64).cast[BF16]()
        self.w = List[UInt8](length=heads * n_out * depth, fill=0)
        for i in range(len(self.w)):
            self.w[i] = UInt8(rng.next() % 256) & 0xF7  # never 0x7F / 0xFF (NaN)
        var scales = heads * ((n_out + self.blocks.n - 1) // self.blocks.n) * ((depth + self.blocks.k - 1) // self.blocks.k)
        self.w_scale = List[Float32](length=scales, fill=0)
        for i in range(scales):
            self.w_scale[i] = (1.5 + rng.uniform()) * 0.01
        self.name = String("T=", tokens, " H=", heads, " N=", n_out, " K=", depth, " blocks=", bm, "/", bn, "/", bk)

    def activations(mut self) -> StridedMatrices[BF16]:
        return StridedMatrices[BF16](untracked(self.a), self.depth + GAP, self.heads * (self.depth + GAP))

    def run[tiles: TileUnit](mut self, on_tiles: Bool, bf16_dots: Bool = False) raises -> List[Float32]:
        """`c [M, G, N + GAP]` in float32: NaN before the call, SENTINEL in the gaps."""
        var c = List[Float32](length=max(self.tokens * self.heads * (self.n_out + GAP), 1), fill=Float32.MAX * 0 / 0)
        for i in range(len(c)):
            if i % (self.n_out + GAP) >= self.n_out:
                c[i] = SENTINEL
        var out = StridedMatrices[F32](untracked(c), self.n_out + GAP, self.heads * (self.n_out + GAP))
        var w = self.w.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var ws = untracked(self.w_scale)
        var a = self.activations()
        fp8_projection[BF16, F32, tiles](
            a, w, ws, out, self.heads, self.tokens, self.n_out, self.depth, self.blocks, on_tiles, bf16_dots, NoPrologue()
        )
        return c^

    def magnitudes(mut self) raises -> List[Float32]:
        """`sum |terms|` per output: the float32 path on |a| and |w| (|a| quantizes to |a_q|, scales > 0)."""
        var a = self.a.copy()
        var w = self.w.copy()
        for i in range(len(self.a)):
            self.a[i] = abs(self.a[i])
        for i in range(len(self.w)):
            self.w[i] = self.w[i] & 0x7F
        var mags = self.run[AmxTiles](False)
        self.a = a^
        self.w = w^
        return mags^


def compare(mut p: Projection, path_name: String, got: List[Float32], expected: List[Float32], mags: List[Float32], mut failures: Int):
    var worst = Float32(0)
    var gaps_ok = True
    for i in range(len(got)):
        if i % (p.n_out + GAP) >= p.n_out:
            gaps_ok = gaps_ok and got[i] == SENTINEL
            continue
        var rel = abs(got[i] - expected[i]) / max(mags[i], Float32(1e-30))
        if not (rel <= worst):  # NaN counts as the worst
            worst = rel if rel == rel else Float32.MAX
    var ok = worst <= TOLERANCE and gaps_ok
    if not ok:
        failures += 1
    print("PASS" if ok else "FAIL", path_name, "projection max|err|/sum|terms|", worst, "gaps", "kept" if gaps_ok else "CHANGED", p.name)


def check_projections(mut failures: Int) raises:
    """Every case on the emulated tiles, on the AVX512-BF16 unit where compiled in, and on the AMX unit
    where the CPU has it."""
    # (tokens, heads, N, K, bm, bn, bk): the op's shapes with blockwise scales, then tails and other blocks.
    comptime FIELDS = 7
    var cases: List[Int] = [
        8, 3, 512, 128, 1, 128, 128,  # step 3 (w_uk), blockwise
        8, 2, 128, 512, 1, 128, 128,  # step 6 (w_uv), blockwise: 4 K blocks
        5, 3, 100, 70, 0, 0, 0,  # per_tensor, N and K tails
        17, 2, 130, 200, 1, 1, 0,  # per_channel, two token blocks, K = 6 x 32 + 8
        33, 2, 70, 96, 4, 24, 40,  # three token blocks, K blocks of 40 (two steps, zeros past 40)
        1, 3, 64, 128, 2, 48, 16,  # K blocks of 16 (half a step)
        20, 1, 33, 300, 7, 5, 100,  # K blocks of 100; N blocks of 5
        3, 2, 40, 50, 8, 64, 64,  # blocks larger than the axes
        16, 2, 200, 128, 16, 128, 128,  # 16-token blocks; tiles: slices of 64 rows and a tail slice
        2, 2, 600, 128, 1, 128, 128,  # vectors: slices of 256 rows and a tail slice (K 128)
    ]
    for i in range(len(cases) // FIELDS):
        var f = i * FIELDS
        var p = Projection(
            100 + i, cases[f], cases[f + 1], cases[f + 2], cases[f + 3], cases[f + 4], cases[f + 5], cases[f + 6]
        )
        var expected = p.run[AmxTiles](False)
        var mags = p.magnitudes()
        compare(p, "amx-emulated", p.run[EmulatedTiles](True), expected, mags, failures)
        comptime if HAS_AVX512_BF16:
            compare(p, "avx512bf16", p.run[AmxTiles](False, bf16_dots=True), expected, mags, failures)
        if amx_runs():
            compare(p, "amx", p.run[AmxTiles](True), expected, mags, failures)


def check_divisor(mut failures: Int):
    """`fp8.Divisor` (the GPU quantizations' division) against `x / d` on this CPU (IEEE fused
    multiply-adds, as on the GPU): for the scale of an amax in every float32 exponent field (0: zero and
    subnormals; a hashed mantissa), every bfloat16 `x` with `|x| <= 448 d`: the e4m3 bytes, and the
    float32 quotients from 2^-12 up. (tests/gpu/gpu_smoke.mojo runs the same on the GPU.)"""
    var checked = 0
    var differ = 0
    for e in range(255):
        var m = ((UInt32(e) * 2654435761) >> 9) & 0x007FFFFF
        var d = activation_scale(bitcast[DType.float32]((UInt32(e) << 23) | m))
        var div = Divisor.of(d)
        for b in range(65536):
            var x = bitcast[DType.bfloat16](UInt16(b)).cast[DType.float32]()
            if not (abs(x) <= FP8_MAX * d):
                continue
            var want = x / d
            var got = div.quotient[1](x)[0]
            var want8 = round_to_e4m3[1](into_e4m3_range[1](want))
            var got8 = round_to_e4m3[1](into_e4m3_range[1](got))
            var f32_differs = bitcast[DType.uint32](got) != bitcast[DType.uint32](want) and abs(want) >= DIVISOR_EXACT_FROM
            checked += 1
            if bitcast[DType.uint32](got8) != bitcast[DType.uint32](want8) or f32_differs:
                differ += 1
    var ok = differ == 0 and checked > 0
    if not ok:
        failures += 1
    print("PASS" if ok else "FAIL", "divisor: Divisor against x / d,", checked, "bfloat16 quotients over 255 scales,", differ, "differ")


def model_weight_byte(mut rng: Rng) -> UInt8:
    """An e4m3 weight as block quantization makes them: a roughly normal value (sum of four uniforms)
    whose block's largest magnitude (about 4.5 sigma) maps to 448, rounded to e4m3 (few subnormals)."""
    var x = (rng.uniform() + rng.uniform() + rng.uniform() + rng.uniform()) * Float32(0.866)  # sigma 1
    var v = SIMD[DType.float32, 1](max(min(x * 100.0, 448.0), -448.0))
    return e4m3_bytes[1](round_to_e4m3[1](v))[0]


struct ProjectionInputs(Movable):
    """Steps 3 and 6 at DeepSeek-V3 dims (nope 128, rope 64, rank 512, v_head 128), bf16, blockwise."""

    var q: List[BFloat16]  # [T, H, 192]
    var q_full: List[BFloat16]  # [T, H, 576]
    var raw: List[BFloat16]  # [T, H, 512]
    var output: List[BFloat16]  # [T, H, 128]
    var w_uk: List[UInt8]
    var w_uv: List[UInt8]
    var w_uk_scale: List[Float32]
    var w_uv_scale: List[Float32]
    var tokens: Int
    var heads: Int

    def __init__(out self, tokens: Int, heads: Int):
        var rng = Rng(tokens * 1000 + heads)
        self.tokens = tokens
        self.heads = heads
        self.q = List[BFloat16](length=tokens * heads * 192, fill=0)
        self.raw = List[BFloat16](length=tokens * heads * 512, fill=0)
        for i in range(len(self.q)):
            self.q[i] = rng.uniform().cast[BF16]()
        for i in range(len(self.raw)):
            self.raw[i] = rng.uniform().cast[BF16]()
        self.q_full = List[BFloat16](length=tokens * heads * 576, fill=0)
        self.output = List[BFloat16](length=tokens * heads * 128, fill=0)
        self.w_uk = List[UInt8](length=heads * 512 * 128, fill=0)
        self.w_uv = List[UInt8](length=heads * 128 * 512, fill=0)
        for i in range(len(self.w_uk)):
            self.w_uk[i] = model_weight_byte(rng)
            self.w_uv[i] = model_weight_byte(rng)
        self.w_uk_scale = List[Float32](length=heads * 4, fill=0.01)
        self.w_uv_scale = List[Float32](length=heads * 4, fill=0.01)

    def step3[T: TileUnit](mut self, path: Int, tiles_direct: Bool) raises:
        """Step 3 as the op runs it on `path`, or (`tiles_direct`) the tile matmul on unit `T`."""
        var w = self.w_uk.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var blocks = Granularity(1, 128, 128)
        if tiles_direct:
            var a = StridedMatrices[BF16](untracked(self.q), 192, self.heads * 192)
            var c = StridedMatrices[BF16](untracked(self.q_full), 576, self.heads * 576)
            fp8_projection[BF16, BF16, T](
                a, w, untracked(self.w_uk_scale), c, self.heads, self.tokens, 512, 128,
                blocks.resolve(self.tokens, 512, 128), True, False, NoPrologue(),
            )
            return
        project_q_nope[BF16](
            untracked(self.q), w, untracked(self.w_uk_scale), untracked(self.q_full), self.tokens, self.heads,
            128, 64, 512, blocks, path, NoPrologue(),
        )

    def step6[T: TileUnit](mut self, path: Int, tiles_direct: Bool) raises:
        """Step 6 as the op runs it on `path`, or (`tiles_direct`) the tile matmul on unit `T`."""
        var w = self.w_uv.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var blocks = Granularity(1, 128, 128)
        if tiles_direct:
            var a = StridedMatrices[BF16](untracked(self.raw), 512, self.heads * 512)
            var c = StridedMatrices[BF16](untracked(self.output), 128, self.heads * 128)
            fp8_projection[BF16, BF16, T](
                a, w, untracked(self.w_uv_scale), c, self.heads, self.tokens, 128, 512,
                blocks.resolve(self.tokens, 128, 512), True, False, NoPrologue(),
            )
            return
        project_output[BF16](
            untracked(self.raw), w, untracked(self.w_uv_scale), untracked(self.output), self.tokens, self.heads,
            512, 128, blocks, path, NoPrologue(),
        )

    def time[T: TileUnit = AmxTiles](mut self, path: Int, iters: Int, tiles_direct: Bool = False) raises -> Tuple[Float64, Float64]:
        """Best of `iters` calls of step 3, and of step 6 (after a warm-up call of each)."""
        var best3 = Float64(1e30)
        var best6 = Float64(1e30)
        for _ in range(iters + 1):
            var t0 = perf_counter_ns()
            self.step3[T](path, tiles_direct)
            var t1 = perf_counter_ns()
            self.step6[T](path, tiles_direct)
            var t2 = perf_counter_ns()
            best3 = min(best3, Float64(t1 - t0) / 1e6)
            best6 = min(best6, Float64(t2 - t1) / 1e6)
        return (best3, best6)


def bf16_diff(a: List[BFloat16], b: List[BFloat16]) -> Float32:
    """Largest `|a - b| / max(|a|, 1)`: a bf16 rounding flip is at most 2^-7 of it."""
    var worst = Float32(0)
    for i in range(len(a)):
        var d = abs(a[i].cast[F32]() - b[i].cast[F32]()) / max(abs(a[i].cast[F32]()), Float32(1))
        if not (d <= worst):
            worst = d if d == d else Float32.MAX
    return worst


def time_projections(iters: Int, mut failures: Int) raises:
    """One line per shape: steps 3 and 6 alone on each path the CPU runs, with the thread count."""
    var threads = num_physical_cores()
    var shapes: List[Int] = [8, 16, 8, 128, 1, 128, 2, 128, 4, 128, 4, 16, 16, 16, 16, 128, 64, 128]  # (tokens, heads)
    for i in range(len(shapes) // 2):
        var tokens = shapes[2 * i]
        var heads = shapes[2 * i + 1]
        var x = ProjectionInputs(tokens, heads)
        var f32 = x.time(PATH_F32, iters)
        # The f32 results, kept before the bare tile run below overwrites the outputs.
        var q_full = x.q_full.copy()
        var output = x.output.copy()
        var line = String("timing: steps 3 + 6 alone, batch ", tokens, ", heads ", heads, ", threads ", threads, ":")
        line += String(" f32 vectors ", f32[0], " + ", f32[1], " ms")
        comptime if HAS_AVX512_BF16:
            var bf16 = x.time(PATH_AVX512BF16, iters)
            var diff = max(bf16_diff(q_full, x.q_full), bf16_diff(output, x.output))
            line += String(", avx512bf16 dots ", bf16[0], " + ", bf16[1], " ms (max|diff|/max(|x|, 1) ", diff, ")")
            if not (diff <= Float32(1.0 / 128)):
                failures += 1
                line += " FAIL"
        # The tile matmul with no tile instruction (wrong results): quantize, pack, widen, scale, store.
        var bare = x.time[NoTiles](PATH_AMX, iters, tiles_direct=True)
        line += String(", tile path without tile instructions ", bare[0], " + ", bare[1], " ms")
        if amx_runs():
            # The tiles at every shape (the op's rule aside), so the lines show where they win.
            var amx = x.time(PATH_AMX, iters, tiles_direct=True)
            var diff = max(bf16_diff(q_full, x.q_full), bf16_diff(output, x.output))
            line += String(", amx tiles ", amx[0], " + ", amx[1], " ms (the op takes them: ")
            line += String(projection_on_amx(PATH_AMX, tokens), "; max|diff|/max(|x|, 1) ", diff, ")")
            if not (diff <= Float32(1.0 / 128)):
                failures += 1
                line += " FAIL"
        print(line)
