"""The benchmark's plain-torch baseline does the same work as the op (checked against the reference)."""

import pytest

from pymla.parity import CACHE_TOLERANCE
from pymla.tools.plain_torch import PlainTorchDecode
from pymla.tools.scenario import make_case, run_reference

from helpers import DEVICES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attention", ["matmul", "sdpa"])
@pytest.mark.parametrize("score_mod", ["no_pos", "alibi_pos"])
def test_plain_torch_matches_reference(attention, score_mod, device):
    case = make_case(
        11,
        num_heads=8,
        page_size=16,
        cache_lengths=(40, 3, 77),
        new_tokens=(2, 2, 2),
        num_layers=2,
        layer_idx=1,
        score_mod=score_mod,
    )
    ref_out, ref_blocks = run_reference(case)
    updated = case.new_rows_mask()
    case.to(device)
    w = case.weights
    fn = PlainTorchDecode(
        w["w_uk"],
        w["w_uk_scale"],
        w["w_uv"],
        w["w_uv_scale"],
        dtype=case.q.dtype,
        scale=case.options["scale"],
        score_mod=score_mod,
        attention=attention,
    )
    out = fn(
        case.q, case.input_row_offsets, case.freqs_cis, case.kv_norm_gamma, case.cache_tensors(), 1
    )
    # bf16 intermediates and unquantized activations: agreement to a few percent of the range.
    assert out.device == case.q.device
    out, blocks = out.cpu(), case.cache.blocks.cpu()
    err = (out.float() - ref_out.float()).abs().max() / ref_out.float().abs().max()
    assert err < 0.05, f"plain torch differs from the reference by {err:.3g} x max|ref|"
    row_err = (blocks[updated].float() - ref_blocks[updated].float()).abs().max()
    assert row_err <= CACHE_TOLERANCE[case.q.dtype] * ref_blocks[updated].float().abs().max()
