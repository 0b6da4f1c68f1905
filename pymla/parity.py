"""How closely the op must match the reference, and reports of how closely it does.

The op and the reference (:mod:`pymla.reference`) make the same rounding
steps. What may differ, and the bounds that follow, per stage:

**Step 5, the attention output** (``attention_out`` of the op vs ``raw`` of
the reference), element by element, with ``p`` the precision of the dtype
(8 bits bf16, 11 f16, 24 f32) and ``u = 2^-p`` its unit roundoff (0 for
float32, which rounds nothing):

* an online softmax rounds ``exp(s - m)`` for a running max ``m``, the
  reference for the final max: each probability may round differently, by at
  most ``u`` of itself on either side, so the un-normalized sums differ by at
  most ``2u * sum_j e_j |V_j|``. Divided by the row sum:
  ``2u * M`` with ``M = sum_j e_j |V_j| / sum_j e_j`` (the reference's
  ``attention_magnitude``);
* both round the result to dtype: one more ulp, at most ``2^(1-p) |raw|``;
* float32 sums in another order (and the GPU's ``exp``) move scores and sums by
  a few float32 ulps: ``F32_SLACK * M``.

So ``|att - raw| <= 2u M + 2^(1-p) |raw| + F32_SLACK M``. Simulated with a
16-key-tile online softmax over 24 random cases, the largest error was 0.49
of this bound (the final rounding dominates). What it can and cannot see:
a key read one position off, or q and the cache rows rotated at a wrong
position, exceed it by 100-600x in every dtype; a softmax scale off by 0.3%
exceeds it in float32 and float16, but not in bfloat16, whose probabilities
carry 2^-8 = 0.39% rounding themselves (the scale enters the same f32
softmax code for every dtype, so the float32 and float16 cases guard it).

**Step 6, the output given step 5** (the op's output vs the reference's
step 6 applied to the op's own attention output): both quantize the same
dtype values, so only the float32 summation order of the fp8 matmul
differs: the rounding to dtype may go the other way near a boundary, up to
one ulp (``ULP[dtype]`` at the top of the range, 2^-7 bf16, 2^-10 f16,
2^-21 f32 for sums in another order); we allow two. A value within a few
float32 ulps of an e4m3 rounding boundary can still round the other way
when the two sides compute the activation scale differently (a reciprocal
on the GPU): one e4m3 step on one input of one row, ``FP8_FLIP`` of max|ref|
at most; at least ``BULK_FRACTION`` of the rows must stay within the ulp
bound alone once there are ``BULK_MIN_ROWS`` rows, so an error touching every
row cannot hide behind the flip allowance.

**End to end** (op output vs reference output): a step-5 difference of
``d = 2u + 2^(1-p)`` relative moves an fp8 activation (3 mantissa bits, steps
of 2^-3 relative) to the other e4m3 neighbour for at most a share
``f = 2 d / 2^-3`` of them, each by one step; as independent errors over the
sum of step 6 they give a relative L2 error of at most ``sqrt(f) 2^-3``
(bf16: 0.0625, f16: 0.022; measured in simulation: 0.0085 and 0.0032), and
any element may move by ``E2E_FLIP`` (2^-5 of max|ref|; measured 0.017).
float32 keeps the step-6 bound (nothing is rounded).

Rotated and normalized cache rows must agree within one ulp of dtype
(``CACHE_TOLERANCE``; float32: 2^-20 for the different order of the RMSNorm sum).

**fp8_ds_mla cache rows** (:mod:`pymla.cache_format`). e4m3 carries 4
significant bits: its unit roundoff is ``2^-4`` and one step is at most
``2^-3`` of a value's binade. Op and reference quantize by the same rule
from the bfloat16 row of step 2, so they store the same bytes unless that
bfloat16 rounding went the other way (the one-ulp case above, about
``2^-14`` per element): then the e4m3 value may move by one step, and when
the flipped value is the block's largest, the scale may double. Either way
each latent value stays within one step at the block's top,
``FP8_CACHE_STEP = 2^-3`` of the block's ``amax``; the rope part, bfloat16,
keeps ``CACHE_TOLERANCE``. And at least ``BULK_FRACTION`` of the new rows'
bytes must be identical from ``BULK_MIN_ROWS`` rows on. Steps 5 and 6 keep
every bound above unchanged: the reference reads the same dequantized keys,
which are exactly bfloat16 values (the module :mod:`pymla.cache_format` says why).
Against the op with a bfloat16 cache (no quantization) nothing is bounded:
``python -m pymla accuracy`` measures that difference.

**The LSE of step 5** (``lse`` of the op vs the reference's), per row: both
take ``max_j s_j + log(sum_j exp(s_j - max))`` of float32 scores and sum the
unrounded float32 exponentials, in any dtype. The scores are sums of
products of the same dtype values in another order: each moves by at most
a few float32 ulps of ``S = max_j (scale sum_i |qf_i K_ji| + |bias_j|)``
(the reference's ``score_magnitude``), ``F32_SLACK * S``; the LSE is
1-Lipschitz in the scores (max norm), and ``log`` of the sum (the GPU's
``exp`` and ``log`` included) adds a few ulps of 1: ``|lse - ref| <=
F32_SLACK (S + 1)``. That holds when both sides score the same values; in
bfloat16 and float16 an element of ``q_full`` (step 3's sum in another
order) or of a new key row (step 2's) may round to the other neighbour, one
ulp ``2^(1-p)`` of itself, moving the scores by at most
``2^(1-p) P`` with ``P = scale max_i |qf_i| max_ji |K_ji|`` (the
reference's ``product_magnitude``); such flips are rare (a few float32
ulps against the dtype's half ulp: about 2^-14 per element). So every row
must be within ``F32_SLACK (S + 1) + LSE_FLIPS 2^(1-p) P`` and, from
``BULK_MIN_ROWS`` rows on, ``BULK_FRACTION`` of them within the float32
bound alone. Rows without keys must be ``-inf`` on both sides. A softmax
scale off by 0.3% moves every row's LSE by 0.3% of its largest score, over
10x the float32 bound for scores of a few units.

**Context-parallel decode over N > 1 pieces of the keys**
(:mod:`pymla.distributed`). Each rank's partial output is rounded to dtype
(``attention_out``: at most ``u |o_r| <= u M_r``), its online softmax
errs as above (``2u M_r``) and its LSE by ``F32_SLACK (S + 1)``; the merge
(float32, :func:`pymla.merge_attention_states`) weighs them with
``w_r = exp(lse_r - lse)`` (``sum_r w_r M_r = M``), whose relative errors
are at most twice the LSE's. Then the merged value is rounded once:
``|att - raw| <= (3u + F32_SLACK + 2 F32_SLACK (S + 1)) M + 2^(1-p) |raw|``.
End to end, the step-5 difference ``d = 3u + 2^(1-p)`` replaces ``2u + 2^(1-p)``
in the relative L2 bound. Against the one-process op (not the reference),
both outputs are within their bounds of the reference: the bounds add.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .cache_format import SCALE_BLOCK, dequantize_rows

PRECISION = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-21}
F32_SLACK = 2**-16
FP8_FLIP = 2**-8
E2E_FLIP = 2**-5
FP8_STEP = 2**-3
BULK_FRACTION = 0.95
BULK_MIN_ROWS = 64
LSE_FLIPS = 2
CACHE_TOLERANCE = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-20}
FP8_CACHE_STEP = 2**-3


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: the largest relative error of one rounding to ``dtype`` (0: float32 rounds nothing)."""
    return 0.0 if dtype == torch.float32 else 2.0 ** -PRECISION[dtype]


