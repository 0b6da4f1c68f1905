"""The fused Mojo op against the torch reference: outputs and cache, over the whole option grid.

One compiled model per dtype serves every case (options are runtime inputs),
so the grid costs three compiles. Every test runs on each CPU code path this
machine has (``PYMLA_CPU_PATH``) and, where torch sees a CUDA GPU, on it too.
Each case checks the stages apart (attention output, step 6 given it, end to
end, cache rows): see ``helpers.check_parity`` and :mod:`pymla.parity`.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import pymla
from pymla import CacheShard, merge_attention_states, reference
from pymla.parity import compare_attention, compare_cache, compare_projection
from pymla.tools.scenario import reference_stages

from helpers import TARGETS, check_parity, lse_report, make_case, on_target, run_op_poisoned

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GRANULARITIES = ("blockwise", "per_channel", "per_tensor")
MASKS = ("null", "causal", "sliding_window_causal", "chunked_causal")
SCORE_MODS = ("no_pos", "alibi_pos")
HEADS = (1, 16, 128)
PAGE_SIZES = (1, 16, 64, 128)
WINDOWED = ("sliding_window_causal", "chunked_causal")

GRID = list(itertools.product(DTYPES, GRANULARITIES, MASKS, SCORE_MODS))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    ("dtype", "granularity", "mask", "score_mod"),
    GRID,
    ids=[f"{str(d)[6:]}-{g}-{m}-{s}" for d, g, m, s in GRID],
)
def test_grid(dtype, granularity, mask, score_mod, target):
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
        local_window_size=int(torch.randint(1, 40, (1,), generator=g)) if mask in WINDOWED else 0,
    )
    check_parity(case, target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("num_heads", HEADS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_heads_and_page_sizes(num_heads, page_size, target):
    case = make_case(
        2000 + num_heads + page_size,
        num_heads=num_heads,
        page_size=page_size,
        cache_lengths=(130, 1, 0, 64),
        new_tokens=(1, 4, 2, 1),
        num_layers=3,
        layer_idx=2,
    )
    check_parity(case, target)


@pytest.mark.parametrize("target", TARGETS)
def test_empty_caches_only_new_tokens(target):
    """Requests whose cache holds nothing but the new tokens."""
    check_parity(make_case(3001, cache_lengths=(0, 0, 0), new_tokens=(1, 3, 2)), target)


@pytest.mark.parametrize("target", TARGETS)
def test_zero_token_request_in_batch(target):
    """A request with no new tokens in the middle of the batch is skipped, its cache untouched."""
    check_parity(make_case(3002, cache_lengths=(12, 50, 7), new_tokens=(2, 0, 1)), target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_context_uses_partitions(dtype, target):
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
    check_parity(case, target)


@pytest.mark.parametrize("target", TARGETS)
def test_many_requests_mixed_lengths(target):
    g = torch.Generator().manual_seed(3004)
    lengths = tuple(int(v) for v in torch.randint(0, 700, (9,), generator=g))
    check_parity(
        make_case(
            3004, cache_lengths=lengths, new_tokens=(1, 2, 1, 3, 1, 1, 4, 1, 2), page_size=64
        ),
        target,
    )


# Batches that mix a long request with a short or empty one. Key partitions are planned on the
# longest request, so a short one's high partitions hold no key: before
# `paged_cache.partition_keys` they started past their end and read past the request's last
# page (CPU: a segfault at [513, 0], 1 head, page 1; H200: an illegal address at [5000, 0],
# 16 heads, page 16). Cases: (cache_lengths, new_tokens, heads, page_size, dtype, mask).
MIXED = [
    ((513, 0), (1, 1), 1, 1, torch.float32, "causal"),
    ((513, 0), (1, 1), 1, 1, torch.bfloat16, "null"),
    ((1030, 2), (1, 1), 1, 1, torch.float16, "causal"),
    ((5000, 0), (2, 3), 16, 16, torch.float32, "causal"),
    ((0, 5000), (1, 1), 16, 16, torch.bfloat16, "sliding_window_causal"),
    ((5000, 5), (2, 3), 16, 16, torch.bfloat16, "causal"),
    ((4400, 0), (1, 1), 16, 16, torch.float16, "chunked_causal"),
    ((3000, 0, 17, 1), (1, 2, 0, 1), 32, 8, torch.bfloat16, "null"),
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    ("cache_lengths", "new_tokens", "num_heads", "page_size", "dtype", "mask"),
    MIXED,
    ids=[f"{c}-{n}-h{h}-p{p}-{str(d)[6:]}-{m}" for c, n, h, p, d, m in MIXED],
)
def test_long_request_beside_short_or_empty(
    cache_lengths, new_tokens, num_heads, page_size, dtype, mask, target
):
    i = MIXED.index((cache_lengths, new_tokens, num_heads, page_size, dtype, mask))
    case = make_case(
        3400 + i,
        dtype=dtype,
        num_heads=num_heads,
        page_size=page_size,
        cache_lengths=cache_lengths,
        new_tokens=new_tokens,
        num_layers=1,
        layer_idx=0,
        mask=mask,
        score_mod=("no_pos", "alibi_pos")[i % 2],
        local_window_size=300 if mask in WINDOWED else 0,
    )
    check_parity(case, target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("num_heads", (1, 2, 4, 8, 16, 32, 64, 128))
def test_every_partition_count_with_an_empty_request(num_heads, target):
    """Head counts change the partition count (CPU tasks, GPU row tiles per wave)."""
    case = make_case(
        3500 + num_heads,
        num_heads=num_heads,
        page_size=16,
        cache_lengths=(2100, 0, 3),
        new_tokens=(1, 1, 2),
        num_layers=1,
        layer_idx=0,
    )
    check_parity(case, target)


@pytest.mark.parametrize("target", TARGETS)
def test_other_head_dims(target):
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
        target,
    )


@pytest.mark.parametrize("target", TARGETS)
def test_repeated_calls_reuse_the_model_and_stay_in_parity(target):
    """Two decode steps in a row: the second sees the first's rotated rows as ordinary cache."""
    case = make_case(3006, cache_lengths=(3, 20), new_tokens=(1, 1), num_layers=1, layer_idx=0)
    check_parity(case, target)
    case.cache.advance()
    g = torch.Generator().manual_seed(3007)
    for b in range(2):
        case.cache.append(b, 0, torch.randn(1, 576, generator=g))
    case.q = torch.randn_like(case.q.float(), dtype=torch.float32).to(case.q.dtype)
    check_parity(case, target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_new_rows_given_to_the_op(dtype, target):
    """``new_rows``: the op normalizes, rotates and stores the raw rows itself (MAX's ``kv``)."""
    case = make_case(
        3100 + DTYPES.index(dtype), dtype=dtype, cache_lengths=(7, 0, 90), new_tokens=(2, 1, 3)
    )
    check_parity(case, target, via_new_rows=True)


@pytest.mark.parametrize("target", TARGETS)
def test_attention_out_leaves_the_output_unchanged(target):
    """Asking for the attention output (and its LSE) changes nothing else, bit for bit."""
    case = make_case(3200, cache_lengths=(300, 20), new_tokens=(1, 3), num_heads=16)
    blocks = case.cache.blocks.clone()
    with on_target(target) as device:
        case.to(device)
        plain = run_op_poisoned(case)
        after = case.cache.blocks.clone()
        case.cache.blocks.copy_(blocks.to(device))  # the rows as before the first run
        with_attention, _ = run_op_poisoned(case, attention=True, rerun_layers=True)
        case.cache.blocks.copy_(blocks.to(device))
        with_lse, _, _ = run_op_poisoned(case, lse=True, rerun_layers=True)
        assert torch.equal(after.view(torch.uint8), case.cache.blocks.view(torch.uint8))
    assert torch.equal(plain.view(torch.uint8), with_attention.view(torch.uint8))
    assert torch.equal(plain.view(torch.uint8), with_lse.view(torch.uint8))


def _key_range_one_short(mask, position, visible, window):
    lo, hi = ORIGINAL_KEY_RANGE(mask, position, visible, window)
    return lo, max(lo + 1, hi - 1)


ORIGINAL_KEY_RANGE = reference.key_range
MUTATIONS = {
    # The softmax scale off by 0.3%.
    "scale": lambda case: {"scale": case.options["scale"] * 1.003},
    # q and the new rows rotated at the next position.
    "rope_position": lambda case: {"freqs_cis": torch.roll(case.freqs_cis, -1, dims=0)},
    # The last key of each query's range left out: one key off by one position.
    "key_range": lambda case: {"key_range": _key_range_one_short},
}
# What each dtype's bounds can tell apart (pymla.parity explains the one gap: bf16's own
# probability rounding, 2^-8, is larger than a 0.3% scale error).
UNDETECTABLE = {(torch.bfloat16, "scale")}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_tolerance_catches_mutations(dtype, mutation, target, monkeypatch):
    """The op's attention output must fail the check against a reference made slightly wrong."""
    case = make_case(
        3300 + DTYPES.index(dtype), dtype=dtype, cache_lengths=(40, 150), new_tokens=(1, 2)
    )
    with on_target(target) as device:
        case.to(device)
        _, att = run_op_poisoned(case, attention=True)
        case.to("cpu")
    change = MUTATIONS[mutation](case)
    if "freqs_cis" in change:
        case.freqs_cis = change.pop("freqs_cis")
    stages, _ = reference_stages(case, **change)
    report = compare_attention(
        att.cpu(), stages.attention, stages.attention_magnitude, case.q.dtype
    )
    if (dtype, mutation) in UNDETECTABLE:
        assert report.max_ratio > 0.1, "the mutation should at least show"
    else:
        assert not report.passed, f"{mutation} went unnoticed: {report.describe()}"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_lse_tolerance_catches_mutations(mutation, target):
    """The op's LSE must fail the check against a reference made slightly wrong (every mutation).

    The LSE is float32 in every dtype, so bfloat16's probability rounding hides nothing here.
    """
    case = make_case(
        3350, dtype=torch.bfloat16, num_heads=32, cache_lengths=(40, 150), new_tokens=(1, 2)
    )
    good, _ = reference_stages(case)
    change = MUTATIONS[mutation](case)
    freqs = change.pop("freqs_cis", case.freqs_cis)
    wrong, _ = reference_stages(dataclasses.replace(case, freqs_cis=freqs), **change)
    with on_target(target) as device:
        case.to(device)
        _, _, lse = run_op_poisoned(case, lse=True)
        case.to("cpu")
    assert lse_report(lse.cpu(), good, torch.bfloat16).passed
    report = lse_report(lse.cpu(), wrong, torch.bfloat16)
    assert not report.passed, f"{mutation} went unnoticed: {report.describe()}"


SHARDS = [(2, 1), (3, 16), (2, 200)]  # (count, interleave): tokens, pages of 16, contiguous


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("count", "interleave"), SHARDS, ids=[f"{n}x{i}" for n, i in SHARDS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_shards_of_the_cache(dtype, count, interleave, target):
    """The op on each shard of a cache: attention, LSE and cache bytes against the reference on
    that shard (global positions for RoPE, the mask and ALiBi; rows written only where held),
    and the shards' results merged against the reference on the whole cache."""
    options = dict(
        dtype=dtype,
        num_heads=8,
        page_size=16,
        cache_lengths=(70, 3, 0, 33),
        new_tokens=(3, 2, 4, 1),
        mask="sliding_window_causal",
        # ALiBi on a shard runs on the CPU only (refused on a GPU: validate.check_shard_device).
        score_mod="alibi_pos" if target.startswith("cpu") else "no_pos",
        local_window_size=5,
    )
    whole, _ = reference_stages(make_case(3400, **options))
    atts, lses = [], []
    for rank in range(count):
        case = make_case(3400, shard=CacheShard(rank, count, interleave), **options)
        before = case.cache.blocks.clone()
        stages, ref_blocks = reference_stages(case)
        with on_target(target) as device:
            case.to(device)
            _, att, lse = run_op_poisoned(case, lse=True)
            att, lse = att.cpu(), lse.cpu()
            case.to("cpu")
        report = compare_attention(att, stages.attention, stages.attention_magnitude, dtype)
        assert report.passed, f"shard {rank}: {report.describe()}"
        lse_check = lse_report(lse, stages, dtype)
        assert lse_check.passed, f"shard {rank}: {lse_check.describe()}"
        updated = case.new_rows_mask()
        cache_report = compare_cache(before, case.cache.blocks, ref_blocks, updated)
        assert cache_report.passed, f"shard {rank} cache: {cache_report.describe()}"
        atts.append(att)
        lses.append(lse)
    assert sum(int(torch.isneginf(lse).sum()) for lse in lses) > 0, "some rows should miss a shard"
    merged, merged_lse = merge_attention_states(atts, lses)
    report = compare_attention(
        merged.to(dtype), whole.attention, whole.attention_magnitude, dtype, whole.score_magnitude
    )
    assert report.passed, f"merged: {report.describe()}"
    lse_check = lse_report(merged_lse, whole, dtype)
    assert lse_check.passed, f"merged: {lse_check.describe()}"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_step_6_alone(dtype, target):
    """``DecodePlan.project`` (first_step 6) on a given attention output: the reference's step 6
    on it, the same as the whole op's step 6 bit for bit, and the cache untouched."""
    case = make_case(3500, dtype=dtype, cache_lengths=(30, 7), new_tokens=(2, 1))
    granularity = reference.ScaleGranularity.parse(case.options["scale_granularity"])
    with on_target(target) as device:
        case.to(device)
        whole, att = run_op_poisoned(case, attention=True)
        before = case.cache.blocks.clone()
        options = {k: v for k, v in case.options.items() if k != "scale_granularity"}
        step = pymla.plan(
            case.cache, case.input_row_offsets, case.freqs_cis, pymla.DecodeOptions(**options)
        )
        weights = pymla.LayerWeights(
            *(case.weights[k] for k in ("w_uk", "w_uk_scale", "w_uv", "w_uv_scale")),  # on device
            case.kv_norm_gamma,
            granularity,
        )
        out = torch.full_like(whole, float("nan"))
        assert step.project(att, case.q, case.layer_idx, weights, out) is out
        assert torch.equal(case.cache.blocks.view(torch.uint8), before.view(torch.uint8))
        case.to("cpu")
    assert torch.equal(out.cpu().view(torch.uint8), whole.cpu().view(torch.uint8))
    w = case.weights  # back on the CPU
    expected = reference.project_output(att.cpu(), w["w_uv"], w["w_uv_scale"], granularity, dtype)
    report = compare_projection(out.cpu(), expected)
    assert report.passed, report.describe()
