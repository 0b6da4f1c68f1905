"""The op with an fp8_ds_mla cache (pymla.cache_format) against the reference, on every CPU path
and on the GPU when there is one (``TARGETS``).

The reference reads the dequantized keys, which are exactly bfloat16 values,
so steps 5 and 6 keep the bfloat16 bounds of pymla.parity; the new rows'
bytes are compared with the e4m3 bound there (``compare_fp8_rows``). One
compiled model (bfloat16, uint8 cache) serves every case.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_op_parity import MUTATIONS

import pymla
from pymla import cache_format as cf
from pymla import validate
from pymla.parity import compare_attention
from pymla.tools.scenario import reference_stages

from helpers import (
    TARGETS,
    assert_cache_unchanged,
    cache_snapshot,
    check_parity,
    lse_report,
    make_case,
    on_target,
    run_op_poisoned,
)

FP8 = dict(dtype=torch.bfloat16, cache_format="fp8_ds_mla")

# (seed, heads, page size, cache lengths, new tokens, mask, score mod, window)
CASES = [
    (4000, 16, 16, (5, 40, 0), (1, 2, 3), "causal", "no_pos", 0),
    (4001, 128, 64, (130, 0, 64, 7), (1, 0, 2, 1), "null", "alibi_pos", 0),
    (4002, 16, 1, (0, 0), (1, 3), "sliding_window_causal", "no_pos", 5),
    (4003, 32, 16, (200, 17, 0, 90), (2, 1, 0, 3), "chunked_causal", "alibi_pos", 16),
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("params", CASES, ids=[str(c[0]) for c in CASES])
@pytest.mark.parametrize("via_new_rows", [False, True], ids=["appended", "new_rows"])
def test_fp8_cache_parity(params, via_new_rows, target):
    """Attention, LSE, step 6, end to end, the new rows' bytes and every other byte (helpers)."""
    seed, heads, page, lengths, new, mask, score_mod, window = params
    case = make_case(
        seed + 10 * via_new_rows,
        num_heads=heads,
        page_size=page,
        cache_lengths=lengths,
        new_tokens=new,
        mask=mask,
        score_mod=score_mod,
        local_window_size=window,
        **FP8,
    )
    check_parity(case, target, via_new_rows=via_new_rows)


