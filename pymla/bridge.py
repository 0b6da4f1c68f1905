"""torch <-> MAX without copies, through DLPack.

MAX's graphs reject float8 on the CPU, so fp8 tensors cross as ``uint8``
views of the same bytes (``t.view(torch.uint8)``); the kernel reinterprets
them as ``float8_e4m3fn``. Every other dtype crosses as itself. Buffers share
memory with the torch tensors: an in-place write by the op is a write to the
torch tensor.
"""

from __future__ import annotations

import torch
from max import driver
from max.dtype import DType

FP8_DTYPES = (torch.float8_e4m3fn,)

_TORCH_TO_MAX = {
    torch.float32: DType.float32,
    torch.float16: DType.float16,
    torch.bfloat16: DType.bfloat16,
    torch.uint8: DType.uint8,
    torch.uint32: DType.uint32,
    torch.int32: DType.int32,
    torch.int64: DType.int64,
    torch.float8_e4m3fn: DType.uint8,  # crosses as raw bytes
}


def max_dtype(dtype: torch.dtype) -> DType:
    """The MAX dtype a torch tensor of ``dtype`` crosses as."""
    try:
        return _TORCH_TO_MAX[dtype]
    except KeyError:
        raise TypeError(f"no MAX equivalent for torch dtype {dtype}") from None


def to_max(t: torch.Tensor) -> driver.Buffer:
    """A MAX buffer over the same memory as ``t`` (fp8 as uint8). ``t`` must be contiguous."""
    if not t.is_contiguous():
        raise ValueError("to_max: tensor must be contiguous (call .contiguous() first)")
    if t.dtype in FP8_DTYPES:
        t = t.view(torch.uint8)
    return driver.Buffer.from_dlpack(t)


def to_torch(buffer: driver.Buffer) -> torch.Tensor:
    """A torch tensor over the same memory as a MAX buffer."""
    return torch.from_dlpack(buffer)


def max_device(device: torch.device) -> driver.Device:
    """The MAX device for a torch device (``cpu`` or ``cuda:N``)."""
    if device.type == "cpu":
        return driver.CPU()
    if device.type == "cuda":
        return driver.Accelerator(device.index or 0)
    raise ValueError(f"unsupported torch device {device}")
