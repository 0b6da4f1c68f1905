"""Torch-native calling: torch.compile without graph breaks, opcheck, and the demo command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import pymla
from pymla.parity import compare_cache, compare_output

from helpers import check_parity, make_case, run_op_poisoned, run_reference, torch_op_args


def test_torch_compile_fullgraph_matches_reference():
    case = make_case(401, num_heads=16, cache_lengths=(30, 5), new_tokens=(1, 2))
    ref_out, ref_blocks = run_reference(case)
    w = case.weights

    def decode_layer(q, cache):
        # A small torch program around the op: scale q, run the op, post-process.
        out = pymla.mla_decode_branch_fp8(
            q * 1.0,
            case.input_row_offsets,
            case.freqs_cis,
            case.kv_norm_gamma,
            cache,
            case.layer_idx,
            w["w_uk"],
            w["w_uk_scale"],
            w["w_uv"],
            w["w_uv_scale"],
            **case.options,
        )
        return out.float() * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(decode_layer, fullgraph=True)
    before = case.cache.blocks.clone()
    got = compiled(case.q, case.cache)
    report = compare_output((got / 2).to(case.q.dtype), ref_out)
    assert report.passed, report.describe()
    # The cache mutation happened through the compiled graph too: the new rows as the reference
    # writes them, every other byte as it was.
    updated = case.new_rows_mask()
    assert updated.any()
    cache_report = compare_cache(before, case.cache.blocks, ref_blocks, updated)
    assert cache_report.passed, f"cache: {cache_report.describe()}"
    assert not torch.equal(case.cache.blocks[updated], before[updated]), "new rows were not updated"


def test_opcheck():
    case = make_case(
        402, num_heads=4, cache_lengths=(9, 0), new_tokens=(1, 1), num_layers=1, layer_idx=0
    )
    torch.library.opcheck(torch.ops.pymla.mla_decode_branch_fp8.default, torch_op_args(case))


def test_op_is_registered_with_mutations_declared():
    schema = torch.ops.pymla.mla_decode_branch_fp8.default._schema
    mutated = {
        a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
    }
    assert mutated == {"output", "kv_blocks", "attention_output", "lse"}


def test_direct_torch_ops_call_matches_reference():
    case = make_case(
        403, num_heads=2, cache_lengths=(12,), new_tokens=(3,), num_layers=1, layer_idx=0
    )
    ref_out, _ = run_reference(case)
    args = torch_op_args(case)
    torch.ops.pymla.mla_decode_branch_fp8(*args)
    assert compare_output(args[0], ref_out).passed


def test_public_function_parity_smoke():
    check_parity(make_case(404, num_heads=16))


def test_eager_call_bumps_versions_like_the_op():
    """The public function skips the custom op's dispatch in eager mode; the two mutated
    tensors still get a new version, as the op's ADInplaceOrView step would give them."""
    case = make_case(
        405, num_heads=2, cache_lengths=(7,), new_tokens=(1,), num_layers=1, layer_idx=0
    )
    out = torch.empty(1, 2, case.weights["w_uv"].shape[1], dtype=case.q.dtype)
    before = (out._version, case.cache.blocks._version)
    pymla.mla_decode_branch_fp8(*case.args(), **case.options, out=out)
    assert out._version > before[0] and case.cache.blocks._version > before[1]


def test_call_under_inference_mode_matches_reference():
    case = make_case(
        406, num_heads=4, cache_lengths=(30,), new_tokens=(2,), num_layers=1, layer_idx=0
    )
    ref_out, _ = run_reference(case)
    with torch.inference_mode():
        q = case.q.clone()  # an inference tensor
        out = pymla.mla_decode_branch_fp8(q, *case.args()[1:], **case.options)
    assert compare_output(out, ref_out).passed


def test_demo_command_succeeds():
    result = subprocess.run(
        [sys.executable, "-m", "pymla", "demo", "--repeat", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),  # not the C environment: max.nn putenv()s PYTHONEXECUTABLE
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PARITY OK" in result.stdout
    for label in (
        "max abs error",
        "relative error",
        "time per call: pymla op",
        "time per call: torch reference",
    ):
        assert label in result.stdout


@pytest.mark.parametrize("cache_grows", [True, False])
def test_compile_is_logged_once_and_only_when_it_happens(cache_grows, monkeypatch):
    """One log line per model: "compiled" when MAX's disk cache gained entries, else "loaded"."""
    import itertools
    import logging

    from pymla import runtime

    monkeypatch.setattr(runtime, "_models", {})
    counter = itertools.count()
    monkeypatch.setattr(runtime, "_max_cache_entries", lambda: next(counter) if cache_grows else 7)
    logger = logging.getLogger("pymla")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        case = make_case(
            405, num_heads=2, cache_lengths=(3,), new_tokens=(1,), num_layers=1, layer_idx=0
        )
        pymla.mla_decode_branch_fp8(*case.args(), **case.options)
        pymla.mla_decode_branch_fp8(*case.args(), **case.options, rerun_layers=True)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    messages = [r.getMessage() for r in records if "mla_decode_branch_fp8 for" in r.getMessage()]
    assert messages[0].startswith(
        "pymla: compiling mla_decode_branch_fp8 for cpu, bfloat16 (first call"
    )
    messages = messages[1:]  # the line said before the compile; then the one after it:
    assert len(messages) == 1, messages
    assert ("compiled in" in messages[0]) == cache_grows, messages
    assert ("loaded from MAX's cache" in messages[0]) == (not cache_grows), messages


def test_check_values_false_skips_only_the_value_checks(monkeypatch):
    """A trusted loop can skip the checks that read tensor values; results are unchanged."""
    from pymla import value_checks

    case = make_case(406, num_heads=4, cache_lengths=(20, 3), new_tokens=(1, 1))
    ref_out, _ = run_reference(case)

    def refuse(*args, **kwargs):
        raise AssertionError("value checks ran")

    for name in ("check_positions", "check_finite_scales", "check_pending_rows"):
        monkeypatch.setattr(value_checks, name, refuse)
    out = pymla.mla_decode_branch_fp8(*case.args(), **case.options, check_values=False)
    assert compare_output(out, ref_out).passed
    # Shape checks still run.
    bad_q = case.q[:, :, :100].contiguous()
    with pytest.raises(ValueError, match="^q: "):
        pymla.mla_decode_branch_fp8(bad_q, *case.args()[1:], **case.options, check_values=False)


def test_torch_op_step_6_alone_reads_the_attention_output():
    """``first_step`` 6 through the torch op: step 6 on ``attention_output``, the cache untouched."""
    case = make_case(90, num_heads=4, cache_lengths=(12, 3), new_tokens=(1, 2))
    whole, att = run_op_poisoned(case, attention=True)
    before = case.cache.blocks.clone()
    out = torch.full_like(whole, float("nan"))
    torch.ops.pymla.mla_decode_branch_fp8(
        *torch_op_args(case, out=out, attention_out=att, first_step=pymla.args.STEP_6_ONLY)
    )
    assert torch.equal(out.view(torch.uint8), whole.view(torch.uint8))
    assert torch.equal(case.cache.blocks.view(torch.uint8), before.view(torch.uint8))
