"""Test helpers: run the op into a poisoned output and check it against the reference."""

from __future__ import annotations

import torch

import pymla
from pymla.parity import compare_cache, compare_output
from pymla.scenario import Case, make_case, run_reference

__all__ = [
    "DEVICES",
    "Case",
    "check_parity",
    "make_case",
    "run_op_poisoned",
    "run_reference",
    "torch_op_args",
]


def run_op_poisoned(case: Case) -> torch.Tensor:
    """Runs the op into a NaN-poisoned output and checks every element was written."""
    out = torch.full(
        (case.q.shape[0], case.q.shape[1], case.weights["w_uv"].shape[1]),
        float("nan"),
        dtype=case.q.dtype,
        device=case.q.device,
    )
    result = pymla.mla_decode_branch_fp8(*case.args(), **case.options, out=out)
    assert result is out
    assert not torch.isnan(out).any(), (
        f"{int(torch.isnan(out).sum())} output elements were not written"
    )
    return out


def assert_output_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The output tolerance of :mod:`pymla.parity` (two tiers, justified there)."""
    report = compare_output(out, ref)
    assert report.passed, f"output: {report.describe()}"


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
"""Where the op is tested: the CPU always, a CUDA GPU when there is one."""


def check_parity(case: Case, device: str = "cpu") -> None:
    """Op (on ``device``) vs reference (on the CPU): the output, the updated rows, every other cache byte."""
    before = case.cache.blocks.clone()
    ref_out, ref_blocks = run_reference(case)
    case.to(device)
    out = run_op_poisoned(case).cpu()
    case.to("cpu")
    assert_output_close(out, ref_out)
    updated = case.new_rows_mask()
    report = compare_cache(before, case.cache.blocks, ref_blocks, updated)
    assert report.passed, f"cache: {report.describe()}"
    if updated.any():
        assert not torch.equal(case.cache.blocks[updated], before[updated]), (
            "new rows were not updated"
        )


def torch_op_args(case: Case) -> tuple:
    """The positional arguments of ``torch.ops.pymla.mla_decode_branch_fp8`` for a case (fresh ``out``)."""
    w = case.weights
    kv = case.cache_tensors()
    out = torch.empty(case.q.shape[0], case.q.shape[1], w["w_uv"].shape[1], dtype=case.q.dtype)
    o = case.options
    g = pymla.ScaleGranularity.parse(o["scale_granularity"])
    return (
        out,
        case.q,
        case.input_row_offsets,
        case.freqs_cis,
        case.kv_norm_gamma,
        kv.blocks,
        kv.cache_lengths,
        kv.lookup_table,
        case.layer_idx,
        w["w_uk"].view(torch.uint8),
        w["w_uk_scale"],
        w["w_uv"].view(torch.uint8),
        w["w_uv_scale"],
        o["scale"],
        o["epsilon"],
        g.m,
        g.n,
        g.k,
        o["mask"],
        o["score_mod"],
        o["local_window_size"],
        True,
        case.q.new_empty(0),  # attention_out: not wanted
        case.q.new_empty(0),  # new_rows: the rows are in the cache
    )
