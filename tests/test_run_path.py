"""The one launch path of run(), the one-shot call and the torch op's body (issue 13).

run() hands q and out to MAX through torch's DLPack capsule (no copy), checks
that the tensors the op writes have memory of their own, and launches with a
launcher made once per plan; the one-shot call and the torch op's body launch
through a plan too, so all three give the same bytes.
"""

from __future__ import annotations

import copy

import pytest
import torch

import pymla
from pymla import bridge, runtime

from helpers import make_case, torch_op_args


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_call_tensors_cross_to_max_without_copies(dtype):
    t = torch.arange(24, dtype=torch.float32).to(dtype).reshape(2, 3, 4)
    buffer = bridge.to_max_unordered(t, bridge.dlpack_device(t.device))
    back = bridge.to_torch(buffer)
    assert back.data_ptr() == t.data_ptr() and back.shape == t.shape and back.dtype == dtype
    back[1, 2, 3] = -1
    assert t[1, 2, 3] == -1  # the same memory


def test_run_refuses_written_tensors_sharing_memory():
    case = make_case(81, num_heads=4, cache_lengths=(5, 9), new_tokens=(1, 2))
    step = pymla.plan(
        case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options(), new_rows=True
    )
    weights = case.layer_weights()
    tokens, heads = case.q.shape[:2]
    dtype = case.q.dtype
    rows = torch.randn(tokens, 576).to(dtype)
    before = case.cache.blocks.clone()

    def view(memory: torch.Tensor, *shape: int) -> torch.Tensor:
        n = 1
        for size in shape:
            n *= size
        return memory.view(-1)[:n].view(shape)

    out_shape, att_shape = (tokens, heads, 128), (tokens, heads, 512)
    shared = torch.empty(tokens * heads * 512, dtype=dtype)
    q_memory = torch.empty(tokens * heads * 512, dtype=dtype)
    q_in_memory = view(q_memory, *case.q.shape).copy_(case.q)
    for q, kwargs, message in (
        (q_in_memory, {"attention_out": view(q_memory, *att_shape)}, "^attention_out: .* q$"),
        (
            case.q,
            {"out": view(shared, *out_shape), "attention_out": view(shared, *att_shape)},
            "^out: expected memory of its own .* overlapping attention_out$",
        ),
        (case.q, {"out": view(rows, *out_shape)}, "^out: .* overlapping new_rows$"),
        (
            case.q,
            {"attention_out": view(case.cache.blocks, *att_shape)},
            "^attention_out: .* overlapping kv_blocks$",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            step.run(q, case.layer_idx, weights, new_rows=rows, **kwargs)
    assert torch.equal(case.cache.blocks.view(torch.uint8), before.view(torch.uint8))
    # Memory of their own: accepted.
    step.run(
        case.q,
        case.layer_idx,
        weights,
        out=torch.empty(out_shape, dtype=dtype),
        attention_out=torch.empty(att_shape, dtype=dtype),
        new_rows=rows,
    )


def test_one_shot_plan_run_and_torch_op_give_the_same_bytes():
    """Optional outputs included: attention_out and new_rows through all three callers."""
    case = make_case(82, num_heads=4, cache_lengths=(3, 20), new_tokens=(2, 1))
    rows = case.take_new_rows(seed=9)
    by_run, by_op = copy.deepcopy(case), copy.deepcopy(case)
    tokens, heads = case.q.shape[:2]

    att = torch.full((tokens, heads, 512), float("nan"), dtype=case.q.dtype)
    out = pymla.mla_decode_branch_fp8(
        *case.args(), **case.options, attention_out=att, new_rows=rows
    )

    step = pymla.plan(
        by_run.cache,
        by_run.input_row_offsets,
        by_run.freqs_cis,
        by_run.decode_options(),
        new_rows=True,
    )
    run_att = torch.full_like(att, float("nan"))
    run_out = step.run(by_run.q, by_run.layer_idx, by_run.layer_weights(), attention_out=run_att,
                       new_rows=rows)  # fmt: skip

    args = list(torch_op_args(by_op))
    names = [a.name for a in pymla.args.ARGS]
    op_att = torch.full_like(att, float("nan"))
    args[names.index("attention_output")] = op_att
    args[names.index("new_rows")] = rows
    torch.ops.pymla.mla_decode_branch_fp8(*args)
    op_out = args[names.index("output")]

    def raw(t):
        return t.view(torch.uint8)

    assert not torch.isnan(att).any()
    for got_out, got_att, got_case in ((run_out, run_att, by_run), (op_out, op_att, by_op)):
        assert torch.equal(raw(got_out), raw(out))
        assert torch.equal(raw(got_att), raw(att))
        assert torch.equal(raw(got_case.cache.blocks), raw(case.cache.blocks))


def test_launcher_is_what_run_launches():
    """A prepared launch of a plan's buffers writes what run() writes."""
    case = make_case(83, num_heads=2, cache_lengths=(7,), new_tokens=(1,))
    again = copy.deepcopy(case)
    expected = pymla.plan(
        case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options()
    ).run(case.q, case.layer_idx, case.layer_weights())
    step = pymla.plan(again.cache, again.input_row_offsets, again.freqs_cis, again.decode_options())
    out = torch.full_like(expected, float("nan"))
    launch = runtime.launcher(runtime.model_for(step.dtype, step.device), step.device)
    launch(step.buffers(again.q, again.layer_idx, again.layer_weights(), out))
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(again.cache.blocks.view(torch.uint8), case.cache.blocks.view(torch.uint8))


def test_run_bumps_the_versions_of_what_it_writes():
    case = make_case(84, num_heads=2, cache_lengths=(4,), new_tokens=(1,))
    step = pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options())
    out = torch.empty(1, 2, 128, dtype=case.q.dtype)
    att = torch.empty(1, 2, 512, dtype=case.q.dtype)
    before = (out._version, att._version, case.cache.blocks._version)
    step.run(case.q, case.layer_idx, case.layer_weights(), out=out, attention_out=att)
    after = (out._version, att._version, case.cache.blocks._version)
    assert all(a > b for a, b in zip(after, before, strict=True))


def test_only_a_plan_kept_for_later_wraps_its_tensors_with_dlpack_stream_ordering(monkeypatch):
    """The one-shot call and the torch op's body launch right away on the current stream, whose
    ordering covers their tensors: no ordered DLPack wrap (bridge.to_max). plan() and
    LayerWeights, kept for launches later, perhaps on another stream, keep it."""
    case = make_case(83, num_heads=2, cache_lengths=(5, 3), new_tokens=(1, 1))
    options = dict(case.options, check_values=False, rerun_layers=True)
    pymla.mla_decode_branch_fp8(*case.args(), **options)  # compiles; caches the scalar buffers
    ordered = []
    to_max = bridge.to_max
    monkeypatch.setattr(bridge, "to_max", lambda t: ordered.append(t) or to_max(t))
    pymla.mla_decode_branch_fp8(*case.args(), **options)
    torch.ops.pymla.mla_decode_branch_fp8(*torch_op_args(case, check_values=False))
    assert ordered == []
    pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options())
    case.layer_weights()
    assert len(ordered) == 10  # the step's five tensors and the layer's five