def e2e_relative_l2(dtype: torch.dtype, pieces: int = 1) -> float:
    """The end-to-end relative L2 bound ``sqrt(f) 2^-3`` of the module docstring (bf16, f16).

    ``pieces > 1``: a context-parallel result, whose partial outputs were rounded once more.
    """
    rounding = 2 if pieces == 1 else 3
    d = rounding * unit_roundoff(dtype) + 2.0 ** (1 - PRECISION[dtype])
    return math.sqrt(min(1.0, 2 * d / FP8_STEP)) * FP8_STEP


@dataclass(frozen=True)
class ParityReport:
    max_abs_error: float
    max_reference: float
    bulk_fraction: float  # share of (token, head) rows within the ulp bound
    rows: int
    tolerance: float  # allowed max_abs_error / max_reference
    ulp_bound: float
    relative_l2: float = 0.0
    relative_l2_bound: float = math.inf

    @property
    def relative_error(self) -> float:
        return self.max_abs_error / self.max_reference if self.max_reference else self.max_abs_error

    @property
    def passed(self) -> bool:
        bulk_ok = self.rows < BULK_MIN_ROWS or self.bulk_fraction >= BULK_FRACTION
        l2_ok = self.relative_l2 <= self.relative_l2_bound
        return self.relative_error <= self.tolerance and bulk_ok and l2_ok

    def describe(self) -> str:
        text = (
            f"max error {self.relative_error:.3g} x max|ref| (allowed {self.tolerance:.3g}); "
            f"{self.bulk_fraction:.1%} of {self.rows} rows within {self.ulp_bound:.3g}"
        )
        if math.isinf(self.relative_l2_bound):
            return text + f" (need {BULK_FRACTION:.0%} from {BULK_MIN_ROWS} rows on)"
        return text + (
            f"; relative L2 {self.relative_l2:.3g} (allowed {self.relative_l2_bound:.3g})"
        )


