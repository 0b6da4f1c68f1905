# AMX unit microbenchmark: ns per tile op, one thread and every core.
from std.time import perf_counter_ns
from std.sys import num_physical_cores
from std.memory import alloc
from max.algorithm import sync_parallelize
from mojo_kernels.cpu.amx import AmxTiles, amx_permitted, ACC, LEFT, RIGHT, BytePtr

comptime N = 20000

def dots_indep(buf: BytePtr) -> Float64:
    var u = AmxTiles()
    u.start()
    u.load[LEFT](buf, 64)
    u.load[RIGHT](buf, 64)
    var t0 = perf_counter_ns()
    for _ in range(N):
        u.dot[0, LEFT, RIGHT]()
        u.dot[1, LEFT, RIGHT]()
        u.dot[2, LEFT, RIGHT]()
        u.dot[3, LEFT, RIGHT]()
    var t1 = perf_counter_ns()
    u.stop()
    return Float64(t1 - t0) / Float64(4 * N)

def dots_chain(buf: BytePtr) -> Float64:
    var u = AmxTiles()
    u.start()
    u.load[LEFT](buf, 64)
    u.load[RIGHT](buf, 64)
    var t0 = perf_counter_ns()
    for _ in range(N):
        u.dot[0, LEFT, RIGHT]()
    var t1 = perf_counter_ns()
    u.stop()
    return Float64(t1 - t0) / Float64(N)

def load_l1(buf: BytePtr) -> Float64:
    var u = AmxTiles()
    u.start()
    var t0 = perf_counter_ns()
    for _ in range(N):
        u.load[4](buf, 64)
        u.load[5](buf, 64)
        u.load[6](buf, 64)
        u.load[7](buf, 64)
    var t1 = perf_counter_ns()
    u.stop()
    return Float64(t1 - t0) / Float64(4 * N)

def load_dot_l2(buf: BytePtr) -> Float64:
    # 64 key rows of 1152 bytes (74 KB, L2): per step a tile of 16 rows x 64 bytes, like step 5's K tiles.
    var u = AmxTiles()
    u.start()
    u.load[RIGHT](buf, 64)
    var t0 = perf_counter_ns()
    var n = 0
    for i in range(N // 4):
        for s in range(18):
            u.load[4](buf + (i % 4) * 16 * 1152 + s * 64, 1152)
            u.dot[0, 4, RIGHT]()
            u.load[5](buf + ((i + 1) % 4) * 16 * 1152 + s * 64, 1152)
            u.dot[1, 5, RIGHT]()
            n += 2
    var t1 = perf_counter_ns()
    u.stop()
    return Float64(t1 - t0) / Float64(n)

def main() raises:
    _ = amx_permitted()
    var cores = num_physical_cores()
    var bufs = alloc[UInt8](cores * 4 * 16 * 1152 + 4096)
    for i in range(cores * 4 * 16 * 1152):
        bufs[i] = UInt8(i % 7)
    print("1 thread: indep dot", dots_indep(bufs), "ns; chained dot", dots_chain(bufs), "ns; L1 tileload", load_l1(bufs), "ns; L2 strided load+dot", load_dot_l2(bufs), "ns")
    var res = alloc[Float64](cores * 4)
    def task(i: Int) {var res, var bufs}:
        var b = bufs + i * 4 * 16 * 1152
        res[4 * i] = dots_indep(b)
        res[4 * i + 1] = dots_chain(b)
        res[4 * i + 2] = load_l1(b)
        res[4 * i + 3] = load_dot_l2(b)
    sync_parallelize(task, cores)
    var s = List[Float64](length=4, fill=0)
    for i in range(cores):
        for j in range(4):
            s[j] += res[4 * i + j] / Float64(cores)
    print(cores, "threads (mean): indep dot", s[0], "ns; chained", s[1], "ns; L1 tileload", s[2], "ns; L2 strided load+dot", s[3], "ns")
