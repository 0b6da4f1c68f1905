"""PagedLatentCache: every method checks first, and a refusal changes nothing.

A refused call raises TypeError (type or dtype) or ValueError (value, or too
few free pages) naming the argument, and leaves the blocks' bytes, the
tables, the lengths, the pending counts, the free pages (in order) and the
per-layer step bookkeeping exactly as they were (tests/helpers.py's snapshot).
"""

from __future__ import annotations

import ctypes
import mmap
import pathlib
import re

import pytest
import torch

import pymla
from pymla import host_memory
from pymla.cache import UNUSED_PAGE

from helpers import assert_cache_unchanged, cache_snapshot

HEAD_DIM = 576


def exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def rows(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, HEAD_DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


def small_cache(**kw) -> pymla.PagedLatentCache:
    """4 pages of 16 tokens, 2 layers, float32; request 0 with 20 cached tokens (2 pages)."""
    params = dict(num_blocks=4, page_size=16, num_layers=2, dtype=torch.float32)
    params.update(kw)
    cache = pymla.PagedLatentCache(**params)
    cache.blocks.normal_(generator=torch.Generator().manual_seed(1))  # every byte known
    cache.fill(cache.add_request(), 20, generator=torch.Generator().manual_seed(2))
    return cache


def assert_refused(cache, call, error, message: str) -> None:
    before = cache_snapshot(cache)
    with pytest.raises(error, match=exact(message)):
        call()
    assert_cache_unchanged(cache, before)


# ---------------------------------------------------------------- capacity


def test_append_past_capacity_records_nothing():
    """The user's report: the refused append left a pending token, so advance() made 33 of 32."""
    cache = pymla.PagedLatentCache(num_blocks=2, page_size=16, dtype=torch.float32)
    cache.fill(cache.add_request(), 32)
    assert_refused(
        cache,
        lambda: cache.append(0, 0, rows(1)),
        ValueError,
        "request 0: needs 1 more page of 16 tokens for 33 tokens, 0 free (num_blocks=2)",
    )
    cache.advance()
    assert cache.length(0) == 32 and cache.cache_lengths.tolist() == [32]


@pytest.mark.parametrize("method", ["fill", "reserve"])
def test_fill_or_reserve_past_capacity_keeps_no_pages(method):
    """A refused request takes no page, so the next one still gets the whole pool."""
    cache = pymla.PagedLatentCache(num_blocks=4, page_size=16, dtype=torch.float32)
    a, b = cache.add_request(), cache.add_request()
    assert_refused(
        cache,
        lambda: getattr(cache, method)(a, 100),
        ValueError,
        "request 0: needs 7 more pages of 16 tokens for 100 tokens, 4 free (num_blocks=4)",
    )
    getattr(cache, method)(b, 64)
    assert len(cache.pages_of(b)) == 4 and cache.num_free_pages == 0


def test_append_counts_pages_already_owned():
    cache = small_cache()  # 20 tokens in 2 pages: 12 free slots, then 2 free pages
    cache.append(0, 0, rows(12))
    assert len(cache.pages_of(0)) == 2 and cache.num_free_pages == 2
    cache.advance()
    assert_refused(
        cache,
        lambda: cache.reserve(0, 33),
        ValueError,
        "request 0: needs 3 more pages of 16 tokens for 65 tokens, 2 free (num_blocks=4)",
    )


# ---------------------------------------------------------------- request, layer and counts

REQUEST_CALLS = {
    "append": lambda c, r: c.append(r, 0, rows(1)),
    "reserve": lambda c, r: c.reserve(r, 1),
    "fill": lambda c, r: c.fill(r, 1),
    "write": lambda c, r: c.write(r, 0, 0, rows(1)),
    "rows": lambda c, r: c.rows(r, 0),
    "pages_of": lambda c, r: c.pages_of(r),
    "length": lambda c, r: c.length(r),
    "pending": lambda c, r: c.pending(r),
    "release": lambda c, r: c.release(r),
    "new_rows_state": lambda c, r: c.new_rows_state(r, 0),
}


@pytest.mark.parametrize("method", list(REQUEST_CALLS))
@pytest.mark.parametrize(
    ("request_", "error", "message"),
    [
        (7, ValueError, "request: expected 0 <= request < 1, got 7"),
        (1, ValueError, "request: expected 0 <= request < 1, got 1"),
        (-1, ValueError, "request: expected 0 <= request < 1, got -1"),
        (True, TypeError, "request: expected an int, got bool"),
        (0.0, TypeError, "request: expected an int, got float"),
        ("0", TypeError, "request: expected an int, got str"),
    ],
    ids=["7", "1", "-1", "bool", "float", "str"],
)
def test_request_index_is_checked(method, request_, error, message):
    cache = small_cache()
    assert_refused(cache, lambda: REQUEST_CALLS[method](cache, request_), error, message)


LAYER_CALLS = {
    "append": lambda c, layer: c.append(0, layer, rows(1)),
    "write": lambda c, layer: c.write(0, layer, 0, rows(1)),
    "rows": lambda c, layer: c.rows(0, layer),
    "new_rows_state": lambda c, layer: c.new_rows_state(0, layer),
}


@pytest.mark.parametrize("method", list(LAYER_CALLS))
@pytest.mark.parametrize(
    ("layer", "error", "message"),
    [
        (2, ValueError, "layer: expected 0 <= layer < 2, got 2"),
        (-1, ValueError, "layer: expected 0 <= layer < 2, got -1"),
        (False, TypeError, "layer: expected an int, got bool"),
        (1.0, TypeError, "layer: expected an int, got float"),
    ],
    ids=["2", "-1", "bool", "float"],
)
def test_layer_is_checked(method, layer, error, message):
    cache = small_cache()
    assert_refused(cache, lambda: LAYER_CALLS[method](cache, layer), error, message)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda c: c.fill(0, -1), ValueError, "num_tokens: expected an int >= 0, got -1"),
        (lambda c: c.fill(0, 2.5), TypeError, "num_tokens: expected an int, got float"),
        (lambda c: c.fill(0, True), TypeError, "num_tokens: expected an int, got bool"),
        (lambda c: c.reserve(0, -2), ValueError, "n: expected an int >= 0, got -2"),
        (lambda c: c.reserve(0, 1.0), TypeError, "n: expected an int, got float"),
        (
            lambda c: c.fill(0, 1, generator=3),
            TypeError,
            "generator: expected a torch.Generator or None, got int",
        ),
    ],
    ids=["fill-negative", "fill-float", "fill-bool", "reserve-negative", "reserve-float",
         "generator-int"],
)  # fmt: skip
def test_counts_and_generators_are_checked(call, error, message):
    cache = small_cache()
    assert_refused(cache, lambda: call(cache), error, message)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA generator")
