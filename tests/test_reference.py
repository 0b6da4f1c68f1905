"""The torch reference against independent formulations, so that parity with it means something."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pymla import quant
from pymla.reference import (
    KVCacheTensors,
    alibi_slopes,
    key_range,
    mla_decode_branch_fp8_reference,
    rms_norm,
    rope_interleaved,
)
from pymla.tools.scenario import reference_stages

from helpers import make_case


def test_rope_matches_complex_rotation():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 64, generator=g)
    angles = torch.rand(5, 1, 32, generator=g) * 6.3
    freqs = torch.stack([angles.cos(), angles.sin()], dim=-1).reshape(5, 1, 64)
    expected = torch.view_as_real(
        torch.view_as_complex(x.reshape(5, 3, 32, 2)) * torch.polar(torch.ones_like(angles), angles)
    ).reshape(5, 3, 64)
    torch.testing.assert_close(rope_interleaved(x, freqs), expected, rtol=1e-5, atol=1e-5)


def test_rms_norm_matches_torch():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 512, generator=g) * 3
    gamma = torch.randn(512, generator=g)
    expected = F.rms_norm(x, (512,), weight=gamma, eps=1e-5)
    torch.testing.assert_close(rms_norm(x, gamma, 1e-5), expected, rtol=1e-5, atol=1e-5)


def test_alibi_slopes_known_values():
    # Press et al.: 8 heads -> 1/2, 1/4, ..., 1/256.
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]))
    # 12 heads: the 8 slopes of 8 heads, then the odd slopes of 16 heads.
    expected = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 * (2 * i + 1)) for i in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected))


@pytest.mark.parametrize(
    ("mask", "position", "visible", "window", "expected"),
    [
        ("null", 7, 9, 0, (0, 9)),
        ("causal", 7, 9, 0, (0, 8)),
        ("sliding_window_causal", 7, 9, 3, (5, 8)),
        ("sliding_window_causal", 1, 9, 3, (0, 2)),
        ("chunked_causal", 7, 9, 4, (4, 8)),
        ("chunked_causal", 8, 9, 4, (8, 9)),
    ],
)
def test_key_ranges(mask, position, visible, window, expected):
    assert key_range(mask, position, visible, window) == expected


@pytest.mark.parametrize(
    "granularity", [quant.BLOCKWISE, quant.PER_CHANNEL, quant.PER_TENSOR, (2, 64, 32)]
)
def test_quantize_fp8_scale_rule_and_round_trip(granularity):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 130, 200, generator=g) * 5
    gm, gn, gk = quant.ScaleGranularity.parse(granularity)
    x_fp8, scales = quant.quantize_fp8(x, gn, gk)
    assert x_fp8.dtype == torch.float8_e4m3fn
    assert scales.shape == quant.scale_shape(3, 130, 200, gn, gk)
    # Each block's largest magnitude maps to 448 (the scale rule).
    blocks, _ = quant._block_view(x.abs(), gn, gk)
    torch.testing.assert_close(scales, blocks.amax(dim=(2, 4)) / 448)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values.
    back = quant.dequantize_fp8(x_fp8, scales, gn, gk)
    full_scale = quant.expand_scales(scales, 130, 200, gn, gk)
    normal = x.abs() / full_scale >= 2.0**-6
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-12)[normal].all()


def test_quantize_fp8_zero_block_has_unit_scale():
    x = torch.zeros(1, 128, 128)
    x[0, 0, 0] = 0  # all zero
    x_fp8, scales = quant.quantize_fp8(x, 128, 128)
    assert scales.item() == 1.0
    assert (x_fp8.float() == 0).all()


@pytest.mark.parametrize(
    "granularity", [quant.BLOCKWISE, quant.PER_CHANNEL, quant.PER_TENSOR, (1, 32, 64)]
)
def test_fp8_batched_matmul_matches_dequantize_then_matmul(granularity):
    g = torch.Generator().manual_seed(4)
    gran = quant.ScaleGranularity.parse(granularity)
    a = torch.randn(4, 6, 128, generator=g)
    w = torch.randn(4, 512, 128, generator=g) * 0.05
    w_fp8, w_scale = quant.quantize_fp8(w, gran.n, gran.k)
    a_fp8, a_scale = quant.quantize_fp8(a, gran.m, gran.k)
    expected = quant.dequantize_fp8(a_fp8, a_scale, gran.m, gran.k) @ quant.dequantize_fp8(
        w_fp8, w_scale, gran.n, gran.k
    ).transpose(1, 2)
    got = quant.fp8_batched_matmul(a, w_fp8, w_scale, gran)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # And close to the unquantized product (fp8 keeps ~2 significant digits).
    exact = a @ w.transpose(1, 2)
    assert (got - exact).norm() / exact.norm() < 0.1


def _allowed(mask: str, p: torch.Tensor, j: torch.Tensor, window: int) -> torch.Tensor:
    """The masks as elementwise predicates on query position p and key position j."""
    if mask == "null":
        return torch.ones(p.shape[0], j.shape[1], dtype=torch.bool)
    causal = j <= p
    if mask == "causal":
        return causal
    if mask == "sliding_window_causal":
        return causal & (j > p - window)
    return causal & (j // window == p // window)


def _sdpa_attention(case, kv: KVCacheTensors, q_full, scale, mask, score_mod, window):
    """Attention of every request with torch SDPA on gathered (unpaged) keys."""
    offsets = case.input_row_offsets.tolist()
    rank = case.cache.kv_lora_rank
    slopes = (
        alibi_slopes(q_full.shape[1]) if score_mod == "alibi_pos" else torch.zeros(q_full.shape[1])
    )
    outs = []
    for b in range(len(offsets) - 1):
        n = offsets[b + 1] - offsets[b]
        c = case.cache.length(b)
        visible = c + n
        pages = kv.lookup_table[b].to(torch.int64)
        pos = torch.arange(visible)
        keys = kv.blocks[
            pages[pos // case.cache.page_size], 0, case.layer_idx, pos % case.cache.page_size, 0
        ].float()
        q_b = q_full[offsets[b] : offsets[b + 1]].transpose(0, 1)  # [H, n, D]
        qpos = torch.arange(c, c + n)
        allowed = _allowed(mask, qpos[:, None], pos[None, :], window)
        bias = -slopes[:, None, None] * (qpos[None, :, None] - pos[None, None, :]).float()
        bias = bias.masked_fill(~allowed, -math.inf)
        o = F.scaled_dot_product_attention(
            q_b,
            keys[None].expand(q_b.shape[0], -1, -1),
            keys[None, :, :rank].expand(q_b.shape[0], -1, -1),
            attn_mask=bias,
            scale=scale,
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def _attention_case(seed, dtype, mask, score_mod, window):
    """Three requests (9, 30 and 0 cached tokens; 1, 3 and 2 new), 4 heads, pages of 8."""
    return make_case(
        seed,
        dtype=dtype,
        num_heads=4,
        page_size=8,
        cache_lengths=(9, 30, 0),
        new_tokens=(1, 3, 2),
        mask=mask,
        score_mod=score_mod,
        local_window_size=window,
    )


@pytest.mark.parametrize(
    ("mask", "score_mod", "window"),
    [
        ("causal", "no_pos", 0),
        ("null", "alibi_pos", 0),
        ("sliding_window_causal", "alibi_pos", 5),
        ("chunked_causal", "no_pos", 16),
    ],
)
def test_reference_attention_matches_sdpa(mask, score_mod, window, monkeypatch):
    """The whole reference with its fp8 projections made exact, against SDPA on unpaged keys."""
    case = _attention_case(5, torch.float32, mask, score_mod, window)
    # Replace both fp8 matmuls by exact float matmuls on dequantized weights, so
    # the remaining difference is the attention alone.
    from pymla import reference

    def exact_matmul(a, w_fp8, w_scale, granularity):
        w = quant.dequantize_fp8(w_fp8, w_scale, granularity.n, granularity.k)
        return a @ w.transpose(1, 2)

    monkeypatch.setattr(reference, "fp8_batched_matmul", exact_matmul)
    kv = KVCacheTensors(
        case.cache.blocks.clone(), case.cache.cache_lengths, case.cache.lookup_table
    )
    out = mla_decode_branch_fp8_reference(*case.args(cache=kv), **case.options)

    # Independent path: the same steps 1-4, then SDPA, then the output projection.
    w = case.weights
    gran = case.options["scale_granularity"]
    nope = w["w_uk"].shape[2]
    offsets = case.input_row_offsets.tolist()
    positions = torch.cat(
        [
            torch.arange(case.cache.length(b), case.cache.length(b) + offsets[b + 1] - offsets[b])
            for b in range(len(offsets) - 1)
        ]
    )
    q = case.q.float()
    q_nope = torch.einsum(
        "thk,hnk->thn",
        q[..., :nope],
        quant.dequantize_fp8(w["w_uk"], w["w_uk_scale"], gran.n, gran.k),
    )
    q_full = torch.cat(
        [q_nope, rope_interleaved(q[..., nope:], case.freqs_cis[positions][:, None])], dim=-1
    )
    raw = _sdpa_attention(case, kv, q_full, case.options["scale"], mask, score_mod, window)
    expected = torch.einsum(
        "thk,hnk->thn", raw, quant.dequantize_fp8(w["w_uv"], w["w_uv_scale"], gran.n, gran.k)
    )
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_reference_updates_only_new_rows():
    case = make_case(6, dtype=torch.float32, num_heads=2)
    kv = KVCacheTensors(
        case.cache.blocks.clone(), case.cache.cache_lengths, case.cache.lookup_table
    )
    mla_decode_branch_fp8_reference(*case.args(cache=kv), **case.options)
    changed = (kv.blocks != case.cache.blocks).any(dim=-1)
    expected = torch.zeros_like(changed)
    for b, pos in case.new_positions():
        expected[
            case.cache.pages_of(b)[pos // case.cache.page_size],
            0,
            case.layer_idx,
            pos % case.cache.page_size,
            0,
        ] = True
    assert torch.equal(changed, expected)
    # Each new row: RMSNorm of its latent part, RoPE of its rope part.
    b, pos = case.new_positions()[-1]
    page = case.cache.pages_of(b)[pos // case.cache.page_size]
    row_before = case.cache.blocks[page, 0, case.layer_idx, pos % case.cache.page_size, 0]
    row_after = kv.blocks[page, 0, case.layer_idx, pos % case.cache.page_size, 0]
    torch.testing.assert_close(
        row_after[:512], rms_norm(row_before[:512], case.kv_norm_gamma, 1e-6)
    )
    torch.testing.assert_close(
        row_after[512:], rope_interleaved(row_before[512:], case.freqs_cis[pos])
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_rounding_points(dtype):
    """q_full and the attention output hold dtype values; step 5 is the docstring's formula.

    Independent path in float64: ``raw = rnd(sum_j rnd(e_j) V_j / sum_j e_j)``,
    ``e_j = exp(s_j - max s)``; it may differ from the float32 reference only
    where float32 sums land on the other side of a rounding boundary.
    """
    case = make_case(7, dtype=dtype, num_heads=4, cache_lengths=(50, 3), new_tokens=(2, 1))
    stages, blocks = reference_stages(case)
    for name in ("q_full", "attention"):
        x = getattr(stages, name)
        assert torch.equal(x, x.to(dtype).float()), f"{name} is not materialized in {dtype}"
    kv = KVCacheTensors(blocks, case.cache.cache_lengths, case.cache.lookup_table)
    offsets = case.input_row_offsets.tolist()
    ulp = 2.0 ** (1 - {torch.bfloat16: 8, torch.float16: 11}[dtype])
    for b in range(len(offsets) - 1):
        visible = case.cache.length(b) + offsets[b + 1] - offsets[b]
        page_of = case.cache.pages_of(b)
        keys = torch.stack(
            [
                kv.blocks[
                    page_of[j // case.cache.page_size],
                    0,
                    case.layer_idx,
                    j % case.cache.page_size,
                    0,
                ]
                for j in range(visible)
            ]
        ).double()
        for t in range(offsets[b], offsets[b + 1]):
            p = case.cache.length(b) + t - offsets[b]
            k = keys[: p + 1]  # causal
            s = case.options["scale"] * (stages.q_full[t].double() @ k.T)
            e = torch.exp(s - s.amax(dim=-1, keepdim=True))
            raw = (e.to(dtype).double() @ k[:, :512]) / e.sum(dim=-1, keepdim=True)
            expected = raw.to(dtype).double()
            diff = (stages.attention[t].double() - expected).abs()
            assert (diff <= ulp * expected.abs() + 1e-30).all()
            assert (diff > 0).float().mean() < 0.01  # equal but for rare boundary cases


def test_reference_new_rows_equal_appended_rows():
    """Rows given as ``new_rows`` give what the same rows appended to the cache give."""
    case = make_case(8, dtype=torch.bfloat16, num_heads=2, cache_lengths=(10, 0), new_tokens=(2, 3))
    appended, appended_blocks = reference_stages(case)
    rows = case.take_new_rows(seed=9)  # their cache slots now hold other values
    given, given_blocks = reference_stages(case, new_rows=rows)
    assert torch.equal(appended.out, given.out)
    assert torch.equal(appended_blocks, given_blocks)


@pytest.mark.parametrize(
    ("mask", "score_mod", "window"),
    [("causal", "alibi_pos", 0), ("sliding_window_causal", "no_pos", 4), ("null", "no_pos", 0)],
)
def test_reference_lse_is_the_natural_logsumexp_of_the_scaled_scores(mask, score_mod, window):
    """The reference's LSE against float64 ``logsumexp`` of ``scale q K^T + bias`` (mask applied)."""
    case = _attention_case(6, torch.bfloat16, mask, score_mod, window)
    stages, blocks = reference_stages(case)
    kv = KVCacheTensors(blocks, case.cache.cache_lengths, case.cache.lookup_table)
    scale = case.options["scale"]
    slopes = alibi_slopes(4).double() if score_mod == "alibi_pos" else torch.zeros(4).double()
    offsets = case.input_row_offsets.tolist()
    expected = []
    for b in range(len(offsets) - 1):
        c, n = case.cache.length(b), offsets[b + 1] - offsets[b]
        pos = torch.arange(c + n)
        pages = kv.lookup_table[b].to(torch.int64)
        keys = kv.blocks[pages[pos // 8], 0, case.layer_idx, pos % 8, 0].double()
        qpos = torch.arange(c, c + n)
        q = stages.q_full[offsets[b] : offsets[b + 1]].double()  # [n, H, D]
        scores = scale * torch.einsum("thd,jd->thj", q, keys)
        scores = scores - slopes[None, :, None] * (qpos[:, None, None] - pos[None, None, :])
        allowed = _allowed(mask, qpos[:, None], pos[None, :], window)[:, None, :]
        expected.append(torch.logsumexp(scores.masked_fill(~allowed, -math.inf), dim=-1))
    expected = torch.cat(expected)
    err = (stages.lse.double() - expected).abs()
    # float32 scores of a few units: a few float32 ulps (a base-2 log would be off by 30%).
    assert (err <= 1e-5 * (1 + expected.abs())).all(), float(err.max())


@pytest.mark.parametrize(("count", "interleave"), [(2, 1), (3, 2), (2, 64)])
def test_merged_shards_of_the_reference_equal_the_whole(count, interleave):
    """``merge_attention_states`` of the reference on each shard equals the reference on the whole cache."""
    from pymla import CacheShard, merge_attention_states
    from pymla.parity import compare_attention

    from helpers import lse_report

    options = dict(
        num_heads=4,
        cache_lengths=(9, 70, 0),
        new_tokens=(2, 3, 1),
        mask="sliding_window_causal",
        score_mod="alibi_pos",
        local_window_size=3,
        dtype=torch.float32,
    )
    whole, _ = reference_stages(make_case(7, **options))
    parts = [
        reference_stages(make_case(7, shard=CacheShard(r, count, interleave), **options))[0]
        for r in range(count)
    ]
    assert any(torch.isneginf(p.lse).any() for p in parts), "a shard should miss some rows' keys"
    for p in parts:  # a row without keys: zero output, -inf
        empty = torch.isneginf(p.lse)
        assert (p.attention[empty] == 0).all()
    merged, lse = merge_attention_states([p.attention for p in parts], [p.lse for p in parts])
    report = compare_attention(
        merged,
        whole.attention,
        whole.attention_magnitude,
        torch.float32,
        whole.score_magnitude,
    )
    assert report.passed, report.describe()
    lse_check = lse_report(lse, whole, torch.float32)
    assert lse_check.passed, lse_check.describe()


def test_merge_attention_states_of_rows_no_piece_saw():
    """Pieces with ``lse = -inf`` weigh nothing; a row none saw is zero with ``-inf``."""
    from pymla import merge_attention_states

    out = torch.tensor([[[[1.0, 2.0]], [[5.0, 5.0]]], [[[3.0, 4.0]], [[7.0, 7.0]]]])  # [2, 2, 1, 2]
    lse = torch.tensor([[[0.0], [-math.inf]], [[math.log(3.0)], [-math.inf]]])
    merged, merged_lse = merge_attention_states(out, lse)
    torch.testing.assert_close(merged[0, 0], torch.tensor([2.5, 3.5]))  # weights 1/4, 3/4
    assert merged_lse[0, 0] == pytest.approx(math.log(4.0))
    assert (merged[1] == 0).all() and torch.isneginf(merged_lse[1]).all()
    with pytest.raises(ValueError, match="outputs, lses"):
        merge_attention_states(out, lse[:, :1])


def test_cache_shard_positions_and_slots():
    """Every position has one owner; slots count a shard's positions; ``position`` inverts them."""
    from pymla import CacheShard

    for count, interleave in ((1, 1), (2, 1), (3, 4), (2, 1000)):
        shards = [CacheShard(r, count, interleave) for r in range(count)]
        pos = torch.arange(200)
        owners = torch.stack([s.owns(pos) for s in shards]).int()
        assert (owners.sum(0) == 1).all()
        for s in shards:
            mine = s.positions(200)
            slots = torch.arange(mine.numel())
            assert torch.equal(s.local_count(mine), slots)
            assert torch.equal(s.position(slots), mine)
            assert s.local_count(200) == mine.numel()
            assert [s.local_count(int(p)) for p in range(0, 200, 7)] == [
                int((mine < p).sum()) for p in range(0, 200, 7)
            ]
    for bad, match in (
        (dict(rank=2, count=2), "shard_rank"),
        (dict(count=0), "num_shards"),
        (dict(interleave=0), "shard_interleave"),
    ):
        with pytest.raises(ValueError, match=match):
            CacheShard(**bad)
    with pytest.raises(TypeError, match="num_shards"):
        CacheShard(count=2.0)
