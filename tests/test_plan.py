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
from pymla.args import ACTIVATION, ARGS, CACHE, Mask, ScoreMod
from pymla.reference import rope_freqs_cis

from helpers import assert_cache_unchanged, cache_snapshot, make_case

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "mojo_kernels"


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
        expected = {ACTIVATION: "dtype=dtype", CACHE: "dtype=cache_dtype"}.get(arg.dtype)
        expected = expected or f"dtype=DType.{arg.dtype.name}"
        assert expected in kind, name


def test_mask_and_score_mod_values_are_the_kernels_codes():
    source = (KERNELS / "spec.mojo").read_text()
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


def test_option_names_take_any_case():
    """The name "CAUSAL" is Mask.CAUSAL, as the enum is (the one-shot call: test_validation)."""
    a = pymla.DecodeOptions(scale=0.1, mask="CAUSAL", score_mod="Alibi_Pos")
    assert a.mask is Mask.CAUSAL and a.score_mod is ScoreMod.ALIBI_POS
    b = pymla.DecodeOptions(scale=0.1, mask="Chunked_Causal", local_window_size=4)
    assert b == pymla.DecodeOptions(scale=0.1, mask=Mask.CHUNKED_CAUSAL, local_window_size=4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            dict(mask="causal", local_window_size=8),
            "local_window_size: expected 0 for mask 'causal' (only sliding_window_causal and "
            "chunked_causal take a window), got 8",
        ),
        (
            dict(mask=Mask.NULL, local_window_size=1),
            "local_window_size: expected 0 for mask 'null' (only sliding_window_causal and "
            "chunked_causal take a window), got 1",
        ),
        (dict(scale=-1.0), "scale: expected a finite float32 value > 0, got -1.0"),
        (dict(scale=0), "scale: expected a finite float32 value > 0, got 0.0"),
        (dict(scale=1e-50), "scale: expected a finite float32 value > 0, got 1e-50"),
    ],
    ids=["causal-window", "null-window", "negative-scale", "zero-scale", "float32-zero-scale"],
)
def test_options_refuse_ignored_windows_and_non_positive_scales(options, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        pymla.DecodeOptions(**{"scale": 0.1, **options})


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

    step = pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options())
    layer_weights = {layer: weights[layer].layer_weights() for layer in (0, 1)}
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
        case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options(), new_rows=True
    )
    weights = case.layer_weights()
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
        pymla.plan(kv, case.input_row_offsets, case.freqs_cis, case.decode_options())
    with pytest.raises(TypeError, match=r"^options: expected a pymla.DecodeOptions"):
        pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, {"scale": 0.1})


def test_run_checks_shapes_dtypes_and_layer():
    case = make_case(52, num_heads=4)
    step = pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options())
    weights = case.layer_weights()
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


def _two_layer_step(seed: int, **plan_kwargs):
    """A 2-layer case whose rows were appended for layer 0 only, its plan and layer weights."""
    case = make_case(seed, num_heads=2, cache_lengths=(5, 9), new_tokens=(1, 2), num_layers=2)
    for b in (0, 1):  # make_case appended both layers: start the step afresh
        case.cache._appended[1].discard(b)
        case.cache._unrotated[1].discard(b)
    step = pymla.plan(
        case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options(), **plan_kwargs
    )
    return case, step, case.layer_weights()


def _one_shot(case, layer, **kwargs):
    w = case.weights
    return pymla.mla_decode_branch_fp8(
        case.q, case.input_row_offsets, case.freqs_cis, case.kv_norm_gamma, case.cache, layer,
        w["w_uk"], w["w_uk_scale"], w["w_uv"], w["w_uv_scale"], **case.options, **kwargs,
    )  # fmt: skip


def _refused(case, call, message: str) -> None:
    """``call`` raises StaleCacheRowsError with ``message``; the cache is as it was."""
    before = cache_snapshot(case.cache)
    with pytest.raises(pymla.StaleCacheRowsError, match="^" + re.escape(message) + "$"):
        call()
    assert_cache_unchanged(case.cache, before)


NOT_APPENDED = (
    "cache: request 0 has 1 new token but no rows appended for layer 1 since its last advance() "
    "(call cache.append(0, 1, rows) before running layer 1, or pass new_rows=)"
)
ROTATED = (
    "cache: request 0's new rows of layer 0 were already rotated by an earlier run in this step "
    "(another run would rotate them again); append them again (cache.append(0, 0, rows)) to "
    "redo the layer, or pass rerun_layers=True to repeat it on purpose"
)


@pytest.mark.parametrize("api", ["plan", "one_shot"])
def test_a_layer_without_appended_rows_is_refused(api):
    """Rows appended for layer 0 only: layer 1 would rotate rows never written this step."""
    case, step, weights = _two_layer_step(91)
    run = {
        "plan": lambda layer: step.run(case.q, layer, weights),
        "one_shot": lambda layer: _one_shot(case, layer),
    }[api]
    _refused(case, lambda: run(1), NOT_APPENDED)
    run(0)
    assert [case.cache.new_rows_state(b, 0) for b in (0, 1)] == ["rotated", "rotated"]
    case.cache.append(0, 1, torch.randn(1, 576))
    case.cache.append(1, 1, torch.randn(2, 576))
    run(1)