def compare_projection(out: torch.Tensor, ref: torch.Tensor) -> ParityReport:
    """Step 6: ``out`` vs the reference's step 6 on the op's own attention output (``[T, H, Dv]``)."""
    ulp_bound = 2 * ULP[ref.dtype] + 1e-6
    ref32, out32 = ref.float(), out.float()
    top = ref32.abs().max().item() if ref.numel() else 0.0
    err = (out32 - ref32).abs()
    max_err = err.max().item() if err.numel() else 0.0
    row_err = err.reshape(-1, err.shape[-1]).amax(dim=-1) if err.numel() else err.reshape(0)
    bulk = (row_err <= ulp_bound * top).float().mean().item() if row_err.numel() else 1.0
    return ParityReport(max_err, top, bulk, row_err.numel(), ulp_bound + FP8_FLIP, ulp_bound)


def compare_output(
    out: torch.Tensor, ref: torch.Tensor, pieces: int = 1, *, other_op: bool = False
) -> ParityReport:
    """End to end: ``out`` vs the reference output (``[T, H, Dv]``), bounds of the module docstring.

    ``pieces``: the keys were attended in that many pieces and merged
    (context-parallel decode). ``other_op``: ``ref`` is another result of
    the op (the one-process op's) rather than the reference's: the two
    outputs' bounds add.
    """
    twice = 2 if other_op else 1
    if ref.dtype == torch.float32:
        report = compare_projection(out, ref)
        return ParityReport(
            report.max_abs_error,
            report.max_reference,
            report.bulk_fraction,
            report.rows,
            report.tolerance * twice,
            report.ulp_bound * twice,
        )
    ref32, out32 = ref.float(), out.float()
    top = ref32.abs().max().item() if ref.numel() else 0.0
    err = out32 - ref32
    max_err = err.abs().max().item() if err.numel() else 0.0
    norm = ref32.norm().item()
    rel_l2 = err.norm().item() / norm if norm else err.norm().item()
    rows = err.reshape(-1, err.shape[-1]).shape[0] if err.numel() else 0
    ulp_bound = 2 * ULP[ref.dtype]
    l2_bound = e2e_relative_l2(ref.dtype, pieces) + (e2e_relative_l2(ref.dtype) if other_op else 0)
    return ParityReport(
        max_err, top, 1.0, rows, twice * (ulp_bound + E2E_FLIP), ulp_bound, rel_l2, l2_bound
    )