def test_fill_draws_rows_from_a_cpu_generator_only():
    cache = small_cache()
    assert_refused(
        cache,
        lambda: cache.fill(0, 1, generator=torch.Generator(device="cuda")),
        ValueError,
        "generator: expected a CPU torch.Generator, got one on cuda",
    )


# ---------------------------------------------------------------- rows


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ([[0.0] * HEAD_DIM], TypeError, "rows: expected a torch.Tensor, got list"),
        (
            torch.zeros(1, HEAD_DIM, dtype=torch.int64),
            TypeError,
            "rows: expected a floating-point dtype, got torch.int64",
        ),
        (torch.zeros(HEAD_DIM), ValueError, "rows: expected shape [n, 576], got (576,)"),
        (torch.zeros(2, 575), ValueError, "rows: expected shape [n, 576], got (2, 575)"),
        (torch.zeros(1, 1, HEAD_DIM), ValueError, "rows: expected shape [n, 576], got (1, 1, 576)"),
    ],
    ids=["list", "int64", "rank-1", "width", "rank-3"],
)
@pytest.mark.parametrize("method", ["append", "write"])
def test_rows_are_checked(method, bad, error, message):
    cache = small_cache()
    call = {"append": lambda: cache.append(0, 1, bad), "write": lambda: cache.write(0, 1, 0, bad)}
    assert_refused(cache, call[method], error, message)


