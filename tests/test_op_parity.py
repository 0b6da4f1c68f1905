"""The fused Mojo op against the torch reference: outputs and cache, over the whole option grid.

One compiled model per dtype serves every case (options are runtime inputs),
so the grid costs three compiles. Every test runs on the CPU and, where
torch sees a CUDA GPU, on it too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers import DEVICES, check_parity, make_case

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GRANULARITIES = ("blockwise", "per_channel", "per_tensor")
MASKS = ("null", "causal", "sliding_window_causal", "chunked_causal")
SCORE_MODS = ("no_pos", "alibi_pos")
HEADS = (1, 16, 128)
PAGE_SIZES = (1, 16, 64, 128)

GRID = list(itertools.product(DTYPES, GRANULARITIES, MASKS, SCORE_MODS))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dtype", "granularity", "mask", "score_mod"),
    GRID,
    ids=[f"{str(d)[6:]}-{g}-{m}-{s}" for d, g, m, s in GRID],
)
def test_grid(dtype, granularity, mask, score_mod, device):
    """Every option combination; heads, page size and batch shape vary across the grid."""
    i = GRID.index((dtype, granularity, mask, score_mod))
    g = torch.Generator().manual_seed(1000 + i)
    num_requests = 1 + i % 4
    case = make_case(
        1000 + i,
        dtype=dtype,
        num_heads=HEADS[i % 3],
        page_size=PAGE_SIZES[(i // 3) % 4],
        cache_lengths=tuple(int(v) for v in torch.randint(0, 150, (num_requests,), generator=g)),
        new_tokens=tuple(int(v) for v in torch.randint(1, 5, (num_requests,), generator=g)),
        num_layers=1 + i % 3,
        layer_idx=i % (1 + i % 3),
        granularity=granularity,
        mask=mask,
        score_mod=score_mod,
        local_window_size=int(torch.randint(1, 40, (1,), generator=g)),
    )
    check_parity(case, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads", HEADS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_heads_and_page_sizes(num_heads, page_size, device):
    case = make_case(
        2000 + num_heads + page_size,
        num_heads=num_heads,
        page_size=page_size,
        cache_lengths=(130, 1, 0, 64),
        new_tokens=(1, 4, 2, 1),
        num_layers=3,
        layer_idx=2,
    )
    check_parity(case, device)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_caches_only_new_tokens(device):
    """Requests whose cache holds nothing but the new tokens."""
    check_parity(make_case(3001, cache_lengths=(0, 0, 0), new_tokens=(1, 3, 2)), device)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_token_request_in_batch(device):
    """A request with no new tokens in the middle of the batch is skipped, its cache untouched."""
    check_parity(make_case(3002, cache_lengths=(12, 50, 7), new_tokens=(2, 0, 1)), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_context_uses_partitions(dtype, device):
    """Contexts long enough to split into several key partitions and merge them."""
    case = make_case(
        3003,
        dtype=dtype,
        num_heads=16,
        page_size=64,
        cache_lengths=(4000,),
        new_tokens=(2,),
        num_layers=1,
        layer_idx=0,
        mask="causal",
        score_mod="alibi_pos",
    )
    check_parity(case, device)


@pytest.mark.parametrize("device", DEVICES)
def test_many_requests_mixed_lengths(device):
    g = torch.Generator().manual_seed(3004)
    lengths = tuple(int(v) for v in torch.randint(0, 700, (9,), generator=g))
    check_parity(
        make_case(
            3004, cache_lengths=lengths, new_tokens=(1, 2, 1, 3, 1, 1, 4, 1, 2), page_size=64
        ),
        device,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_other_head_dims(device):
    """Sizes are runtime values: a smaller MLA (rank 256, nope 64, rope 32, v 64) works too."""
    check_parity(
        make_case(
            3005,
            kv_lora_rank=256,
            nope_dim=64,
            rope_dim=32,
            v_head_dim=64,
            num_heads=4,
            granularity=(1, 64, 32),
        ),
        device,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_calls_reuse_the_model_and_stay_in_parity(device):
    """Two decode steps in a row: the second sees the first's rotated rows as ordinary cache."""
    case = make_case(3006, cache_lengths=(3, 20), new_tokens=(1, 1), num_layers=1, layer_idx=0)
    check_parity(case, device)
    case.cache.advance()
    g = torch.Generator().manual_seed(3007)
    for b in range(2):
        case.cache.append(b, 0, torch.randn(1, 576, generator=g))
    case.q = torch.randn_like(case.q.float(), dtype=torch.float32).to(case.q.dtype)
    check_parity(case, device)
