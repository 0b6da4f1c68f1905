"""The op's options and the checks of Python values: the non-tensor arguments.

:class:`DecodeOptions` holds one step's options, checked when made
(:func:`check_options`); the ``as_*`` checks take one Python argument each.
Errors are in :mod:`pymla.validate`'s form (``"<arg>: expected <what>, got
<actual>"``; TypeError for a wrong type, ValueError for a wrong value). The
scale granularity is a weights option, parsed by
:meth:`pymla.ScaleGranularity.parse`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .args import WINDOWED_MASKS, Mask, ScoreMod

if TYPE_CHECKING:  # pymla.shard imports this module's checks
    from .shard import CacheShard

INT32_MAX = 2**31 - 1
FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_MIN_POSITIVE = 2.0**-149  # the smallest positive (subnormal) float32


def _join(names: Sequence[str]) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


# ---------------------------------------------------------------- python scalars


def as_int(name: str, value: object) -> int:
    """An int argument (Python or numpy int, not bool): TypeError otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


def as_float(name: str, value: object) -> float:
    """A real-number argument (int, float or a one-element real tensor, not bool): TypeError otherwise."""
    if type(value) is float:  # the usual case, before the checks of the others
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype.is_floating_point:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    return float(value)


def as_bool(name: str, value: object) -> bool:
    """A bool argument: TypeError otherwise (an int is not taken for one)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def as_device(name: str, value: object) -> torch.device:
    """A torch device (a ``torch.device`` or its name) that this torch can use.

    TypeError for another type, ValueError for an unknown name or a CUDA
    device torch does not see.
    """
    if not isinstance(value, (str, torch.device)):
        raise TypeError(
            f"{name}: expected a torch.device or a device name such as 'cpu' or 'cuda:0', "
            f"got {type(value).__name__}"
        )
    try:
        device = torch.device(value)
    except RuntimeError:
        raise ValueError(
            f"{name}: expected a device name such as 'cpu' or 'cuda:0', got {value!r}"
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(
                f"{name}: expected a CUDA device this torch sees ({count} found), got {device}"
            )
    return device


# ---------------------------------------------------------------- options


def check_options(
    *,
    scale: float,
    epsilon: float,
    mask: Mask | str,
    score_mod: ScoreMod | str,
    local_window_size: int,
) -> tuple[float, float, Mask, ScoreMod, int]:
    """The non-tensor options of the op (the scale granularity: ``ScaleGranularity.parse``),
    parsed: ``(scale, epsilon, mask, score_mod, local_window_size)``.

    ``mask`` and ``score_mod`` are the enums or their names in any case
    (:meth:`pymla.Mask.parse`). Only the windowed masks (sliding_window_causal,
    chunked_causal) take a ``local_window_size``; the others need 0, so a
    window given with them is not silently ignored.
    """
    mask = Mask.parse(mask)
    score_mod = ScoreMod.parse(score_mod)
    window = as_int("local_window_size", local_window_size)
    if mask.windowed and window < 1:
        raise ValueError(f"local_window_size: expected >= 1 for mask {mask.label!r}, got {window}")
    if not 0 <= window <= INT32_MAX:
        raise ValueError(
            f"local_window_size: expected 0 <= local_window_size < 2**31, got {window}"
        )
    if not mask.windowed and window != 0:
        raise ValueError(
            f"local_window_size: expected 0 for mask {mask.label!r} (only {_join(WINDOWED_MASKS)} "
            f"take a window), got {window}"
        )
    scale = as_float("scale", scale)
    if not (math.isfinite(scale) and FLOAT32_MIN_POSITIVE <= scale <= FLOAT32_MAX):
        raise ValueError(f"scale: expected a finite float32 value > 0, got {scale}")
    epsilon = as_float("epsilon", epsilon)
    if not (math.isfinite(epsilon) and 0 <= epsilon <= FLOAT32_MAX):
        raise ValueError(f"epsilon: expected a finite float32 value >= 0, got {epsilon}")
    return scale, epsilon, mask, score_mod, window


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """The op's options, checked when made.

    ``mask`` and ``score_mod`` take the enums or their names (``"causal"``);
    ``local_window_size`` is the window (sliding) or chunk (chunked) size.
    ``shard``: the positions the cache holds (:class:`pymla.CacheShard`;
    default the whole cache), for context-parallel decode
    (:mod:`pymla.distributed`).
    """

    scale: float
    epsilon: float = 1e-6
    mask: Mask = Mask.CAUSAL
    score_mod: ScoreMod = ScoreMod.NO_POS
    local_window_size: int = 0
    shard: CacheShard | None = None  # None: the whole cache

    def __post_init__(self) -> None:
        parsed = check_options(
            scale=self.scale,
            epsilon=self.epsilon,
            mask=self.mask,
            score_mod=self.score_mod,
            local_window_size=self.local_window_size,
        )
        from .shard import WHOLE_CACHE, CacheShard  # shard.py imports this module's checks

        shard = WHOLE_CACHE if self.shard is None else self.shard
        if not isinstance(shard, CacheShard):
            raise TypeError(
                f"shard: expected a pymla.CacheShard or None, got {type(shard).__name__}"
            )
        object.__setattr__(self, "shard", shard)
        for field, value in zip(_PARSED_FIELDS, parsed, strict=True):
            object.__setattr__(self, field, value)

    def scalars(self) -> dict[str, int | float]:
        """The kernel's scalar inputs of these options."""
        return {
            "scale": self.scale,
            "epsilon": self.epsilon,
            "mask": int(self.mask),
            "score_mod": int(self.score_mod),
            "local_window_size": self.local_window_size,
            **self.shard.scalars(),
        }


_PARSED_FIELDS = ("scale", "epsilon", "mask", "score_mod", "local_window_size")
"""The :class:`DecodeOptions` fields :func:`check_options` returns parsed, in its order."""
