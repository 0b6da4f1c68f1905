"""Shared test inputs: random MLA decode cases on a paged cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import pymla
from pymla.quant import ScaleGranularity, make_mla_weights
from pymla.reference import KVCacheTensors, default_scale, mla_decode_branch_fp8_reference

# Tolerances, relative to the largest reference magnitude.
#
# The kernel and the reference make the same rounding steps (fp8 quantization
# of q_nope and of the attention output, cache rows rounded to dtype, output
# rounded to dtype); only float32 summation order differs, by a few float32
# ulps. Two effects follow:
# * the output's rounding to dtype may go the other way for a value near a
#   rounding boundary: up to one ulp of dtype, ULP[dtype] at the top of the
#   range (2^-7 bf16, 2^-10 f16, 2^-23 f32); we allow two;
# * step 6 re-quantizes the attention output to fp8, and a value within a few
#   float32 ulps of an e4m3 rounding boundary may round to the other e4m3
#   neighbour, one e4m3 step (up to 2^-3 relative) on one input of one
#   (token, head) row. Such flips hit about 1 in 10^5 quantized values; each
#   moved outputs by at most 0.15% of max|ref| on the parity grid. We allow
#   FP8_FLIP = 2^-8 (0.39%) for every element, but require that at least
#   BULK_FRACTION of the elements stay within the ulp bound alone, so that an
#   error that touches every row (a wrong key, a wrong scale) cannot hide
#   behind the flip allowance.
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-23}
FP8_FLIP = 2**-8
BULK_FRACTION = 0.95
# Rotated and normalized cache rows: one ulp of dtype (a float32 sum that
# lands on a rounding boundary may round the other way); float32 allows 2^-20
# for the different order of the RMSNorm sum.
CACHE_TOLERANCE = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-20}


@dataclass
class Case:
    """All inputs of one op call, plus a snapshot of the cache before it."""

    q: torch.Tensor
    input_row_offsets: torch.Tensor
    freqs_cis: torch.Tensor
    kv_norm_gamma: torch.Tensor
    cache: pymla.PagedLatentCache
    layer_idx: int
    weights: dict[str, torch.Tensor]
    options: dict = field(default_factory=dict)

    def args(self, cache=None) -> tuple:
        w = self.weights
        return (
            self.q, self.input_row_offsets, self.freqs_cis, self.kv_norm_gamma,
            self.cache if cache is None else cache, self.layer_idx,
            w["w_uk"], w["w_uk_scale"], w["w_uv"], w["w_uv_scale"],
        )

    def cache_tensors(self) -> KVCacheTensors:
        return KVCacheTensors(self.cache.blocks, self.cache.cache_lengths, self.cache.lookup_table)

    def new_positions(self) -> list[tuple[int, int]]:
        """(request, position) of every new token."""
        offsets = self.input_row_offsets.tolist()
        return [
            (b, self.cache.length(b) + i)
            for b in range(len(offsets) - 1)
            for i in range(offsets[b + 1] - offsets[b])
        ]


def make_case(
    seed: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    num_heads: int = 16,
    page_size: int = 16,
    cache_lengths: tuple[int, ...] = (5, 40, 0),
    new_tokens: tuple[int, ...] = (1, 2, 3),
    num_layers: int = 2,
    layer_idx: int = 1,
    granularity: ScaleGranularity | str = "blockwise",
    mask: str = "causal",
    score_mod: str = "no_pos",
    local_window_size: int = 0,
    kv_lora_rank: int = 512,
    nope_dim: int = 128,
    rope_dim: int = 64,
    v_head_dim: int = 128,
    extra_rows: int = 7,
) -> Case:
    """A fresh random case: every value is drawn from ``seed``, none is zero."""
    g = torch.Generator().manual_seed(seed)
    granularity = ScaleGranularity.parse(granularity)
    total = sum(c + n for c, n in zip(cache_lengths, new_tokens, strict=True))
    num_blocks = total // page_size + 2 * len(cache_lengths) + 4
    cache = pymla.PagedLatentCache(
        num_blocks=num_blocks, page_size=page_size, num_layers=num_layers, dtype=dtype,
        kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim, shuffle_pages=True, generator=g,
    )
    # Every slot of the pool holds random data, so a read or write of a wrong row shows.
    cache.blocks.copy_(torch.randn(cache.blocks.shape, generator=g).to(dtype))
    for length in cache_lengths:
        b = cache.add_request()
        cache.fill(b, length, generator=g)
    for b, n in enumerate(new_tokens):
        for layer in range(num_layers):
            rows = torch.randn(n, kv_lora_rank + rope_dim, generator=g) * 2 + 0.5
            cache.append(b, layer, rows)
    num_tokens = sum(new_tokens)
    offsets = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int64)
    max_seq_len = max(c + n for c, n in zip(cache_lengths, new_tokens, strict=True)) + extra_rows
    angles = torch.rand(max_seq_len, rope_dim // 2, generator=g) * 6.3
    freqs = torch.stack([angles.cos(), angles.sin()], dim=-1).reshape(max_seq_len, rope_dim)
    weights = make_mla_weights(num_heads, kv_lora_rank, nope_dim, v_head_dim, granularity, generator=g)
    return Case(
        q=(torch.randn(num_tokens, num_heads, nope_dim + rope_dim, generator=g) * 1.5).to(dtype),
        input_row_offsets=offsets.to(torch.uint32),
        freqs_cis=freqs.to(dtype),
        kv_norm_gamma=(1 + 0.25 * torch.randn(kv_lora_rank, generator=g)).to(dtype),
        cache=cache,
        layer_idx=layer_idx,
        weights=weights,
        options=dict(
            scale=default_scale(nope_dim, rope_dim) * (1 + 0.2 * torch.rand(1, generator=g).item()),
            epsilon=1e-6,
            scale_granularity=granularity,
            mask=mask,
            score_mod=score_mod,
            local_window_size=local_window_size,
        ),
    )


def run_reference(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference output and the reference's cache blocks after the call (the case is untouched)."""
    kv = KVCacheTensors(case.cache.blocks.clone(), case.cache.cache_lengths, case.cache.lookup_table)
    out = mla_decode_branch_fp8_reference(*case.args(cache=kv), **case.options)
    return out, kv.blocks


