"""The fp8_ds_mla row format of pymla.cache_format: layout and quantization rule, in torch."""

from __future__ import annotations

import pytest
import torch

from pymla import cache_format as cf
from pymla.reference import Batch, KVCacheTensors, attend


def _e4m3_values() -> torch.Tensor:
    """Every finite non-negative e4m3 value, ascending (from the 127 bytes 0x00..0x7e)."""
    return torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _nearest_even_e4m3(x: torch.Tensor) -> torch.Tensor:
    """e4m3 rounding by brute force: the nearest finite value, ties to the even byte."""
    grid = _e4m3_values()
    mag = x.abs()[:, None]
    dist = (grid[None, :] - mag).abs()
    best = dist.min(dim=1, keepdim=True).values
    ties = dist == best
    idx = torch.arange(grid.numel()).expand_as(dist)
    # among ties, the even byte (mantissa lsb 0)
    even = ties & (idx % 2 == 0)
    pick = torch.where(
        even.any(dim=1), (even * (idx + 1)).amax(dim=1) - 1, ties.int().argmax(dim=1)
    )
    return grid[pick] * x.sign()


def _rows(seed: int, n: int = 6, rank: int = 512, rope: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, rank + rope, generator=g)
    # blocks of very different magnitudes, as RMSNorm * gamma can give
    rows[:, :rank] *= torch.logspace(-6, 6, rank // 128).repeat_interleave(128)
    return rows


def test_scales_are_the_smallest_powers_of_two_that_fit():
    rows = _rows(1)
    latent = rows[:, :512].to(torch.bfloat16).float()
    scales = cf.block_scales(latent)
    mantissa, _ = torch.frexp(scales)
    assert torch.all(mantissa == 0.5), "a scale is not a power of two"
    amax = latent.unflatten(-1, (-1, 128)).abs().amax(-1)
    assert torch.all(amax <= 448 * scales)
    assert torch.all(amax > 224 * scales), "a smaller power of two would fit"
    # boundaries: 448 * 2^e fits scale 2^e exactly; one bf16 step above takes 2^(e+1)
    edge = torch.tensor([448.0, 449.0, 1.0, 0.875, 2.0**-20 * 448]).repeat_interleave(128)
    assert cf.block_scales(edge[None, :]).tolist() == [[1.0, 2.0, 2.0**-8, 2.0**-9, 2.0**-20]]


def test_zero_block_gets_scale_one_and_zero_bytes():
    rows = _rows(2)
    rows[0, 128:256] = 0
    raw = cf.quantize_rows(rows, 512)
    latent, scales, _ = cf.split_rows(raw, 512)
    assert scales[0, 1].item() == 1.0
    assert torch.all(raw[0, 128:256] == 0)
    assert torch.all(cf.dequantize_rows(raw, 512)[0, 128:256] == 0)


def test_layout_656_bytes_latent_scales_rope():
    rows = _rows(3)
    raw = cf.quantize_rows(rows, 512)
    assert raw.dtype == torch.uint8 and raw.shape == (6, 656) == (6, cf.fp8_row_bytes(512, 64))
    bf16 = rows.to(torch.bfloat16)
    scales = cf.block_scales(bf16[:, :512].float())
    assert torch.equal(raw[:, 512:528], scales.contiguous().view(torch.uint8))
    assert torch.equal(raw[:, 528:], bf16[:, 512:].contiguous().view(torch.uint8))
    q = (bf16[:, :512].float() / scales.repeat_interleave(128, -1)).to(torch.float8_e4m3fn)
    assert torch.equal(raw[:, :512], q.view(torch.uint8))
    assert cf.fp8_kv_lora_rank(656, 64) == 512
    assert cf.fp8_kv_lora_rank(655, 64) is None and cf.fp8_kv_lora_rank(576, 64) is None


def test_e4m3_rounding_is_nearest_even():
    """Every e4m3 value, every midpoint between neighbours (ties) and points around them."""
    grid = _e4m3_values()
    mids = (grid[1:] + grid[:-1]) / 2
    probes = torch.cat([grid, mids, mids * (1 + 2**-12), mids * (1 - 2**-12)])
    probes = torch.cat([probes, -probes])
    ours = probes.to(torch.float8_e4m3fn).float()
    assert torch.equal(ours, _nearest_even_e4m3(probes))
    # and the rule's quantized values are those of rne(x / scale)
    rows = _rows(4)
    latent = rows[:, :512].to(torch.bfloat16).float()
    scaled = latent / cf.block_scales(latent).repeat_interleave(128, -1)
    q, _, _ = cf.split_rows(cf.quantize_rows(rows, 512), 512)
    assert torch.equal(q.float().flatten(), _nearest_even_e4m3(scaled.flatten()))


def test_dequantized_values_are_exact_bf16_values_within_half_a_step():
    rows = _rows(5, n=64)
    values = cf.dequantize_rows(cf.quantize_rows(rows, 512), 512)
    assert torch.equal(values, values.to(torch.bfloat16).float()), "not exactly bf16"
    latent = rows[:, :512].to(torch.bfloat16).float()
    scale = cf.block_scales(latent).repeat_interleave(128, -1)
    # half an e4m3 step: 2^-4 relative in the normal range, 2^-10 * scale below it
    err = (values[:, :512] - latent).abs()
    assert torch.all(err <= torch.maximum(latent.abs() * 2**-4, scale * 2**-10))
    assert torch.equal(values[:, 512:], rows[:, 512:].to(torch.bfloat16).float())


def test_one_huge_value_sets_the_block_scale():
    rows = _rows(6)
    rows[:, :128] = torch.randn(6, 128, generator=torch.Generator().manual_seed(7)) * 1e-3
    rows[:, 5] = 3.0e4
    values = cf.dequantize_rows(cf.quantize_rows(rows, 512), 512)
    latent = rows[:, :128].to(torch.bfloat16).float()
    # bf16(30000) = 29952 = 234 * 2^7; e4m3 steps of 16 in [128, 256): 240 * 2^7
    assert torch.all(latent[:, 5] == 29952) and torch.all(values[:, 5] == 240 * 2**7)
    _, scales, _ = cf.split_rows(cf.quantize_rows(rows, 512), 512)
    assert torch.all(scales[:, 0] == 2.0**7)
    # the small values of the block fall below e4m3's range at that scale: zero or subnormal
    assert torch.all((values[:, :128] - latent).abs()[:, 6:] <= 2.0**-10 * 2**7)


def test_rank_not_a_multiple_of_128_is_refused():
    with pytest.raises(ValueError, match="kv_lora_rank: expected a multiple of 128"):
        cf.quantize_rows(torch.randn(2, 100 + 64), 100)


def test_reference_attention_on_fp8_rows_is_the_bf16_computation_on_their_values():
    """Step 5 of the reference on fp8 rows equals step 5 on a bf16 cache of the dequantized rows."""
    g = torch.Generator().manual_seed(8)
    rows = torch.randn(2, 1, 1, 16, 1, 576, generator=g)
    fp8 = cf.quantize_rows(rows, 512)
    bf16 = cf.dequantize_rows(fp8, 512).to(torch.bfloat16)
    lengths, table = (
        torch.tensor([20], dtype=torch.uint32),
        torch.tensor([[1, 0]], dtype=torch.uint32),
    )
    q_full = torch.randn(3, 4, 576, generator=g).to(torch.bfloat16).float()
    batch = Batch.of(torch.tensor([0, 3]), lengths)
    kw = dict(scale=0.1, mask="causal", score_mod="alibi_pos", local_window_size=0)
    a = attend(q_full, KVCacheTensors(fp8, lengths, table), batch, 0, 512, **kw)
    b = attend(q_full, KVCacheTensors(bf16, lengths, table), batch, 0, 512, **kw)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_scales_are_deepseeks_ue8m0_scales_for_every_bf16_amax():
    """``fast_pow2(fast_log2_ceil(amax / 448))`` of DeepSeek's reference, on float32 bits."""
    bits = torch.arange(0x0080, 0x7F80, dtype=torch.int32).to(torch.int16)  # normal, finite
    amax = bits.view(torch.bfloat16).float()
    quotient = (amax / 448).view(torch.int32)
    exponent = ((quotient >> 23) & 0xFF) - 127 + ((quotient & 0x7FFFFF) != 0).int()
    ue8m0 = torch.ldexp(torch.ones_like(amax), exponent)
    # where the formula holds (a normal quotient) and the scale is in the module's range
    keep = (((quotient >> 23) & 0xFF) > 0) & (exponent <= 119)
    blocks = torch.zeros(amax.numel(), 128)
    blocks[:, 0] = amax
    assert torch.equal(cf.block_scales(blocks)[:, 0][keep], ue8m0[keep])
