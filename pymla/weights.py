"""One layer's weights, checked and wrapped for MAX once: :class:`LayerWeights`."""

from __future__ import annotations

import torch

from . import bridge, value_checks
from . import validate as v
from .args import ARGS, BY_NAME, Source
from .buffers import ARG_INDEX, max_buffers
from .quant import ScaleGranularity

_WEIGHT_NAMES = tuple(a.name for a in ARGS if a.source is Source.WEIGHTS)


def dim_or_zero(t: torch.Tensor, i: int) -> int:
    """``t.shape[i]``, 0 when ``t`` has no dim ``i``: the one-shot call traced by torch.compile
    makes its plan before the torch op's fake implementation names a malformed argument.
    """
    return t.shape[i] if t.dim() > i else 0


class LayerWeights:
    """One layer's weights, checked and wrapped for MAX once.

    Args:
        w_uk: ``[H, kv_lora_rank, qk_nope_head_dim]`` float8_e4m3fn.
        w_uk_scale: float32 scales of ``w_uk`` for ``scale_granularity``.
        w_uv: ``[H, v_head_dim, kv_lora_rank]`` float8_e4m3fn.
        w_uv_scale: float32 scales of ``w_uv``.
        kv_norm_gamma: ``[kv_lora_rank]`` RMSNorm weights, in the op's dtype.
        scale_granularity: ``(m, n, k)`` or a preset name; see :mod:`pymla.quant`.
        check_values: also check that every scale is finite (a device-to-host copy on a GPU).
    """

    def __init__(
        self,
        w_uk: torch.Tensor,
        w_uk_scale: torch.Tensor,
        w_uv: torch.Tensor,
        w_uv_scale: torch.Tensor,
        kv_norm_gamma: torch.Tensor,
        scale_granularity: ScaleGranularity | tuple[int, int, int] | str = "blockwise",
        *,
        check_values: bool = True,
        _checked: bool = False,
        _launch_now: bool = False,
    ) -> None:
        # Parsed here, where the option enters; the one-shot call and the torch op's body
        # pass the ScaleGranularity they parsed (with _checked).
        g = scale_granularity if _checked else ScaleGranularity.parse(scale_granularity)
        tensors = {
            "kv_norm_gamma": kv_norm_gamma,
            "w_uk": w_uk,
            "w_uk_scale": w_uk_scale,
            "w_uv": w_uv,
            "w_uv_scale": w_uv_scale,
        }
        if not _checked:
            self._check(tensors, g, check_values)
        self.tensors = tensors
        self.granularity = g
        self.num_heads, self.kv_lora_rank, self.nope_dim = (dim_or_zero(w_uk, i) for i in range(3))
        self.v_head_dim = dim_or_zero(w_uv, 1)
        self.dtype = kv_norm_gamma.dtype
        self.device = kv_norm_gamma.device
        # What run() compares with its plan in one tuple comparison.
        self._compat = (self.dtype, self.device, self.kv_lora_rank)
        self._buffers: dict | None = None
        self._indexed: tuple | None = None  # ((position in ARGS, buffer), ...)
        # Made for one launch right away (the one-shot call, the torch op's body): wrapped
        # without DLPack's stream ordering (buffers.max_buffers).
        self._launch_now = _launch_now
        if not torch.compiler.is_compiling():  # traced by torch.compile: wrapped when run eagerly
            self._prepare()

    def _prepare(self) -> tuple:
        """Wraps the weights for MAX (once): fp8 as their uint8 bytes, the granularity as scalars."""
        g = self.granularity
        self._buffers = max_buffers(
            {
                **{
                    k: (t.view(torch.uint8) if k in ("w_uk", "w_uv") else t)
                    for k, t in self.tensors.items()
                },
                "m_scale_granularity": g.m,
                "n_scale_granularity": g.n,
                "k_scale_granularity": g.k,
            },
            bridge.dlpack_device(self.device) if self._launch_now else None,
        )
        self._indexed = tuple((ARG_INDEX[n], self._buffers[n]) for n in _WEIGHT_NAMES)
        return self._indexed

    @property
    def buffers(self) -> dict:
        """The weights' MAX buffers by argument name (made once)."""
        if self._buffers is None:
            self._prepare()
        return self._buffers

    @staticmethod
    def _check(tensors: dict[str, torch.Tensor], g: ScaleGranularity, check_values: bool) -> None:
        for name, t in tensors.items():
            arg = BY_NAME[name]
            dtypes = (v.FP8_DTYPE,) if name in ("w_uk", "w_uv") else arg.torch_dtypes()
            v.check_tensor(name, t, rank=arg.rank, dtypes=dtypes)
        v._agree_attr("device", tensors, ValueError)
        w_uk, w_uv, gamma = tensors["w_uk"], tensors["w_uv"], tensors["kv_norm_gamma"]
        num_heads = v._agree_size("num_heads", [v._Size("w_uk", w_uk, 0), v._Size("w_uv", w_uv, 0)])
        kv_lora_rank = v._agree_size(
            "kv_lora_rank",
            [
                v._Size("w_uk", w_uk, 1),
                v._Size("w_uv", w_uv, 2),
                v._Size("kv_norm_gamma", gamma, 0),
            ],
        )
        for name, t, dim, what in (
            ("w_uk", w_uk, 0, "num_heads"),
            ("w_uk", w_uk, 1, "kv_lora_rank"),
            ("w_uk", w_uk, 2, "qk_nope_head_dim"),
            ("w_uv", w_uv, 1, "v_head_dim"),
        ):
            v._at_least(name, t, dim, what)
        v._check_scales(
            "w_uk_scale",
            tensors["w_uk_scale"],
            num_heads,
            ("kv_lora_rank", kv_lora_rank),
            ("qk_nope_head_dim", w_uk.shape[2]),
            g,
        )
        v._check_scales(
            "w_uv_scale",
            tensors["w_uv_scale"],
            num_heads,
            ("v_head_dim", w_uv.shape[1]),
            ("kv_lora_rank", kv_lora_rank),
            g,
        )
        if check_values:
            value_checks.check_finite_scales(tensors["w_uk_scale"], tensors["w_uv_scale"])