def run_op_poisoned(case: Case) -> torch.Tensor:
    """Runs the op into a NaN-poisoned output and checks every element was written."""
    out = torch.full(
        (case.q.shape[0], case.q.shape[1], case.weights["w_uv"].shape[1]), float("nan"), dtype=case.q.dtype
    )
    result = pymla.mla_decode_branch_fp8(*case.args(), **case.options, out=out)
    assert result is out
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} output elements were not written"
    return out


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """|actual - expected| <= tol * max|expected|, elementwise."""
    bound = tol * expected.float().abs().max().item()
    err = (actual.float() - expected.float()).abs()
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= bound, f"{what}: max error {worst:.3g} > {bound:.3g} (tol {tol:.3g} x max|ref|)"


def assert_output_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The two-tier output tolerance explained at the top of this module."""
    ulp_bound = 2 * ULP[ref.dtype] + 1e-6
    assert_close_relative(out, ref, ulp_bound + FP8_FLIP, "output")
    if ref.numel():
        err = (out.float() - ref.float()).abs() / ref.float().abs().max()
        within = (err <= ulp_bound).float().mean().item()
        assert within >= BULK_FRACTION, (
            f"output: only {within:.1%} of elements within {ulp_bound:.3g} x max|ref| (need {BULK_FRACTION:.0%})"
        )


def check_parity(case: Case) -> None:
    """Op vs reference: the output, the updated rows, and every other cache byte."""
    dtype = case.q.dtype
    before = case.cache.blocks.clone()
    ref_out, ref_blocks = run_reference(case)
    out = run_op_poisoned(case)
    assert_output_close(out, ref_out)

    after = case.cache.blocks
    touched = torch.zeros(after.shape[:-1], dtype=torch.bool)
    page_size = case.cache.page_size
    for b, pos in case.new_positions():
        page = case.cache.pages_of(b)[pos // page_size]
        touched[page, 0, case.layer_idx, pos % page_size, 0] = True
    # The new rows of this layer: as the reference rotated and normalized them.
    assert_close_relative(after[touched], ref_blocks[touched], CACHE_TOLERANCE[dtype], "updated cache rows")
    assert not torch.equal(after[touched], before[touched]) or not touched.any(), "new rows were not updated"
    # Everything else: byte-identical to before the call.
    assert torch.equal(after[~touched].view(torch.uint8), before[~touched].view(torch.uint8)), (
        "cache bytes outside the new rows changed"
    )