def test_append_takes_any_floating_dtype():
    cache = small_cache(dtype=torch.bfloat16)
    new = rows(3, seed=5, dtype=torch.float64)
    cache.append(0, 1, new)
    assert torch.equal(cache.rows(0, 1, 20, 23), new.to(torch.bfloat16))
    assert cache.new_rows_state(0, 1) == "raw" and cache.new_rows_state(0, 0) == "none"


def test_layers_of_a_step_must_bring_the_same_number_of_rows():
    cache = small_cache()
    cache.append(0, 0, rows(2))
    assert_refused(
        cache,
        lambda: cache.append(0, 1, rows(1)),
        ValueError,
        "rows: expected 2 tokens (request 0 already has 2 pending tokens this step), got 1",
    )
    assert_refused(
        cache,
        lambda: cache.reserve(0, 3),
        ValueError,
        "n: expected 2 tokens (request 0 already has 2 pending tokens this step), got 3",
    )


def test_write_stays_inside_the_pages_the_request_owns():
    cache = small_cache()  # 2 pages: positions 0 .. 31
    cache.write(0, 0, 30, rows(2, seed=3))
    assert torch.equal(cache.blocks[cache.pages_of(0)[1], 0, 0, 14:16, 0], rows(2, seed=3))
    assert_refused(
        cache,
        lambda: cache.write(0, 0, 30, rows(3)),
        ValueError,
        "start: expected start + 3 rows <= 32 (the 2 pages of 16 tokens request 0 owns), "
        "got 30 + 3 = 33",
    )
    assert_refused(
        cache,
        lambda: cache.write(0, 0, -1, rows(1)),
        ValueError,
        "start: expected an int >= 0, got -1",
    )


@pytest.mark.parametrize(
    ("start", "stop", "message"),
    [
        (
            -1,
            None,
            "start: expected 0 <= start <= 20 (request 0's cached + pending tokens), got -1",
        ),
        (
            21,
            None,
            "start: expected 0 <= start <= 20 (request 0's cached + pending tokens), got 21",
        ),
        (5, 21, "stop: expected 5 <= stop <= 20 (request 0's cached + pending tokens), got 21"),
        (5, 4, "stop: expected 5 <= stop <= 20 (request 0's cached + pending tokens), got 4"),
    ],
)
def test_rows_reads_only_written_positions(start, stop, message):
    cache = small_cache()
    assert cache.rows(0, 0, 5, 20).shape == (15, HEAD_DIM)
    assert_refused(cache, lambda: cache.rows(0, 0, start, stop), ValueError, message)


def test_fill_is_refused_during_a_step():
    cache = small_cache()
    cache.append(0, 0, rows(1))
    assert_refused(
        cache,
        lambda: cache.fill(0, 4),
        ValueError,
        "request 0: expected no pending tokens to fill it (fill adds completed tokens: call "
        "advance() first), got 1",
    )


# ---------------------------------------------------------------- constructor

