"""The MAX-native drop-in ``pymla.graph.mla_decode_graph`` in a graph built from MAX's KV cache types.

One compiled model (bfloat16, CPU) serves every parity case: sizes are
symbolic, the new rows come in through ``kv``, and the cache crosses as
MAX's ``KVCacheInputsPerDevice`` (``PagedCacheValues`` in the graph) bound to
pymla's torch-owned cache by :func:`pymla.max_native.runtime_kv_inputs`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from max import tree
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, ops
from max.nn.attention.mask_config import MHAMaskVariant
from max.nn.kv_cache import MLAKVCacheParams
from max.nn.quant_config import (
    InputScaleSpec,
    QuantConfig,
    QuantFormat,
    ScaleGranularity,
    ScaleOrigin,
    WeightScaleSpec,
)

import pymla.graph
from pymla.args import MASKS
from pymla.max_native import (
    MASK_VARIANTS,
    SPARSE_DEFAULTS,
    mask_name,
    runtime_kv_inputs,
    scale_granularity,
)
from pymla.parity import compare_cache, compare_output
from pymla.quant import BLOCKWISE, PER_CHANNEL, PER_TENSOR
from pymla.reference import default_scale
from pymla.tools.scenario import make_case, reference_stages

HEADS = 16
LAYERS = 2
SCALE = default_scale() * 1.1  # folded into the graph, as MAX's op folds it
EPSILON = 1e-6
CPU_REF = DeviceRef.CPU()


def quant_config(
    block: int = 128,
    weights: ScaleGranularity = ScaleGranularity.BLOCK,
    inputs: ScaleGranularity = ScaleGranularity.BLOCK,
) -> QuantConfig:
    """MAX's config of a DeepSeek-V3 style checkpoint (block-scaled fp8), or other granularities."""

    def blocks(granularity: ScaleGranularity, size: tuple[int, int]) -> tuple[int, int] | None:
        return size if granularity == ScaleGranularity.BLOCK else None

    return QuantConfig(
        input_scale=InputScaleSpec(
            granularity=inputs,
            origin=ScaleOrigin.DYNAMIC,
            dtype=DType.float32,
            block_size=blocks(inputs, (1, block)),
        ),
        weight_scale=WeightScaleSpec(
            granularity=weights, dtype=DType.float32, block_size=blocks(weights, (block, block))
        ),
        mlp_quantized_layers=set(),
        attn_quantized_layers=set(range(LAYERS)),
        format=QuantFormat.BLOCKSCALED_FP8,
    )


def kv_params(page_size: int = 16, fp8: bool = False) -> MLAKVCacheParams:
    """MAX's cache parameters; ``fp8``: 656-byte ``fp8_ds_mla`` rows (uint8)."""
    return MLAKVCacheParams(
        dtype=DType.uint8 if fp8 else DType.bfloat16,
        head_dim=656 if fp8 else 576,
        num_layers=LAYERS,
        devices=[CPU_REF],
        page_size=page_size,
        num_q_heads=HEADS,
    )


def op_input_types() -> list[TensorType]:
    """q, kv, input_row_offsets, freqs_cis, kv_norm_gamma, w_uk, w_uk_scale, w_uv, w_uv_scale, layer_idx."""
    bf16 = DType.bfloat16
    return [
        TensorType(bf16, ["tokens", HEADS, 192], CPU_REF),
        TensorType(bf16, ["tokens", 576], CPU_REF),
        TensorType(DType.uint32, ["offsets"], CPU_REF),
        TensorType(bf16, ["max_seq_len", 64], CPU_REF),
        TensorType(bf16, [512], CPU_REF),
        TensorType(DType.uint8, [HEADS, 512, 128], CPU_REF),
        TensorType(DType.float32, [HEADS, 4, 1], CPU_REF),
        TensorType(DType.uint8, [HEADS, 128, 512], CPU_REF),
        TensorType(DType.float32, [HEADS, 1, 4], CPU_REF),
        TensorType(DType.uint32, [], CPU_REF),
    ]


