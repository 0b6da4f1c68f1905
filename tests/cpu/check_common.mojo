# Tile units and helpers shared by the CPU checks (tests/cpu/amx_check.mojo, projection_check.mojo):
# the AMX instructions emulated in plain loops (layouts checked on any CPU), two timing-only units,
# a small random generator, and whether this CPU runs AMX.

from std.ffi import external_call
from std.sys import size_of

from mojo_kernels.cpu.amx import HAS_AMX, AmxTiles, BytePtr, TileUnit


struct EmulatedTiles(TileUnit):
    """The AMX instructions of `TileUnit` in plain loops over eight 1 KiB registers (16 rows x 64 bytes).

    `tdpbf16ps` as the Intel SDM writes it: per row `m`, column `n` and pair
    `p`, the float32 accumulator adds `a[m, 2p] b[p, 2n]`, then `a[m, 2p+1] b[p, 2n+1]`.
    """

    var regs: List[UInt8]
    var started: Bool

    def __init__(out self):
        self.regs = List[UInt8](length=8 * 1024, fill=0)
        self.started = False

    def reg(mut self, t: Int) -> BytePtr:
        if not self.started:
            print("EmulatedTiles: tile instruction before ldtilecfg")
        return self.regs.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_offset(t * 1024)

    def start(mut self):
        self.started = True

    def load[t: Int](mut self, src: BytePtr, stride: Int):
        var r = self.reg(t)
        for m in range(16):
            for i in range(64):
                r.unsafe_store(m * 64 + i, src.unsafe_load(m * stride + i))

    def store[t: Int](mut self, dst: BytePtr, stride: Int):
        var r = self.reg(t)
        for m in range(16):
            for i in range(64):
                dst.unsafe_store(m * stride + i, r.unsafe_load(m * 64 + i))

    def zero[t: Int](mut self):
        var r = self.reg(t)
        for i in range(1024):
            r.unsafe_store(i, 0)

    def dot[c: Int, a: Int, b: Int](mut self):
        var cf = self.reg(c).unsafe_bitcast[Float32]()
        var ab = self.reg(a).unsafe_bitcast[BFloat16]()
        var bb = self.reg(b).unsafe_bitcast[BFloat16]()
        for m in range(16):
            for n in range(16):
                var acc = cf.unsafe_load(m * 16 + n)
                for p in range(16):
                    acc += ab.unsafe_load(m * 32 + 2 * p).cast[DType.float32]() * bb.unsafe_load(
                        p * 32 + 2 * n
                    ).cast[DType.float32]()
                    acc += ab.unsafe_load(m * 32 + 2 * p + 1).cast[DType.float32]() * bb.unsafe_load(
                        p * 32 + 2 * n + 1
                    ).cast[DType.float32]()
                cf.unsafe_store(m * 16 + n, acc)

    def stop(mut self):
        self.started = False


struct AmxWithoutDots(TileUnit):
    """The AMX unit with `tdpbf16ps` left out (loads, stores, zeros only): timings only."""

    var unit: AmxTiles

    def __init__(out self):
        self.unit = AmxTiles()

    def start(mut self):
        self.unit.start()

    def load[t: Int](mut self, src: BytePtr, stride: Int):
        self.unit.load[t](src, stride)

    def store[t: Int](mut self, dst: BytePtr, stride: Int):
        self.unit.store[t](dst, stride)

    def zero[t: Int](mut self):
        self.unit.zero[t]()

    def dot[c: Int, a: Int, b: Int](mut self):
        pass

    def stop(mut self):
        self.unit.stop()


struct NoTiles(TileUnit):
    """No tile instruction at all: what the AMX path costs besides the unit. Timings only."""

    def __init__(out self):
        pass

    def start(mut self):
        pass

    def load[t: Int](mut self, src: BytePtr, stride: Int):
        pass

    def store[t: Int](mut self, dst: BytePtr, stride: Int):
        pass

    def zero[t: Int](mut self):
        pass

    def dot[c: Int, a: Int, b: Int](mut self):
        pass

    def stop(mut self):
        pass


struct Rng(Movable):
    var state: UInt64

    def __init__(out self, seed: Int):
        self.state = UInt64(seed) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019

    def next(mut self) -> UInt64:
        self.state = self.state * 6364136223846793005 + 1442695040888963407
        return self.state >> 33

    def uniform(mut self) -> Float32:
        """Uniform in [-1, 1)."""
        return Float32(Int(self.next() % 65536)) / 32768.0 - 1.0

    def below(mut self, n: Int) -> Int:
        return Int(self.next() % UInt64(n))


def cpu_has_amx() -> Bool:
    """CPUID leaf 7: EDX bit 24 (AMX-TILE) and bit 22 (AMX-BF16), read from /proc/cpuinfo's flags."""
    try:
        with open("/proc/cpuinfo", "r") as f:
            var text = f.read()
            return " amx_tile" in text and " amx_bf16" in text
    except:
        return False


def huge_page_list[dtype: DType](length: Int) -> List[Scalar[dtype]]:
    """`length` zeros on 2 MiB pages where Linux allows, as the op's CPU caches are
    (`pymla/host_memory.py`): the memory advised (`madvise(MADV_HUGEPAGE)`) before it is touched."""
    var values = List[Scalar[dtype]](unsafe_uninit_length=length)
    comptime HUGE = 2 << 20
    var address = Int(values.unsafe_ptr())
    var start = (address + HUGE - 1) // HUGE * HUGE
    var end = (address + length * size_of[dtype]()) // HUGE * HUGE
    if end > start:
        _ = external_call["madvise", Int32](start, end - start, Int32(14))  # MADV_HUGEPAGE; best effort
    for i in range(length):
        values[i] = 0
    return values^


def cpu_model() -> String:
    """The first `model name` of /proc/cpuinfo (what every benchmark prints), or "unknown"."""
    try:
        with open("/proc/cpuinfo", "r") as f:
            for line in f.read().split("\n"):
                if line.startswith("model name"):
                    return String(line.split(":", 1)[1].strip())
    except:
        pass
    return "unknown"


def amx_runs() -> Bool:
    return HAS_AMX and cpu_has_amx()