@pytest.mark.parametrize("api", ["plan", "one_shot"])
def test_running_a_layer_twice_in_a_step_is_refused(api):
    """A retry would rotate the layer's rows a second time; appending them again allows it."""
    case, step, weights = _two_layer_step(92)
    raw = [case.cache.rows(b, 0, case.cache.length(b)) for b in (0, 1)]
    run = {
        "plan": lambda: step.run(case.q, 0, weights),
        "one_shot": lambda: _one_shot(case, 0),
    }[api]
    first = run()
    _refused(case, run, ROTATED)
    for b in (0, 1):
        case.cache.append(b, 0, raw[b])
    assert torch.equal(run().view(torch.uint8), first.view(torch.uint8))


def test_state_is_per_step():
    """advance() ends the step: the plan's layers are refused until the next step's rows come."""
    case, step, weights = _two_layer_step(93)
    step.run(case.q, 0, weights)
    case.cache.advance()
    assert case.cache.new_rows_state(0, 0) == "none"
    message = NOT_APPENDED.replace("layer 1", "layer 0").replace("(0, 1,", "(0, 0,")
    _refused(case, lambda: step.run(case.q, 0, weights), message)


def test_rerun_layers_skips_only_the_rotated_check():
    case, step, weights = _two_layer_step(94, rerun_layers=True)
    for _ in range(3):
        step.run(case.q, 0, weights)
    assert case.cache.new_rows_state(0, 0) == "rotated"
    _refused(case, lambda: step.run(case.q, 1, weights), NOT_APPENDED)
    # A plan without the switch in the same step sees the rows as rotated.
    strict = pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options())
    _refused(case, lambda: strict.run(case.q, 0, weights), ROTATED)
    _one_shot(case, 0, rerun_layers=True)
    with pytest.raises(TypeError, match=r"^rerun_layers: expected a bool, got int$"):
        pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options(),
                   rerun_layers=1)  # fmt: skip


@pytest.mark.parametrize("untracked", ["check_values=False", "cache tensors"])
def test_untracked_plans_do_not_check_rows(untracked):
    """Without the value checks, or with the cache's bare tensors, there is no bookkeeping."""
    case, _, weights = _two_layer_step(95)
    cache = case.cache_tensors() if untracked == "cache tensors" else case.cache
    step = pymla.plan(
        cache, case.input_row_offsets, case.freqs_cis, case.decode_options(),
        check_values=untracked != "check_values=False",
    )  # fmt: skip
    step.run(case.q, 1, weights)  # layer 1 was never appended: not known here
    step.run(case.q, 1, weights)
    assert case.cache.new_rows_state(0, 1) == "none"


def test_runs_with_new_rows_may_repeat_and_mark_the_layer_rotated():
    """The op writes new_rows into the slots itself: running the layer again is harmless."""
    case = make_case(96, num_heads=2, cache_lengths=(5, 9), new_tokens=(1, 2), num_layers=2)
    rows = case.take_new_rows(seed=3)
    step = pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options())
    weights = case.layer_weights()
    first = step.run(case.q, case.layer_idx, weights, new_rows=rows)
    blocks = case.cache.blocks.clone()
    again = step.run(case.q, case.layer_idx, weights, new_rows=rows)
    assert torch.equal(again.view(torch.uint8), first.view(torch.uint8))
    assert torch.equal(case.cache.blocks.view(torch.uint8), blocks.view(torch.uint8))
    # The slots hold rotated rows now, so a run without new_rows is refused.
    message = ROTATED.replace("layer 0", "layer 1").replace("(0, 0,", "(0, 1,")
    _refused(case, lambda: step.run(case.q, case.layer_idx, weights), message)


def test_reserved_rows_never_appended_are_refused_at_run():
    """reserve() then a plan without new_rows: the slots were never written."""
    case = make_case(
        97, num_heads=2, cache_lengths=(4,), new_tokens=(0,), num_layers=1, layer_idx=0
    )
    case.cache.reserve(0, 1)
    case.q = torch.randn(1, 2, 192).to(case.q.dtype)
    case.input_row_offsets = torch.tensor([0, 1], dtype=torch.uint32)
    step = pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options())
    message = NOT_APPENDED.replace("layer 1", "layer 0").replace("(0, 1,", "(0, 0,")
    _refused(case, lambda: step.run(case.q, 0, case.layer_weights()), message)


def test_a_failed_launch_leaves_the_rows_raw(monkeypatch):
    """Rows are marked rotated only after the launch returned: a refused PYMLA_CPU_PATH keeps them."""
    case, step, weights = _two_layer_step(98)
    before = cache_snapshot(case.cache)
    monkeypatch.setenv("PYMLA_CPU_PATH", "no-such-path")
    with pytest.raises(Exception, match="PYMLA_CPU_PATH"):
        step.run(case.q, 0, weights)
    assert_cache_unchanged(case.cache, before)
    monkeypatch.delenv("PYMLA_CPU_PATH")
    step.run(case.q, 0, weights)
    assert case.cache.new_rows_state(0, 0) == "rotated"


def test_a_released_request_rides_along_empty():
    """release() keeps the batch's indices: the empty request gets no output rows."""
    case = make_case(
        99, num_heads=2, cache_lengths=(5, 9), new_tokens=(0, 1), num_layers=1, layer_idx=0
    )
    free = case.cache.num_free_pages
    case.cache.release(0)
    assert case.cache.num_free_pages == free + 1 and case.cache.cache_lengths.tolist() == [0, 9]
    step = pymla.plan(case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options())
    out = step.run(case.q, 0, case.layer_weights())
    assert out.shape == (1, 2, 128) and not torch.isnan(out).any()


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
            step = pymla.plan(c.cache, c.input_row_offsets, c.freqs_cis, c.decode_options())
            weights = c.layer_weights()
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