def drop_in_graph(name: str, fp8: bool = False, **overrides) -> Graph:
    """A graph calling the drop-in with MAX's arguments (``overrides`` replace some; a callable gets the inputs).

    ``fp8``: the cache in the ``fp8_ds_mla`` format (``cache_format`` passed).
    """
    params = kv_params(fp8=fp8)
    kv_types, _ = tree.flatten(params.get_symbolic_inputs())
    with Graph(
        name,
        input_types=[*op_input_types(), *kv_types],
        custom_extensions=[pymla.graph.kernels_path()],
    ) as graph:
        q, kv, offsets, freqs, gamma, w_uk, w_uk_scale, w_uv, w_uv_scale, layer = (
            v.tensor for v in graph.inputs[:10]
        )
        (collection,) = params.unflatten_kv_inputs(iter(graph.inputs[10:]))
        args = dict(
            q=q,
            kv=kv,
            input_row_offsets=offsets,
            freqs_cis=freqs,
            kv_norm_gamma=gamma,
            w_uk=w_uk,
            w_uv=w_uv,
            kv_params=params,
            kv_collection=collection,
            layer_idx=layer,
            mask_variant=MHAMaskVariant.CAUSAL_MASK,
            scale=SCALE,
            epsilon=EPSILON,
            v_head_dim=128,
            scalar_args=collection.attention_dispatch_metadata,
            num_partitions_scalar=collection.mla_num_partitions,
            w_uk_scale=w_uk_scale,
            w_uv_scale=w_uv_scale,
            quant_config=quant_config(),
            **({"cache_format": "fp8_ds_mla"} if fp8 else {}),
        )
        args.update({k: v(graph) if callable(v) else v for k, v in overrides.items()})
        graph.output(pymla.graph.mla_decode_graph(**args))
    return graph


@pytest.fixture(scope="module")
def model():
    """The drop-in compiled once (bfloat16, CPU) for every parity case of this file."""
    return InferenceSession(devices=[CPU()]).load(drop_in_graph("max_native_decode"))


def run(model, case, rows: torch.Tensor, fp8: bool = False) -> torch.Tensor:
    w = case.weights
    tensors = [
        case.q,
        rows,
        case.input_row_offsets,
        case.freqs_cis,
        case.kv_norm_gamma,
        w["w_uk"].view(torch.uint8),
        w["w_uk_scale"],
        w["w_uv"].view(torch.uint8),
        w["w_uv_scale"],
        torch.tensor(case.layer_idx, dtype=torch.uint32),
    ]
    kv_buffers, _ = tree.flatten(runtime_kv_inputs(case.cache, kv_params(fp8=fp8)))
    (out,) = model.execute(*(Buffer.from_dlpack(t) for t in tensors), *kv_buffers)
    return torch.from_dlpack(out)


@pytest.mark.parametrize(
    "seed, cache_lengths, new_tokens",
    [
        (1, (5, 40, 0, 130), (1, 1, 1, 1)),
        (2, (5, 40, 0), (1, 2, 3)),
        (3, (300, 0, 17), (3, 0, 2)),
    ],
    ids=["one-token", "several-tokens", "zero-token-request"],
)
def test_drop_in_matches_reference(model, seed, cache_lengths, new_tokens):
    """New rows through ``kv``: output, the stored rows and every other cache byte vs the reference."""
    case = make_case(
        seed,
        num_heads=HEADS,
        num_layers=LAYERS,
        cache_lengths=cache_lengths,
        new_tokens=new_tokens,
    )
    case.options.update(scale=SCALE, epsilon=EPSILON)
    rows = case.take_new_rows(seed=seed + 100)  # their cache slots now hold other values
    before = case.cache.blocks.clone()
    stages, ref_blocks = reference_stages(case, new_rows=rows)
    out = run(model, case, rows)
    report = compare_output(out, stages.out)
    assert report.passed, report.describe()
    updated = case.new_rows_mask()
    cache_report = compare_cache(before, case.cache.blocks, ref_blocks, updated)
    assert cache_report.passed, cache_report.describe()
    assert cache_report.rows_updated == sum(new_tokens)
    assert not torch.equal(case.cache.blocks[updated], before[updated])


def test_drop_in_with_fp8_cache():
    """``cache_format="fp8_ds_mla"``: MAX's cache types of uint8 656-byte rows, the new rows through
    ``kv`` quantized by the op: output and cache bytes vs the reference (pymla.parity)."""
    model = InferenceSession(devices=[CPU()]).load(drop_in_graph("max_native_fp8", fp8=True))
    case = make_case(
        5,
        num_heads=HEADS,
        num_layers=LAYERS,
        cache_lengths=(5, 40, 0),
        new_tokens=(1, 2, 3),
        cache_format="fp8_ds_mla",
    )
    case.options.update(scale=SCALE, epsilon=EPSILON)
    rows = case.take_new_rows(seed=105)
    before = case.cache.blocks.clone()
    stages, ref_blocks = reference_stages(case, new_rows=rows)
    out = run(model, case, rows, fp8=True)
    report = compare_output(out, stages.out)
    assert report.passed, report.describe()
    updated = case.new_rows_mask()
    cache_report = compare_cache(before, case.cache.blocks, ref_blocks, updated, 512)
    assert cache_report.passed and cache_report.rows_updated == 6, cache_report.describe()


