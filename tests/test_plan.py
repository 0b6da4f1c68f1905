"""The serving path: plan once per decode step, run per layer (issue 13).

plan + run must give the one-shot call's bytes (output and cache), check
values once in plan and only shapes/dtypes/devices in run, refuse a step
whose new rows were never appended, and be safe from several threads.
The argument table (pymla.args) must agree with the Mojo op's signature.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import re
import threading

import pytest
import torch

import pymla
from pymla.args import ACTIVATION, ARGS, Mask, ScoreMod
from pymla.scenario import rope_freqs_cis

from helpers import make_case

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "mojo_kernels"


def _layer_weights(case) -> pymla.LayerWeights:
    w = case.weights
    return pymla.LayerWeights(
        w["w_uk"],
        w["w_uk_scale"],
        w["w_uv"],
        w["w_uv_scale"],
        case.kv_norm_gamma,
        case.options["scale_granularity"],
    )


def _options(case) -> pymla.DecodeOptions:
    o = {k: v for k, v in case.options.items() if k != "scale_granularity"}
    return pymla.DecodeOptions(**o)


# ---------------------------------------------------------------- one owner of the argument list


def test_argument_table_is_the_mojo_signature():
    """Names, order, ranks, dtypes and mutability of ARGS are those of the Mojo ``execute``."""
    source = (KERNELS / "mla_decode_branch_fp8.mojo").read_text()
    body = source[source.index("def execute[") :]
    body = body[body.index("](") + 2 : body.index("ctx: DeviceContext")]
    params = re.findall(r"^\s*(\w+): ([^\n]+?),?$", body, flags=re.M)
    assert [name for name, _ in params] == [a.name for a in ARGS]
    scalars = {"UInt32": "uint32", "Int32": "int32", "Float32": "float32"}
    for (name, kind), arg in zip(params, ARGS, strict=True):
        if arg.is_scalar:
            assert scalars[kind] == arg.dtype.name, name
            continue
        assert kind.startswith("MutableInputTensor" if arg.mutable else "InputTensor["), name
        assert f"rank={arg.rank}" in kind, name
        expected = "dtype=dtype" if arg.dtype == ACTIVATION else f"dtype=DType.{arg.dtype.name}"
        assert expected in kind, name


def test_mask_and_score_mod_values_are_the_kernels_codes():
    source = (KERNELS / "attention.mojo").read_text()
    codes = dict(re.findall(r"comptime (MASK_\w+|SCORE_MOD_\w+) = (\d+)", source))
    assert {f"MASK_{m.name}": str(int(m)) for m in Mask} == {
        k: v for k, v in codes.items() if k.startswith("MASK_")
    }
    assert {f"SCORE_MOD_{s.name}": str(int(s)) for s in ScoreMod} == {
        k: v for k, v in codes.items() if k.startswith("SCORE_MOD_")
    }


def test_torch_op_schema_follows_the_table():
    schema = torch.ops.pymla.mla_decode_branch_fp8.default._schema
    assert [a.name for a in schema.arguments] == [a.name for a in ARGS] + ["check_values"]


# ---------------------------------------------------------------- options


def test_options_are_frozen_and_take_names_or_enums():
    a = pymla.DecodeOptions(scale=0.1, mask="sliding_window_causal", local_window_size=8)
    b = pymla.DecodeOptions(scale=0.1, mask=Mask.SLIDING_WINDOW_CAUSAL, local_window_size=8)
    assert a == b and a.mask is Mask.SLIDING_WINDOW_CAUSAL and a.score_mod is ScoreMod.NO_POS
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.scale = 0.2  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"^mask: expected one of"):
        pymla.DecodeOptions(scale=0.1, mask="diagonal")
    with pytest.raises(ValueError, match=r"^scale: expected a finite"):
        pymla.DecodeOptions(scale=float("nan"))


# ---------------------------------------------------------------- plan + run == one-shot


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plan_then_run_per_layer_equals_the_one_shot_call(dtype):
    """Two layers of one step: the same output and cache bytes as two one-shot calls."""
    case = make_case(31, dtype=dtype, num_heads=4, cache_lengths=(3, 20), new_tokens=(1, 2))
    other = make_case(32, dtype=dtype, num_heads=4, cache_lengths=(3, 20), new_tokens=(1, 2))
    one_shot = copy.deepcopy(case)
    qs = {0: other.q, 1: case.q}
    weights = {0: other, 1: case}  # layer 0 uses the other case's weights

    expected = {}
    for layer in (0, 1):
        w = weights[layer]
        one_shot.layer_idx = layer
        expected[layer] = pymla.mla_decode_branch_fp8(
            qs[layer],
            one_shot.input_row_offsets,
            one_shot.freqs_cis,
            w.kv_norm_gamma,
            one_shot.cache,
            layer,
            *(w.weights[k] for k in ("w_uk", "w_uk_scale", "w_uv", "w_uv_scale")),
            **case.options,
        )

    step = pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, _options(case))
    layer_weights = {layer: _layer_weights(weights[layer]) for layer in (0, 1)}
    for layer in (0, 1):
        out = torch.full_like(expected[layer], float("nan"))
        result = step.run(qs[layer], layer, layer_weights[layer], out=out)
        assert result is out
        assert torch.equal(out.view(torch.uint8), expected[layer].view(torch.uint8)), layer
    assert torch.equal(case.cache.blocks.view(torch.uint8), one_shot.cache.blocks.view(torch.uint8))


def test_plan_with_new_rows_equals_appending_them():
    """plan(new_rows=True) + run(new_rows=...) into reserved slots == rows appended first."""
    case = make_case(41, num_heads=4, cache_lengths=(6, 0), new_tokens=(2, 1))
    appended = copy.deepcopy(case)
    rows = case.take_new_rows(seed=5)  # case's slots now hold noise
    step = pymla.plan(
        case.cache, case.input_row_offsets, case.freqs_cis, _options(case), new_rows=True
    )
    weights = _layer_weights(case)
    with pytest.raises(ValueError, match=r"^new_rows: expected a tensor"):
        step.run(case.q, case.layer_idx, weights)
    out = step.run(case.q, case.layer_idx, weights, new_rows=rows)
    expected = pymla.mla_decode_branch_fp8(*appended.args(), **appended.options)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(case.cache.blocks.view(torch.uint8), appended.cache.blocks.view(torch.uint8))


# ---------------------------------------------------------------- checks: values in plan, shapes in run


def test_plan_checks_values_once():
    case = make_case(51, num_heads=4)
    table = case.cache.lookup_table.clone()
    table[0, 0] = case.cache.blocks.shape[0]
    kv = pymla.KVCacheTensors(case.cache.blocks, case.cache.cache_lengths, table)
    with pytest.raises(ValueError, match=r"^lookup_table: expected entries < "):
        pymla.plan(kv, case.input_row_offsets, case.freqs_cis, _options(case))
    with pytest.raises(TypeError, match=r"^options: expected a pymla.DecodeOptions"):
        pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, {"scale": 0.1})


def test_run_checks_shapes_dtypes_and_layer():
    case = make_case(52, num_heads=4)
    step = pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, _options(case))
    weights = _layer_weights(case)
    before = case.cache.blocks.clone()
    with pytest.raises(ValueError, match=r"^q: expected shape"):
        step.run(case.q[:-1], case.layer_idx, weights)
    with pytest.raises(TypeError, match=r"^q: expected dtype torch.bfloat16"):
        step.run(case.q.float(), case.layer_idx, weights)
    with pytest.raises(TypeError, match=r"^q: expected a torch.Tensor"):
        step.run(case.q.tolist(), case.layer_idx, weights)
    with pytest.raises(ValueError, match=r"^layer_idx: expected 0 <= layer_idx < 2"):
        step.run(case.q, 2, weights)
    with pytest.raises(TypeError, match=r"^weights: expected a pymla.LayerWeights"):
        step.run(case.q, case.layer_idx, case.weights)
    w = case.weights
    f32 = pymla.LayerWeights(
        w["w_uk"], w["w_uk_scale"], w["w_uv"], w["w_uv_scale"], case.kv_norm_gamma.float()
    )
    with pytest.raises(ValueError, match=r"^weights: expected dtype torch.bfloat16"):
        step.run(case.q, case.layer_idx, f32)
    out = torch.empty(case.q.shape[0], 4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^out: expected shape"):
        step.run(case.q, case.layer_idx, weights, out=out[:, :2].clone())
    with pytest.raises(ValueError, match=r"^out: expected memory of its own"):
        step.run(case.q, case.layer_idx, weights, out=case.q.view(-1)[: out.numel()].view_as(out))
    assert torch.equal(case.cache.blocks.view(torch.uint8), before.view(torch.uint8))


def test_layer_weights_checks_once():
    case = make_case(53, num_heads=4)
    w = case.weights
    bad = w["w_uk_scale"].clone()
    bad[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"^w_uk_scale: expected finite scales"):
        pymla.LayerWeights(w["w_uk"], bad, w["w_uv"], w["w_uv_scale"], case.kv_norm_gamma)
    with pytest.raises(TypeError, match=r"^w_uv: expected dtype torch.float8_e4m3fn"):
        pymla.LayerWeights(
            w["w_uk"], w["w_uk_scale"], w["w_uv"].view(torch.uint8), w["w_uv_scale"],
            case.kv_norm_gamma,
        )  # fmt: skip


# ---------------------------------------------------------------- stale rows


def _one_request_cache(seed: int) -> tuple[pymla.PagedLatentCache, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cache = pymla.PagedLatentCache(num_blocks=4, page_size=8, num_layers=1)
    cache.add_request()
    cache.append(0, 0, torch.randn(3, 576, generator=g).to(torch.bfloat16))
    cache.advance()
    return cache, torch.tensor([0, 1], dtype=torch.uint32)


@pytest.mark.parametrize("api", ["one_shot", "plan"])
def test_new_tokens_without_appended_rows_raise(api):
    """A step whose rows were never appended (nor given as new_rows) is refused by name."""
    cache, offsets = _one_request_cache(61)
    freqs = rope_freqs_cis(32, 64).to(torch.bfloat16)
    w = pymla.make_mla_weights(2)
    gamma = torch.ones(512, dtype=torch.bfloat16)
    q = torch.randn(1, 2, 192).to(torch.bfloat16)
    before = cache.blocks.clone()
    with pytest.raises(pymla.StaleCacheRowsError, match=r"^cache: request 0 has 1 new token but"):
        if api == "one_shot":
            pymla.mla_decode_branch_fp8(
                q, offsets, freqs, gamma, cache, 0,
                w["w_uk"], w["w_uk_scale"], w["w_uv"], w["w_uv_scale"], scale=0.1,
            )  # fmt: skip
        else:
            pymla.plan(cache, offsets, freqs, pymla.DecodeOptions(scale=0.1))
    assert torch.equal(cache.blocks.view(torch.uint8), before.view(torch.uint8))
    cache.reserve(0, 1)  # the rows will come as new_rows: no error then
    pymla.plan(cache, offsets, freqs, pymla.DecodeOptions(scale=0.1), new_rows=True)


# ---------------------------------------------------------------- threads


def test_concurrent_runs_on_separate_caches_equal_serial_runs():
    cases = [
        make_case(70 + i, num_heads=4, cache_lengths=(9, 30), new_tokens=(2, 1)) for i in range(4)
    ]
    serial = [copy.deepcopy(c) for c in cases]
    expected = [pymla.mla_decode_branch_fp8(*c.args(), **c.options) for c in serial]

    results: list[torch.Tensor | BaseException | None] = [None] * len(cases)
    barrier = threading.Barrier(len(cases))

    def work(i: int) -> None:
        try:
            c = cases[i]
            step = pymla.plan(c.cache, c.input_row_offsets, c.freqs_cis, _options(c))
            weights = _layer_weights(c)
            barrier.wait()
            results[i] = step.run(c.q, c.layer_idx, weights)
        except BaseException as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert isinstance(got, torch.Tensor), f"thread {i}: {got!r}"
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), i
        assert torch.equal(
            cases[i].cache.blocks.view(torch.uint8), serial[i].cache.blocks.view(torch.uint8)
        ), i