CONSTRUCTOR_ERRORS = [
    ({"page_size": 16.5}, TypeError, "page_size: expected an int, got float"),
    ({"page_size": 16.0}, TypeError, "page_size: expected an int, got float"),
    ({"page_size": 0}, ValueError, "page_size: expected an int >= 1, got 0"),
    ({"num_blocks": True}, TypeError, "num_blocks: expected an int, got bool"),
    ({"num_blocks": -3}, ValueError, "num_blocks: expected an int >= 1, got -3"),
    ({"num_layers": 0}, ValueError, "num_layers: expected an int >= 1, got 0"),
    ({"num_layers": "2"}, TypeError, "num_layers: expected an int, got str"),
    ({"kv_lora_rank": 0}, ValueError, "kv_lora_rank: expected an int >= 1, got 0"),
    ({"kv_lora_rank": 512.0}, TypeError, "kv_lora_rank: expected an int, got float"),
    ({"qk_rope_head_dim": 0}, ValueError, "qk_rope_head_dim: expected an int >= 2, got 0"),
    (
        {"qk_rope_head_dim": 63},
        ValueError,
        "qk_rope_head_dim: expected an even int (RoPE rotates pairs), got 63",
    ),
    (
        {"dtype": torch.int8},
        TypeError,
        "dtype: expected one of torch.bfloat16, torch.float16, torch.float32, got torch.int8",
    ),
    (
        {"dtype": torch.float64},
        TypeError,
        "dtype: expected one of torch.bfloat16, torch.float16, torch.float32, got torch.float64",
    ),
    (
        {"dtype": "bfloat16"},
        TypeError,
        "dtype: expected one of torch.bfloat16, torch.float16, torch.float32, got str",
    ),
    (
        {"device": "gpu"},
        ValueError,
        "device: expected a device name such as 'cpu' or 'cuda:0', got 'gpu'",
    ),
    (
        {"device": 0},
        TypeError,
        "device: expected a torch.device or a device name such as 'cpu' or 'cuda:0', got int",
    ),
    ({"shuffle_pages": 1}, TypeError, "shuffle_pages: expected a bool, got int"),
    ({"generator": 7}, TypeError, "generator: expected a torch.Generator or None, got int"),
]


@pytest.mark.parametrize(
    ("change", "error", "message"),
    CONSTRUCTOR_ERRORS,
    ids=[f"{next(iter(c))}={next(iter(c.values()))!r}" for c, _, _ in CONSTRUCTOR_ERRORS],
)
def test_constructor_checks_its_arguments(change, error, message):
    args = {"num_blocks": 4, "page_size": 16, **change}
    with pytest.raises(error, match=exact(message)):
        pymla.PagedLatentCache(**args)


def test_constructor_refuses_a_cuda_device_torch_does_not_see():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=exact(
        f"device: expected a CUDA device this torch sees ({count} found), got cuda:{count}"
    )):  # fmt: skip
        pymla.PagedLatentCache(num_blocks=4, page_size=16, device=f"cuda:{count}")


def test_constructor_takes_numpy_ints_and_the_three_dtypes():
    import numpy as np

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cache = pymla.PagedLatentCache(
            num_blocks=np.int64(3), page_size=np.int32(5), dtype=dtype, qk_rope_head_dim=2
        )
        assert cache.blocks.shape == (3, 1, 1, 5, 1, 514) and cache.dtype == dtype


# ---------------------------------------------------------------- release


def test_release_returns_the_pages_and_keeps_indices():
    cache = pymla.PagedLatentCache(num_blocks=6, page_size=4, num_layers=2, dtype=torch.float32)
    a, b, c = (cache.add_request() for _ in range(3))
    for request, n in ((a, 5), (b, 9), (c, 2)):
        cache.fill(request, n)
    pages_a, pages_c = cache.pages_of(a), cache.pages_of(c)
    freed = cache.pages_of(b)
    rows_c = cache.rows(c, 1)
    assert cache.num_free_pages == 0

    cache.release(b)
    assert cache.num_requests == 3 and cache.num_free_pages == 3
    assert (cache.length(b), cache.pending(b), cache.pages_of(b)) == (0, 0, [])
    assert cache.pages_of(a) == pages_a and cache.pages_of(c) == pages_c
    assert cache.cache_lengths.tolist() == [5, 0, 2]
    table = cache.lookup_table.to(torch.int64)
    assert table[b].tolist() == [UNUSED_PAGE] * table.shape[1]
    assert torch.equal(cache.rows(c, 1), rows_c)

    # The freed pages serve the next request that grows, first page first.
    cache.append(c, 0, rows(8))
    assert cache.pages_of(c) == pages_c + freed[:2]
    cache.append(c, 1, rows(8, seed=1))
    cache.advance()
    cache.fill(b, 4)  # the released request starts a new sequence in its slot
    assert cache.pages_of(b) == freed[2:] and cache.length(b) == 4