@pytest.mark.parametrize("target", TARGETS)
def test_fp8_long_context_partitions(target):
    case = make_case(
        4100, num_heads=16, page_size=64, cache_lengths=(3000, 5), new_tokens=(2, 1), **FP8
    )
    check_parity(case, target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_scales_not_powers_of_two(heads, target):
    """Rows another writer left with scales that are not powers of two (each times 0.75 on the rows at
    page slots 0-3 of every 16, the GPU's narrow kernel widening those warps' rows apart): their values
    are ``e4m3 * scale`` rounded to bfloat16 for the op and the reference alike (``dequantize_rows``)."""
    case = make_case(
        4500 + heads,
        num_heads=heads,
        page_size=64,
        cache_lengths=(300, 70),
        new_tokens=(1, 2),
        **FP8,
    )
    blocks = case.cache.blocks
    odd = (torch.arange(blocks.shape[3]) % 16 < 4).view(1, 1, 1, -1, 1) & ~case.new_rows_mask()
    scales = blocks[..., 512:528].clone().view(torch.float32)
    scales[odd] *= 0.75
    blocks[..., 512:528] = scales.view(torch.uint8)
    assert odd.sum() > 0 and torch.all(torch.frexp(scales[odd])[0] == 0.75), "the odd rows' scales"
    check_parity(case, target)


@pytest.mark.parametrize("target", TARGETS)
def test_new_rows_bytes_are_the_references(target):
    """The new rows: the reference's bytes (quantized values, scales, rope) but for rare flips."""
    case = make_case(4200, cache_lengths=(3, 60, 0, 9), new_tokens=(8, 16, 24, 16), **FP8)
    _, ref_blocks = reference_stages(case)
    updated = case.new_rows_mask()
    with on_target(target) as device:
        case.to(device)
        run_op_poisoned(case)
        case.to("cpu")
    got, ref = case.cache.blocks[updated], ref_blocks[updated]
    assert got.shape == (64, 656)
    same = (got == ref).float().mean().item()
    assert same >= 0.999, f"only {same:.4%} of the new rows' bytes are the reference's"
    latent, scales, rope = cf.split_rows(got, 512)
    assert torch.all(torch.frexp(scales)[0] == 0.5), "a stored scale is not a power of two"
    values = cf.dequantize_rows(got, 512)
    assert torch.equal(values, values.to(torch.bfloat16).float())


@pytest.mark.parametrize("target", TARGETS)
def test_fp8_tolerances_catch_mutations(target):
    """Against a reference made slightly wrong, the attention check fails for a key off by one
    position and a wrong rotation position, the LSE check for those and a scale off by 0.3%
    (bfloat16's probability rounding hides the scale from the attention bound: pymla.parity)."""
    case = make_case(4300, num_heads=32, cache_lengths=(40, 150), new_tokens=(1, 2), **FP8)
    good, _ = reference_stages(case)
    with on_target(target) as device:
        _, att, lse = run_op_poisoned(dataclasses.replace(case).to(device), lse=True)
        att, lse = att.cpu(), lse.cpu()
    assert lse_report(lse, good, torch.bfloat16).passed
    for mutation, make in MUTATIONS.items():
        fresh = make_case(4300, num_heads=32, cache_lengths=(40, 150), new_tokens=(1, 2), **FP8)
        change = make(fresh)
        freqs = change.pop("freqs_cis", fresh.freqs_cis)
        wrong, _ = reference_stages(dataclasses.replace(fresh, freqs_cis=freqs), **change)
        report = lse_report(lse, wrong, torch.bfloat16)
        assert not report.passed, f"lse: {mutation} went unnoticed: {report.describe()}"
        if mutation != "scale":
            att_report = compare_attention(
                att, wrong.attention, wrong.attention_magnitude, torch.bfloat16
            )
            assert not att_report.passed, f"attention: {mutation} went unnoticed"


def _refused(case, error, message, **call):
    before = cache_snapshot(case.cache)
    with pytest.raises(error, match=message):
        pymla.mla_decode_branch_fp8(*case.args(call.pop("cache", None)), **case.options, **call)
    assert_cache_unchanged(case.cache, before)


def test_bad_input_is_refused_before_any_kernel():
    case = make_case(4400, cache_lengths=(4, 9), new_tokens=(1, 1), **FP8)
    # a float16 op on fp8 rows
    half = dataclasses.replace(
        case,
        q=case.q.half(),
        freqs_cis=case.freqs_cis.half(),
        kv_norm_gamma=case.kv_norm_gamma.half(),
    )
    _refused(half, TypeError, r"^kv_blocks: expected dtype torch.float16 \(q's\), or uint8")
    # rows of the wrong width (a bfloat16 cache's 576 as bytes)
    kv = case.cache_tensors()
    narrow = pymla.KVCacheTensors(
        torch.zeros(*kv.blocks.shape[:-1], 576, dtype=torch.uint8), *kv[1:]
    )
    with pytest.raises(ValueError, match=r"^kv_blocks: expected size 656 in dim 5"):
        pymla.mla_decode_branch_fp8(*case.args(narrow), **case.options)
    with pytest.raises(ValueError, match=r"^kv_blocks: expected fp8_ds_mla rows"):
        pymla.plan(narrow, case.input_row_offsets, case.freqs_cis, case.decode_options())
    # kv_lora_rank 100: no fp8 layout
    odd = make_case(4401, kv_lora_rank=100, cache_lengths=(3,), new_tokens=(1,))
    blocks = torch.zeros(*odd.cache.blocks.shape[:-1], 100 + 4 + 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^kv_blocks: expected kv_lora_rank a multiple of 128"):
        pymla.mla_decode_branch_fp8(
            *odd.args(pymla.KVCacheTensors(blocks, *odd.cache_tensors()[1:])), **odd.options
        )
    # on a GPU, sizes the tensor-core attention kernels do not take (the FMA kernel reads no fp8
    # rows): refused by name before any kernel; the DeepSeek sizes and the CPU pass
    cuda = torch.device("cuda:0")
    with pytest.raises(ValueError, match=r"^kv_blocks: expected, for fp8_ds_mla rows on cuda:0"):
        validate.check_fp8_gpu_sizes(640, 64, cuda)
    with pytest.raises(ValueError, match=r"kv_lora_rank 512 and qk_rope_head_dim 72"):
        validate.check_fp8_gpu_sizes(512, 72, cuda)
    validate.check_fp8_gpu_sizes(512, 64, cuda)
    validate.check_fp8_gpu_sizes(256, 32, cuda)
    validate.check_fp8_gpu_sizes(640, 64, torch.device("cpu"))


def test_plan_and_run_over_layers():
    """The serving loop on an fp8 cache: plan once, run every layer with new_rows."""
    case = make_case(
        4500, num_layers=3, layer_idx=0, cache_lengths=(20, 7), new_tokens=(1, 2), **FP8
    )
    step = pymla.plan(
        case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options(), new_rows=True
    )
    w = case.weights
    weights = pymla.LayerWeights(
        w["w_uk"], w["w_uk_scale"], w["w_uv"], w["w_uv_scale"], case.kv_norm_gamma
    )
    g = torch.Generator().manual_seed(4501)
    for layer in range(3):
        rows = torch.randn(3, 576, generator=g).to(torch.bfloat16)
        one = dataclasses.replace(case, layer_idx=layer)
        stages, ref_blocks = reference_stages(one, new_rows=rows)
        out = step.run(case.q, layer, weights, new_rows=rows)
        updated = one.new_rows_mask()
        same = (case.cache.blocks[updated] == ref_blocks[updated]).float().mean().item()
        assert same >= 0.99, f"layer {layer}: {same:.2%} of the new rows' bytes as the reference's"
        assert pymla.parity.compare_output(out, stages.out).passed
