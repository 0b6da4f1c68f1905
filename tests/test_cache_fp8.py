"""PagedLatentCache with cache_format="fp8_ds_mla": storage, methods and refusals."""

from __future__ import annotations

import pytest
import torch

import pymla
from pymla import cache_format as cf

from helpers import assert_cache_unchanged, cache_snapshot


def fp8_cache(**kw) -> pymla.PagedLatentCache:
    """6 pages of 16 tokens, 2 layers; every byte random; request 0 with 20 cached tokens."""
    params = dict(num_blocks=6, page_size=16, num_layers=2, cache_format="fp8_ds_mla")
    params.update(kw)
    cache = pymla.PagedLatentCache(**params)
    g = torch.Generator().manual_seed(1)
    cache.blocks.copy_(torch.randint(0, 256, cache.blocks.shape, generator=g, dtype=torch.uint8))
    cache.fill(cache.add_request(), 20, generator=torch.Generator().manual_seed(2))
    return cache


def raw_rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 576, generator=torch.Generator().manual_seed(seed)) * 3


def test_storage_is_656_bytes_per_row():
    cache = fp8_cache()
    assert cache.cache_format == "fp8_ds_mla"
    assert cache.blocks.dtype == torch.uint8 and cache.blocks.shape == (6, 1, 2, 16, 1, 656)
    assert cache.dtype == torch.bfloat16 and cache.head_dim == 576
    plain = pymla.PagedLatentCache(num_blocks=1, page_size=4)
    assert plain.cache_format == "dtype" and plain.blocks.shape[-1] == 576


def test_write_quantizes_and_rows_reads_exact_bf16_values():
    cache = fp8_cache()
    before = cache.blocks.clone()
    rows = raw_rows(5, 3)
    cache.write(0, 1, 7, rows)
    assert torch.equal(cache.stored_rows(0, 1, 7, 12), cf.quantize_rows(rows, 512))
    values = cache.rows(0, 1, 7, 12)
    assert values.dtype == torch.bfloat16
    assert torch.equal(values.float(), cf.dequantize_rows(cf.quantize_rows(rows, 512), 512))
    # every other byte as before
    changed = (cache.blocks != before).any(dim=-1)
    pages = cache.pages_of(0)
    allowed = torch.zeros_like(changed)
    for pos in range(7, 12):
        allowed[pages[pos // 16], 0, 1, pos % 16, 0] = True
    assert not (changed & ~allowed).any()


def test_fill_and_append_store_quantized_rows():
    cache = fp8_cache()
    for layer in range(2):
        latent, scales, rope = cf.split_rows(cache.stored_rows(0, layer), 512)
        assert torch.all(torch.frexp(scales)[0] == 0.5), "a fill scale is not a power of two"
        assert not torch.isnan(latent.float()).any() and not torch.isnan(rope.float()).any()
    cache.append(0, 0, raw_rows(2, 4))
    assert torch.equal(cache.stored_rows(0, 0, 20, 22), cf.quantize_rows(raw_rows(2, 4), 512))
    assert cache.new_rows_state(0, 0) == "raw"
    assert cache.to("cpu") is cache and cache.blocks.dtype == torch.uint8


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(cache_format="fp8"), ValueError, "cache_format: expected one of ('dtype', "),
        (dict(cache_format=8), TypeError, "cache_format: expected a str"),
        (dict(dtype=torch.float16), TypeError, "dtype: expected torch.bfloat16 with cache_format"),
        (dict(dtype=torch.float32), TypeError, "dtype: expected torch.bfloat16 with cache_format"),
        (dict(kv_lora_rank=100), ValueError, "kv_lora_rank: expected a multiple of 128 with"),
    ],
)
def test_bad_format_arguments_are_refused(kwargs, error, message):
    params = {"num_blocks": 2, "page_size": 4, "cache_format": "fp8_ds_mla", **kwargs}
    with pytest.raises(error, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        pymla.PagedLatentCache(**params)


def test_refused_write_leaves_the_cache_untouched():
    cache = fp8_cache()
    before = cache_snapshot(cache)
    with pytest.raises(ValueError, match="^rows: expected shape"):
        cache.write(0, 0, 0, torch.randn(2, 656))
    with pytest.raises(ValueError, match="^start: expected start"):
        cache.write(0, 0, 30, raw_rows(4, 5))
    assert_cache_unchanged(cache, before)