def test_release_is_refused_during_a_step():
    cache = small_cache()
    cache.reserve(0, 2)
    assert_refused(
        cache,
        lambda: cache.release(0),
        ValueError,
        "request 0: expected no pending tokens to release it (a step is under way: call "
        "advance() first), got 2",
    )
    cache.advance()
    cache.release(0)
    assert cache.num_free_pages == 4


# ---------------------------------------------------------------- step bookkeeping and to()


def test_new_rows_state_follows_append_and_advance():
    cache = small_cache()
    assert cache.new_rows_state(0, 0) == "none"
    cache.reserve(0, 1)
    assert cache.new_rows_state(0, 0) == "none"  # reserved slots hold no rows yet
    cache.append(0, 0, rows(1))
    assert [cache.new_rows_state(0, layer) for layer in (0, 1)] == ["raw", "none"]
    cache.advance()
    assert cache.new_rows_state(0, 0) == "none" and cache.length(0) == 21


def test_to_returns_the_cache_and_checks_the_device():
    cache = small_cache()
    cache.append(0, 1, rows(1))
    assert cache.to("cpu") is cache
    assert cache.new_rows_state(0, 1) == "raw" and cache.pending(0) == 1
    assert_refused(
        cache,
        lambda: cache.to("gpu"),
        ValueError,
        "device: expected a device name such as 'cpu' or 'cuda:0', got 'gpu'",
    )
    assert_refused(
        cache,
        lambda: cache.to(None),
        TypeError,
        "device: expected a torch.device or a device name such as 'cpu' or 'cuda:0', got NoneType",
    )


def _anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping of this process holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


THP_MODE = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
    reason="this Linux gives no transparent huge pages",
)
def test_cpu_cache_blocks_sit_on_huge_pages():
    """The blocks are advised onto 2 MiB pages before they are zeroed (pymla.host_memory): in
    Linux's default `madvise` mode, without the advice they stay on 4 KiB pages. 40.5 MiB: past
    glibc's largest mmap threshold (32 MiB), so a fresh mapping, not reused heap memory."""
    cache = pymla.PagedLatentCache(num_blocks=576, page_size=64, dtype=torch.bfloat16)
    nbytes = cache.blocks.numel() * cache.blocks.element_size()
    if _anon_huge_bytes(cache.blocks.data_ptr() + nbytes // 2) < host_memory.HUGE_PAGE:
        # Fails only where Linux does give huge pages to a fresh mapping advised the same way.
        region = mmap.mmap(
            -1, 8 * host_memory.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        region.madvise(mmap.MADV_HUGEPAGE)
        region.write(b"x" * len(region))
        control = ctypes.addressof(ctypes.c_char.from_buffer(region))
        if _anon_huge_bytes(control + 4 * host_memory.HUGE_PAGE) < host_memory.HUGE_PAGE:
            pytest.skip(
                "Linux gave no huge page to a fresh advised mapping either (fragmented memory)"
            )
        pytest.fail(
            "the cache's blocks are on 4 KiB pages where an advised mapping gets huge pages"
        )
    assert not cache.blocks.any()


def test_host_zeros_are_zeros_of_every_size():
    for shape in ((3, 5), (2, host_memory.HUGE_PAGE + 7)):
        t = host_memory.zeros(*shape, dtype=torch.uint8, device=torch.device("cpu"))
        assert t.shape == shape and t.dtype == torch.uint8 and not t.any()