@dataclass(frozen=True)
class AttentionReport:
    max_ratio: float  # largest |att - raw| / bound
    elements: int
    worst: str  # where the largest ratio is

    @property
    def passed(self) -> bool:
        return self.max_ratio <= 1.0

    def describe(self) -> str:
        return (
            f"attention: largest error {self.max_ratio:.3g} x its bound over {self.elements} "
            f"elements ({self.worst})"
        )


def attention_bound(
    raw: torch.Tensor,
    magnitude: torch.Tensor,
    dtype: torch.dtype,
    score_magnitude: torch.Tensor | None = None,
) -> torch.Tensor:
    """``2u M + 2^(1-p) |raw| + F32_SLACK M`` per element (module docstring).

    Given ``score_magnitude [T, H]``: the bound of a result merged from
    several pieces, ``(3u + F32_SLACK + 2 F32_SLACK (S + 1)) M + 2^(1-p) |raw|``.
    """
    u = unit_roundoff(dtype)
    final = 2.0 ** (1 - PRECISION[dtype]) if dtype != torch.float32 else 2.0**-23
    if score_magnitude is None:
        return (2 * u + F32_SLACK) * magnitude + final * raw.abs() + 1e-30
    weights = 2 * lse_bound(score_magnitude.float())[..., None]
    return (3 * u + F32_SLACK + weights) * magnitude + final * raw.abs() + 1e-30


def lse_bound(score_magnitude: torch.Tensor) -> torch.Tensor:
    """``F32_SLACK (S + 1)`` per row: how far the op's LSE may be from the reference's."""
    return F32_SLACK * (score_magnitude + 1)


@dataclass(frozen=True)
class LseReport:
    max_ratio: float  # largest |lse - ref| / (float32 bound + flip allowance)
    bulk_fraction: float  # share of rows within the float32 bound alone
    rows: int
    worst: str

    @property
    def passed(self) -> bool:
        bulk_ok = self.rows < BULK_MIN_ROWS or self.bulk_fraction >= BULK_FRACTION
        return self.max_ratio <= 1.0 and bulk_ok

    def describe(self) -> str:
        return (
            f"lse: largest error {self.max_ratio:.3g} x its bound over {self.rows} rows "
            f"({self.worst}); {self.bulk_fraction:.1%} within the float32 bound "
            f"(need {BULK_FRACTION:.0%} from {BULK_MIN_ROWS} rows on)"
        )


def compare_lse(
    lse: torch.Tensor,
    ref: torch.Tensor,
    score_magnitude: torch.Tensor,
    product_magnitude: torch.Tensor,
    dtype: torch.dtype,
) -> LseReport:
    """The op's ``lse [T, H]`` vs the reference's (module docstring); ``-inf`` rows must agree.

    ``score_magnitude`` and ``product_magnitude``: the reference's; ``dtype``: the op's.
    """
    if not ref.numel():
        return LseReport(0.0, 1.0, 0, "no rows")
    lse, ref = lse.float(), ref.float()
    empty = torch.isneginf(ref)
    err = torch.where(empty, torch.zeros_like(ref), (lse - ref).abs())
    f32 = lse_bound(score_magnitude.float())
    flips = LSE_FLIPS * 2 * unit_roundoff(dtype) * product_magnitude.float()
    ratio = err / (f32 + flips)
    bad = torch.isnan(ratio) | (empty != torch.isneginf(lse)) | torch.isnan(lse)
    ratio = torch.where(bad, torch.full_like(ratio, math.inf), ratio)
    bulk = ((err <= f32) & ~bad).float().mean().item()
    worst = int(ratio.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ratio.shape))
    where = (
        f"at (t, h) = {index}: op {float(lse.flatten()[worst]):.8g}, "
        f"reference {float(ref.flatten()[worst]):.8g}"
    )
    return LseReport(float(ratio.max()), bulk, ratio.numel(), where)