def test_fp8_cache_format_needs_uint8_params():
    with pytest.raises(ValueError, match="^cache_format: 'fp8_ds_mla' expects a bfloat16 q"):
        drop_in_graph("max_native_fp8_bad", cache_format="fp8_ds_mla")


def test_mask_variants():
    """Every MAX mask variant maps to pymla's mask of the same meaning, or raises naming it."""
    expected = {
        MHAMaskVariant.NULL_MASK: "null",
        MHAMaskVariant.CAUSAL_MASK: "causal",
        MHAMaskVariant.SLIDING_WINDOW_CAUSAL_MASK: "sliding_window_causal",
        MHAMaskVariant.CHUNKED_CAUSAL_MASK: "chunked_causal",
    }
    for variant in MHAMaskVariant:
        if variant in expected:
            assert mask_name(variant) == expected[variant]
        else:
            with pytest.raises(NotImplementedError, match=variant.name):
                mask_name(variant)
    assert set(MASK_VARIANTS.values()) == set(MASKS)


def test_scale_granularity_from_quant_config():
    assert scale_granularity(quant_config()) == BLOCKWISE
    assert scale_granularity(quant_config(), 64) == (1, 64, 64)
    tensor = quant_config(weights=ScaleGranularity.TENSOR, inputs=ScaleGranularity.TENSOR)
    assert scale_granularity(tensor) == PER_TENSOR
    per_channel = quant_config(weights=ScaleGranularity.ROWWISE, inputs=ScaleGranularity.COLWISE)
    assert scale_granularity(per_channel) == PER_CHANNEL
    with pytest.raises(NotImplementedError, match="quant_config"):
        scale_granularity(quant_config(weights=ScaleGranularity.TENSOR))
    with pytest.raises(NotImplementedError, match="quant_config=None"):
        scale_granularity(None)


@pytest.mark.parametrize("name", list(SPARSE_DEFAULTS))
def test_sparse_arguments_raise(name):
    def indices(graph):
        return ops.constant(np.zeros(4, dtype=np.int32), DType.int32, device=CPU_REF)

    given = {
        "sparse_indices_stride": 8,
        "sparse_attn_sink_inert": True,
        "index_share": True,
        "physical_indices": True,
        "index_kpool": 4,
        "index_pool_topk": 2,
        "index_kpool_select_tail": False,
        "selection_lag": 1,
    }.get(name, indices)
    with pytest.raises(NotImplementedError, match=name):
        drop_in_graph("sparse", **{name: given})


def test_argument_errors():
    """Arguments pymla cannot honour raise before anything compiles."""
    with pytest.raises(NotImplementedError, match="SLIDING_WINDOW_NONCAUSAL"):
        drop_in_graph("e", mask_variant=MHAMaskVariant.SLIDING_WINDOW_NONCAUSAL_MASK)
    with pytest.raises(ValueError, match="needs a window"):
        drop_in_graph("e", mask_variant=MHAMaskVariant.CHUNKED_CAUSAL_MASK)
    drop_in_graph("e", mask_variant=MHAMaskVariant.CHUNKED_CAUSAL_MASK, local_window_size=64)
    with pytest.raises(ValueError, match="score_mod"):
        drop_in_graph("e", score_mod="rope")
    with pytest.raises(ValueError, match="v_head_dim"):
        drop_in_graph("e", v_head_dim=64)
    with pytest.raises(ValueError, match="w_uk_scale"):
        drop_in_graph("e", w_uk_scale=None)
    with pytest.raises(NotImplementedError, match="quant_config=None"):
        drop_in_graph("e", quant_config=None)
    with pytest.raises(TypeError, match="uint8 bytes"):
        drop_in_graph("e", w_uk=lambda g: ops.cast(g.inputs[5].tensor, DType.float8_e4m3fn))
    with pytest.raises(TypeError, match="expected uint8"):
        drop_in_graph("e", w_uv=lambda g: ops.cast(g.inputs[7].tensor, DType.bfloat16))
