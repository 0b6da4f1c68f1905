# Offline check that the registered op compiles for the GPU (no GPU needed), once
# `MLADecodeBranchFP8.execute` dispatches `target == "gpu"` to `mla_decode_branch_fp8_gpu`:
#     mojo build --target-accelerator=sm_90 --emit asm -I . tests/gpu/compile_op_gpu.mojo -o /tmp/op_gpu/op.s
# It instantiates `execute` for target "gpu" (bf16, f16, f32, and bf16 with a uint8 fp8_ds_mla cache) and "cpu" (bf16, and bf16 with the fp8 cache) with placeholder
# tensors; the build writes one .ptx per kernel next to op.s (check them with
# `ptxas -arch=sm_90a -v FILE.ptx -o /dev/null`). The program itself is never run.

from std.sys import has_accelerator
from std.utils import IndexList

from extensibility import InputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from extensibility.managed_tensor_slice import _get_unknown_tensor_spec
from max.gpu.host import DeviceContext

from mojo_kernels.mla_decode_branch_fp8 import MLADecodeBranchFP8


def instantiate[dtype: DType, target: StaticString, cache_dtype: DType = dtype](ctx: DeviceContext) raises:
    var p = Pointer[Scalar[dtype], MutUntrackedOrigin](unsafe_from_address=256)
    var u = Pointer[UInt32, MutUntrackedOrigin](unsafe_from_address=256)
    var b = Pointer[UInt8, MutUntrackedOrigin](unsafe_from_address=256)
    var c = Pointer[Scalar[cache_dtype], MutUntrackedOrigin](unsafe_from_address=256)
    var row = 576 if cache_dtype == dtype else 656  # fp8_ds_mla rows: 512 + 4 * 4 + 2 * 64 bytes
    var f = Pointer[Float32, MutUntrackedOrigin](unsafe_from_address=256)
    MLADecodeBranchFP8.execute[dtype, cache_dtype, target](
        MutableInputTensor[static_spec=_get_unknown_tensor_spec[dtype, 3]()](p, IndexList[3](4, 16, 128)),
        MutableInputTensor[static_spec=_get_unknown_tensor_spec[dtype, 3]()](p, IndexList[3](4, 16, 512)),
        MutableInputTensor[static_spec=_get_unknown_tensor_spec[DType.float32, 2]()](f, IndexList[2](4, 16)),
        InputTensor[static_spec=_get_unknown_tensor_spec[dtype, 3]()](p, IndexList[3](4, 16, 192)),
        InputTensor[static_spec=_get_unknown_tensor_spec[DType.uint32, 1]()](u, IndexList[1](3)),
        InputTensor[static_spec=_get_unknown_tensor_spec[dtype, 2]()](p, IndexList[2](100, 64)),
        InputTensor[static_spec=_get_unknown_tensor_spec[dtype, 1]()](p, IndexList[1](512)),
        InputTensor[static_spec=_get_unknown_tensor_spec[dtype, 2]()](p, IndexList[2](4, 576)),
        MutableInputTensor[static_spec=_get_unknown_tensor_spec[cache_dtype, 6]()](c, IndexList[6](10, 1, 2, 16, 1, row)),
        InputTensor[static_spec=_get_unknown_tensor_spec[DType.uint32, 1]()](u, IndexList[1](2)),
        InputTensor[static_spec=_get_unknown_tensor_spec[DType.uint32, 2]()](u, IndexList[2](2, 5)),
        UInt32(1),
        Int32(1),
        Float32(0.1),
        Float32(1e-6),
        Int32(1),
        Int32(0),
        Int32(0),
        Int32(0),
        Int32(1),
        Int32(1),
        Int32(1),
        Int32(128),
        Int32(128),
        InputTensor[static_spec=_get_unknown_tensor_spec[DType.uint8, 3]()](b, IndexList[3](16, 512, 128)),
        InputTensor[static_spec=_get_unknown_tensor_spec[DType.float32, 3]()](f, IndexList[3](16, 4, 1)),
        InputTensor[static_spec=_get_unknown_tensor_spec[DType.uint8, 3]()](b, IndexList[3](16, 128, 512)),
        InputTensor[static_spec=_get_unknown_tensor_spec[DType.float32, 3]()](f, IndexList[3](16, 1, 4)),
        ctx,
    )


def main() raises:
    comptime if has_accelerator():
        var ctx = DeviceContext()
        instantiate[DType.bfloat16, "gpu"](ctx)
        instantiate[DType.float16, "gpu"](ctx)
        instantiate[DType.float32, "gpu"](ctx)
        instantiate[DType.bfloat16, "gpu", DType.uint8](ctx)
        instantiate[DType.bfloat16, "cpu"](ctx)
        instantiate[DType.bfloat16, "cpu", DType.uint8](ctx)
    else:
        print("build with --target-accelerator=sm_90")
