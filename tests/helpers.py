"""Test helpers: run the op into poisoned outputs and check each stage against the reference."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import pymla
from pymla.cpu_paths import PATHS, compile_target_name, kernel_cpu_paths
from pymla.parity import (
    compare_attention,
    compare_cache,
    compare_lse,
    compare_output,
    compare_projection,
)
from pymla.quant import ScaleGranularity
from pymla.reference import project_output
from pymla.tools.scenario import Case, make_case, reference_stages, run_reference

__all__ = [
    "DEVICES",
    "TARGETS",
    "Case",
    "assert_cache_unchanged",
    "cache_snapshot",
    "check_parity",
    "lse_report",
    "make_case",
    "run_op_poisoned",
    "run_reference",
    "torch_op_args",
]


def cache_snapshot(cache: pymla.PagedLatentCache) -> dict:
    """What a refused cache method or op call must leave as it was: bytes, tables, bookkeeping."""
    requests = range(cache.num_requests)
    return {
        "blocks": cache.blocks.view(torch.uint8).clone(),
        "cache_lengths": cache.cache_lengths.clone(),
        "lookup_table": cache.lookup_table.clone(),
        "lengths": [cache.length(b) for b in requests],
        "pending": [cache.pending(b) for b in requests],
        "pages": [cache.pages_of(b) for b in requests],
        "free_pages": list(cache._free_pages),  # in the order they are handed out
        "new_rows_state": [
            [cache.new_rows_state(b, layer) for layer in range(cache.num_layers)] for b in requests
        ],
    }


def assert_cache_unchanged(cache: pymla.PagedLatentCache, before: dict) -> None:
    after = cache_snapshot(cache)
    assert after.keys() == before.keys()
    for key, value in before.items():
        same = (
            torch.equal(after[key], value)
            if isinstance(value, torch.Tensor)
            else (after[key] == value)
        )
        assert same, f"the cache's {key} changed: {value!r} -> {after[key]!r}"


def _poisoned(case: Case, width: int) -> torch.Tensor:
    shape = (case.q.shape[0], case.q.shape[1], width)
    return torch.full(shape, float("nan"), dtype=case.q.dtype, device=case.q.device)


def run_op_poisoned(
    case: Case,
    *,
    attention: bool = False,
    new_rows: torch.Tensor | None = None,
    rerun_layers: bool = False,
    lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Runs the op into NaN-poisoned outputs and checks every element was written.

    With ``attention`` also returns the attention output (``attention_out``),
    with ``lse`` also the LSE (``(out, att, lse)``).
    ``rerun_layers``: the case's layer ran already this step (its rows restored since).
    """
    out = _poisoned(case, case.weights["w_uv"].shape[1])
    att = _poisoned(case, case.weights["w_uk"].shape[1]) if attention or lse else None
    lse_out = (
        torch.full(case.q.shape[:2], float("nan"), dtype=torch.float32, device=case.q.device)
        if lse
        else None
    )
    result = pymla.mla_decode_branch_fp8(
        *case.args(),
        **case.options,
        out=out,
        attention_out=att,
        new_rows=new_rows,
        rerun_layers=rerun_layers,
        lse=lse_out,
    )
    assert result is out
    for name, t in (("output", out), ("attention output", att), ("lse", lse_out)):
        if t is not None:
            assert not torch.isnan(t).any(), (
                f"{int(torch.isnan(t).sum())} {name} elements not written"
            )
    if lse:
        return out, att, lse_out
    return (out, att) if attention else out


def lse_report(lse: torch.Tensor, stages, dtype: torch.dtype):
    """The op's ``lse`` vs the reference stages' (:func:`pymla.parity.compare_lse`)."""
    return compare_lse(lse, stages.lse, stages.score_magnitude, stages.product_magnitude, dtype)


def assert_output_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The end-to-end tolerance of :mod:`pymla.parity` (derived there)."""
    report = compare_output(out, ref)
    assert report.passed, f"output: {report.describe()}"


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
"""Where the op is tested: the CPU always, a CUDA GPU when there is one."""


TARGETS = [f"cpu:{path}" for path in PATHS] + DEVICES[1:]
"""Every CPU code path of the kernel (``PYMLA_CPU_PATH``), then the GPU if there is one.

