"""How closely the op must match the reference, and a report of how closely it does.

Tolerances are relative to the largest reference magnitude. The kernel and
the reference make the same rounding steps (fp8 quantization of q_nope and of
the attention output, cache rows rounded to dtype, output rounded to dtype);
only float32 summation order differs, by a few float32 ulps. Two effects follow:

* the output's rounding to dtype may go the other way for a value near a
  rounding boundary: up to one ulp of dtype, ``ULP[dtype]`` at the top of the
  range (2^-7 bf16, 2^-10 f16); we allow two. For float32 output ``ULP`` is
  2^-21: float32 sums in another order, and the GPU's approximate ``exp``,
  move values by a few float32 ulps (measured: median 3e-8, 95th percentile
  2e-7 of max|ref| on the GPU);
* step 6 re-quantizes the attention output to fp8, and a value within a few
  float32 ulps of an e4m3 rounding boundary may round to the other e4m3
  neighbour: one e4m3 step (up to 2^-3 relative) on one input of one
  (token, head) row, which moves that row's outputs. Such flips hit about
  1 in 10^5 quantized values; each moved outputs by at most 0.17% of
  max|ref| on the parity grid (CPU and GPU). We allow ``FP8_FLIP`` = 2^-8
  (0.39%) for every element, but when there are at least ``BULK_MIN_ROWS``
  (token, head) rows, at least ``BULK_FRACTION`` of them must stay within the
  ulp bound alone, so that an error touching every row (a wrong key, a wrong
  scale) cannot hide behind the flip allowance. (With a handful of rows one
  flip is a large share of them, so only the element bound applies.)

Rotated and normalized cache rows must agree within one ulp of dtype
(``CACHE_TOLERANCE``; float32: 2^-20 for the different order of the RMSNorm sum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-21}
FP8_FLIP = 2**-8
BULK_FRACTION = 0.95
BULK_MIN_ROWS = 64
CACHE_TOLERANCE = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-20}


@dataclass(frozen=True)
class ParityReport:
    max_abs_error: float
    max_reference: float
    bulk_fraction: float  # share of (token, head) rows within the ulp bound
    rows: int
    tolerance: float  # allowed max_abs_error / max_reference
    ulp_bound: float

    @property
    def relative_error(self) -> float:
        return self.max_abs_error / self.max_reference if self.max_reference else self.max_abs_error

    @property
    def passed(self) -> bool:
        bulk_ok = self.rows < BULK_MIN_ROWS or self.bulk_fraction >= BULK_FRACTION
        return self.relative_error <= self.tolerance and bulk_ok

    def describe(self) -> str:
        return (
            f"max error {self.relative_error:.3g} x max|ref| (allowed {self.tolerance:.3g}); "
            f"{self.bulk_fraction:.1%} of {self.rows} rows within {self.ulp_bound:.3g} "
            f"(need {BULK_FRACTION:.0%} from {BULK_MIN_ROWS} rows on)"
        )


def compare_output(out: torch.Tensor, ref: torch.Tensor) -> ParityReport:
    """Measures ``out`` against ``ref`` (``[T, H, Dv]``) with the output tolerance of this module."""
    ulp_bound = 2 * ULP[ref.dtype] + 1e-6
    ref32, out32 = ref.float(), out.float()
    top = ref32.abs().max().item() if ref.numel() else 0.0
    err = (out32 - ref32).abs()
    max_err = err.max().item() if err.numel() else 0.0
    row_err = err.reshape(-1, err.shape[-1]).amax(dim=-1) if err.numel() else err.reshape(0)
    bulk = (row_err <= ulp_bound * top).float().mean().item() if row_err.numel() else 1.0
    return ParityReport(max_err, top, bulk, row_err.numel(), ulp_bound + FP8_FLIP, ulp_bound)


@dataclass(frozen=True)
class CacheReport:
    rows_updated: int
    max_row_error: float  # relative to max|reference rows|
    row_tolerance: float
    untouched_identical: bool  # every byte outside the updated rows as before

    @property
    def passed(self) -> bool:
        return self.max_row_error <= self.row_tolerance and self.untouched_identical

    def describe(self) -> str:
        return (
            f"{self.rows_updated} rows updated, max error {self.max_row_error:.3g} x max|ref| "
            f"(allowed {self.row_tolerance:.3g}); other bytes "
            f"{'identical' if self.untouched_identical else 'CHANGED'}"
        )


def compare_cache(
    before: torch.Tensor, after: torch.Tensor, reference: torch.Tensor, updated: torch.Tensor
) -> CacheReport:
    """Cache blocks after the op vs after the reference; ``updated`` masks the new rows."""
    rows, ref_rows = after[updated].float(), reference[updated].float()
    top = ref_rows.abs().max().item() if ref_rows.numel() else 0.0
    err = (rows - ref_rows).abs().max().item() if rows.numel() else 0.0
    identical = torch.equal(after[~updated].view(torch.uint8), before[~updated].view(torch.uint8))
    return CacheReport(
        int(updated.sum()), err / top if top else err, CACHE_TOLERANCE[after.dtype], identical
    )