def compare_attention(
    att: torch.Tensor,
    raw: torch.Tensor,
    magnitude: torch.Tensor,
    dtype: torch.dtype,
    score_magnitude: torch.Tensor | None = None,
) -> AttentionReport:
    """The op's attention output ``att`` vs the reference's ``raw`` and ``attention_magnitude``.

    ``score_magnitude`` (the reference's): ``att`` was merged from several
    pieces of the keys (context-parallel decode); the bound is that of the module docstring.
    """
    if not raw.numel():
        return AttentionReport(0.0, 0, "no elements")
    err = (att.float() - raw.float()).abs()
    ratio = err / attention_bound(raw.float(), magnitude.float(), dtype, score_magnitude)
    ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
    worst = int(ratio.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ratio.shape))
    where = (
        f"at (t, h, c) = {index}: op {float(att.flatten()[worst]):.6g}, "
        f"reference {float(raw.flatten()[worst]):.6g}"
    )
    return AttentionReport(float(ratio.max()), ratio.numel(), where)


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
    before: torch.Tensor,
    after: torch.Tensor,
    reference: torch.Tensor,
    updated: torch.Tensor,
    kv_lora_rank: int | None = None,
) -> CacheReport:
    """Cache blocks after the op vs after the reference; ``updated`` masks the new rows.

    ``uint8`` blocks hold ``fp8_ds_mla`` rows of ``kv_lora_rank`` latent
    values: compared by :func:`compare_fp8_rows`.
    """
    identical = torch.equal(after[~updated].view(torch.uint8), before[~updated].view(torch.uint8))
    if after.dtype == torch.uint8:
        ratio, exact = compare_fp8_rows(after[updated], reference[updated], kv_lora_rank)
        rows_ok = int(updated.sum()) < BULK_MIN_ROWS or exact >= BULK_FRACTION
        return CacheReport(int(updated.sum()), ratio if rows_ok else math.inf, 1.0, identical)
    rows, ref_rows = after[updated].float(), reference[updated].float()
    top = ref_rows.abs().max().item() if ref_rows.numel() else 0.0
    err = (rows - ref_rows).abs().max().item() if rows.numel() else 0.0
    return CacheReport(
        int(updated.sum()), err / top if top else err, CACHE_TOLERANCE[after.dtype], identical
    )


def compare_fp8_rows(rows: torch.Tensor, reference: torch.Tensor, kv_lora_rank: int) -> tuple:
    """``fp8_ds_mla`` rows ``[n, bytes]`` vs the reference's: (largest error / bound, share of equal bytes).

    Bounds (module docstring): ``FP8_CACHE_STEP`` of the block's ``amax``
    per latent value, ``CACHE_TOLERANCE[bfloat16]`` of max|rope| per rope value.
    """
    if not rows.numel():
        return 0.0, 1.0
    got, ref = dequantize_rows(rows, kv_lora_rank), dequantize_rows(reference, kv_lora_rank)
    latent = ref[:, :kv_lora_rank].unflatten(-1, (-1, SCALE_BLOCK))
    amax = latent.abs().amax(dim=-1, keepdim=True).expand_as(latent).flatten(-2)
    rope_top = ref[:, kv_lora_rank:].abs().max()
    bound = torch.cat(
        [
            FP8_CACHE_STEP * amax,
            torch.full_like(ref[:, kv_lora_rank:], CACHE_TOLERANCE[torch.bfloat16] * rope_top),
        ],
        dim=-1,
    )
    ratio = (got - ref).abs() / (bound + 1e-30)
    ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
    exact = (rows == reference).float().mean().item()
    return float(ratio.max()), exact
