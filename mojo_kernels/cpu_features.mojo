"""`pymla.compiled_cpu_features`: the CPU features the op's kernels were compiled with.

MAX compiles the op for a target CPU (the host's as LLVM names it, or the one
set with `max.driver.set_virtual_cpu_target`). On some virtual machines that
name lacks features the CPU has (an Intel Xeon guest whose CPUID model is
taken for `rocketlake`, without AVX512-BF16 or AMX), so the CPU code paths
the op really has are read from a kernel compiled the same way: this op,
whose `features[i]` is 1 when feature `i` of `pymla.cpu_paths.FEATURES` is
compiled in. It runs once per process, and only when a path is forced or
listed (`pymla.cpu_paths.kernel_cpu_paths`).
"""

import extensibility
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext
from std.sys.info import CompilationTarget


@extensibility.register("pymla.compiled_cpu_features")
struct CompiledCpuFeatures:
    """Writes `features [3]`: avx512bf16, amx-tile, amx-bf16 (1 = compiled in)."""

    @staticmethod
    def execute[
        target: StaticString,
    ](features: MutableInputTensor[dtype=DType.uint8, rank=1, static_spec=...], ctx: DeviceContext) raises:
        comptime assert target == "cpu", "pymla.compiled_cpu_features runs on the CPU"
        comptime flags = (
            CompilationTarget._has_feature["avx512bf16"](),
            CompilationTarget._has_feature["amx-tile"](),
            CompilationTarget._has_feature["amx-bf16"](),
        )
        if features.dim_size(0) != 3:
            raise Error("pymla.compiled_cpu_features: expected features of shape [3]")
        var out = features.unsafe_ptr()
        comptime for i in range(3):
            out.unsafe_store(i, UInt8(1) if flags[i] else UInt8(0))
