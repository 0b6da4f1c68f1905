"""The DLPack bridge shares memory with torch; the paged cache puts rows where the kernel looks."""

from __future__ import annotations

import pytest
import torch

import pymla
from pymla import bridge
from pymla.cache import UNUSED_PAGE

from helpers import make_case


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.uint32, torch.int32]
)
def test_to_max_is_zero_copy(dtype):
    t = torch.zeros(4, 6, dtype=torch.float32).to(dtype)
    buf = bridge.to_max(t)
    back = bridge.to_torch(buf)
    assert back.data_ptr() == t.data_ptr()
    assert tuple(buf.shape) == (4, 6)


def test_fp8_crosses_as_its_uint8_bytes():
    w = torch.randn(3, 5).to(torch.float8_e4m3fn)
    buf = bridge.to_max(w)
    back = bridge.to_torch(buf)
    assert back.dtype == torch.uint8
    assert back.data_ptr() == w.data_ptr()
    assert torch.equal(back, w.view(torch.uint8))


def test_to_max_refuses_non_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        bridge.to_max(torch.zeros(4, 6)[:, ::2])


def test_op_updates_the_torch_cache_in_place_without_copies():
    """The op writes the new rows into the very memory torch owns: same pointer, new values."""
    case = make_case(
        501, num_heads=4, cache_lengths=(7, 30), new_tokens=(1, 2), num_layers=1, layer_idx=0
    )
    blocks = case.cache.blocks
    ptr, before = blocks.data_ptr(), blocks.clone()
    pymla.mla_decode_branch_fp8(*case.args(), **case.options)
    assert case.cache.blocks is blocks and blocks.data_ptr() == ptr
    updated = case.new_rows_mask()
    assert not torch.equal(blocks[updated], before[updated])
    assert torch.equal(blocks[~updated], before[~updated])


def test_cache_append_writes_rows_at_pending_positions_across_pages():
    g = torch.Generator().manual_seed(5)
    cache = pymla.PagedLatentCache(
        num_blocks=16,
        page_size=4,
        num_layers=2,
        dtype=torch.float32,
        shuffle_pages=True,
        generator=g,
    )
    b = cache.add_request()
    cache.fill(b, 6, generator=g)
    rows = torch.randn(3, 576, generator=g)
    cache.append(b, 1, rows)
    assert cache.length(b) == 6 and cache.pending(b) == 3
    pages = cache.pages_of(b)
    assert len(pages) == 3 and len(set(pages)) == 3  # 9 positions, 4 per page
    for i in range(3):
        pos = 6 + i
        assert torch.equal(cache.blocks[pages[pos // 4], 0, 1, pos % 4, 0], rows[i])
    assert torch.equal(cache.rows(b, 1, 6, 9), rows)
    table = cache.lookup_table.to(torch.int64)
    assert table[b, :3].tolist() == pages
    cache.advance()
    assert cache.length(b) == 9 and cache.pending(b) == 0
    assert cache.cache_lengths.tolist() == [9]


def test_cache_lookup_table_marks_unowned_pages():
    cache = pymla.PagedLatentCache(num_blocks=8, page_size=2, dtype=torch.float32)
    a, b = cache.add_request(), cache.add_request()
    cache.fill(a, 5)
    cache.fill(b, 1)
    table = cache.lookup_table.to(torch.int64)
    assert table.shape == (2, 3)
    assert table[1, 1:].tolist() == [UNUSED_PAGE, UNUSED_PAGE]