A path the compiled kernel lacks (:func:`pymla.cpu_paths.kernel_cpu_paths`)
is skipped by :func:`on_target`, with the reason."""


@contextlib.contextmanager
def on_target(target: str):
    """Yields the torch device of ``target``, with its CPU path forced for the duration."""
    device, _, path = target.partition(":")
    if path and path != "f32" and path not in kernel_cpu_paths():
        pytest.skip(
            f"the compiled kernel has no {path} path (it has {', '.join(kernel_cpu_paths())}; "
            f"compiled for {compile_target_name()})"
        )
    previous = os.environ.get("PYMLA_CPU_PATH")
    if path:
        os.environ["PYMLA_CPU_PATH"] = path
    try:
        yield device
    finally:
        if path:
            if previous is None:
                os.environ.pop("PYMLA_CPU_PATH", None)
            else:
                os.environ["PYMLA_CPU_PATH"] = previous


def check_parity(case: Case, target: str = "cpu", *, via_new_rows: bool = False) -> None:
    """Op (on ``target``, see :data:`TARGETS`) vs reference (on the CPU), stage by stage.

    Checks the attention output and its LSE (step 5), the output given the
    op's own attention output (step 6), the output end to end, the updated
    cache rows and every other cache byte. ``via_new_rows`` passes the new tokens' rows
    as ``new_rows`` instead of appending them to the cache first.
    """
    new_rows = case.take_new_rows(seed=case.q.shape[0] + 17) if via_new_rows else None
    before = case.cache.blocks.clone()
    stages, ref_blocks = reference_stages(case, new_rows=new_rows)
    with on_target(target) as device:
        case.to(device)
        out, att, lse = run_op_poisoned(
            case, lse=True, new_rows=None if new_rows is None else new_rows.to(device)
        )
        out, att, lse = out.cpu(), att.cpu(), lse.cpu()
        case.to("cpu")
    dtype = case.q.dtype
    report = compare_attention(att, stages.attention, stages.attention_magnitude, dtype)
    assert report.passed, report.describe()
    lse_check = lse_report(lse, stages, dtype)
    assert lse_check.passed, lse_check.describe()
    w = case.weights
    granularity = ScaleGranularity.parse(case.options["scale_granularity"])
    step6 = project_output(att, w["w_uv"], w["w_uv_scale"], granularity, dtype)
    report6 = compare_projection(out, step6)
    assert report6.passed, f"step 6 given the op's attention output: {report6.describe()}"
    assert_output_close(out, stages.out)
    updated = case.new_rows_mask()
    cache_report = compare_cache(
        before, case.cache.blocks, ref_blocks, updated, case.cache.kv_lora_rank
    )
    assert cache_report.passed, f"cache: {cache_report.describe()}"
    if updated.any():
        assert not torch.equal(case.cache.blocks[updated], before[updated]), (
            "new rows were not updated"
        )


def torch_op_args(case: Case, **changes) -> tuple:
    """The positional arguments of ``torch.ops.pymla.mla_decode_branch_fp8`` for a case (fresh ``out``).

    ``changes``: other keywords of :func:`pymla.args.torch_op_args` (``out``, ``first_step``, ...).
    """
    w = case.weights
    out = torch.empty(case.q.shape[0], case.q.shape[1], w["w_uv"].shape[1], dtype=case.q.dtype)
    o = dict(case.options)
    granularity = ScaleGranularity.parse(o.pop("scale_granularity"))
    return pymla.args.torch_op_args(
        **{"out": out, **changes},
        q=case.q,
        input_row_offsets=case.input_row_offsets,
        freqs_cis=case.freqs_cis,
        kv=case.cache_tensors(),
        layer_idx=case.layer_idx,
        options=pymla.DecodeOptions(**o),
        granularity=granularity,
        weights={"kv_norm_gamma": case.kv_norm_gamma, **w},
    )
