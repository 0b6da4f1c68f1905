"""A multi-layer MLA decode in one MAX graph, with pymla standing in for MAX's op.

The graph is what a MAX pipeline builds: its KV cache inputs come from
``MLAKVCacheParams.get_symbolic_inputs()`` (MAX's types), each layer calls
``mla_decode_graph`` with MAX's arguments, and the only change from a MAX
model is the import of that function (``--impl max`` builds the same graph
with MAX's built-in, which runs on GPUs only). The new tokens' raw latent
rows enter through ``kv``; the op normalizes, rotates and stores them.

Every decode step is checked against pymla's torch reference (every layer's
output, the stored rows and every other cache byte), then timed: the step
(one ``execute`` of the N-layer graph) against the sum of its ops (each
layer's op alone, one ``execute`` of a one-layer graph each), best of
``--repeats``, side by side in the same run.

The cache is pymla's torch-owned :class:`pymla.PagedLatentCache`, bound to
MAX's KV input types by :func:`pymla.max_native.runtime_kv_inputs`. MAX's own
``PagedKVCacheManager`` (``max.pipelines.kv_cache``) allocates the same
``[pages, 1, layers, page_size, 1, 576]`` blocks and hands out the same inputs
(``runtime_inputs``), but ``max.pipelines`` imports huggingface_hub and other
packages that are not pymla's dependencies, so this example does not use it.

    python examples/multi_layer_decode.py                   # CPU, 4 layers, 16 heads
    python examples/multi_layer_decode.py --device gpu --log benchmarks/results/max_native_h200.log
    python examples/multi_layer_decode.py --device gpu --impl max --tokens 2   # MAX's built-in
    python examples/multi_layer_decode.py --device gpu --compare-with max      # both, same inputs
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from max import tree
from max.driver import CPU, Accelerator
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

import pymla
from pymla import bridge
from pymla.graph import kernels_path, mla_decode_graph
from pymla.max_native import runtime_kv_inputs
from pymla.parity import compare_cache, compare_output
from pymla.reference import (
    KVCacheTensors,
    default_scale,
    mla_decode_branch_fp8_stages,
    rope_freqs_cis,
)

RANK, ROPE, NOPE, V_HEAD = 512, 64, 128, 128  # DeepSeek-V3
EPSILON = 1e-6

QUANT_CONFIG = (
    QuantConfig(  # a DeepSeek-V3 checkpoint: 1x128 activation groups, 128x128 weight blocks
        input_scale=InputScaleSpec(
            granularity=ScaleGranularity.BLOCK,
            origin=ScaleOrigin.DYNAMIC,
            dtype=DType.float32,
            block_size=(1, 128),
        ),
        weight_scale=WeightScaleSpec(
            granularity=ScaleGranularity.BLOCK, dtype=DType.float32, block_size=(128, 128)
        ),
        mlp_quantized_layers=set(),
        attn_quantized_layers=set(),
        format=QuantFormat.BLOCKSCALED_FP8,
    )
)


@dataclass(frozen=True)
class Config:
    device: str
    impl: str
    layers: int
    heads: int
    batch: int
    context: int
    tokens: int
    steps: int
    page_size: int
    repeats: int
    seed: int

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda:0" if self.device == "gpu" else "cpu")

    @property
    def device_ref(self) -> DeviceRef:
        return DeviceRef.GPU(0) if self.device == "gpu" else DeviceRef.CPU()

    @property
    def weight_dtype(self) -> DType:
        """MAX's built-in takes fp8-typed weights; pymla takes their bytes (see pymla.max_native)."""
        return DType.float8_e4m3fn if self.impl == "max" else DType.uint8


def kv_params(cfg: Config) -> MLAKVCacheParams:
    return MLAKVCacheParams(
        dtype=DType.bfloat16,
        head_dim=RANK + ROPE,
        num_layers=cfg.layers,
        devices=[cfg.device_ref],
        page_size=cfg.page_size,
        num_q_heads=cfg.heads,
    )


def layer_input_types(cfg: Config) -> list[TensorType]:
    """One layer's inputs: q, kv, kv_norm_gamma, w_uk, w_uk_scale, w_uv, w_uv_scale."""
    dev, bf16, h = cfg.device_ref, DType.bfloat16, cfg.heads
    return [
        TensorType(bf16, ["tokens", h, NOPE + ROPE], dev),
        TensorType(bf16, ["tokens", RANK + ROPE], dev),
        TensorType(bf16, [RANK], dev),
        TensorType(cfg.weight_dtype, [h, RANK, NOPE], dev),
        TensorType(DType.float32, [h, RANK // 128, NOPE // 128], dev),
        TensorType(cfg.weight_dtype, [h, V_HEAD, RANK], dev),
        TensorType(DType.float32, [h, V_HEAD // 128, RANK // 128], dev),
    ]


def build_graph(cfg: Config, layers: list[int] | None) -> Graph:
    """``layers``: the layer indices of an N-layer step graph; None: one op whose layer is an input."""
    params = kv_params(cfg)
    kv_types, _ = tree.flatten(params.get_symbolic_inputs())
    per_layer = layer_input_types(cfg)
    count = len(layers) if layers is not None else 1
    shared = [
        TensorType(DType.uint32, ["offsets"], cfg.device_ref),
        TensorType(DType.bfloat16, ["max_seq_len", ROPE], cfg.device_ref),
    ]
    layer_input = [] if layers is not None else [TensorType(DType.uint32, [], DeviceRef.CPU())]
    if cfg.impl == "max":
        from max.nn.kernels import mla_decode_graph as decode  # MAX's built-in (GPU only)
    else:
        decode = mla_decode_graph
    with Graph(
        "multi_layer_decode" if layers is not None else "one_layer",
        input_types=[*shared, *layer_input, *(per_layer * count), *kv_types],
        custom_extensions=[kernels_path()],
    ) as graph:
        inputs = list(graph.inputs)
        offsets, freqs = (v.tensor for v in inputs[:2])
        position = 2 + len(layer_input)
        (kv_collection,) = params.unflatten_kv_inputs(iter(inputs[position + 7 * count :]))
        outputs = []
        for i in range(count):
            q, kv, gamma, w_uk, w_uk_scale, w_uv, w_uv_scale = (
                v.tensor for v in inputs[position + 7 * i : position + 7 * (i + 1)]
            )
            layer_idx = (
                inputs[2].tensor
                if layers is None
                else ops.constant(layers[i], DType.uint32, device=DeviceRef.CPU())
            )
            outputs.append(
                decode(
                    q,
                    kv,
                    offsets,
                    freqs,
                    gamma,
                    w_uk,
                    w_uv,
                    params,
                    kv_collection,
                    layer_idx,
                    MHAMaskVariant.CAUSAL_MASK,
                    default_scale(),
                    EPSILON,
                    V_HEAD,
                    kv_collection.attention_dispatch_metadata,
                    kv_collection.mla_num_partitions,
                    w_uk_scale=w_uk_scale,
                    w_uv_scale=w_uv_scale,
                    quant_config=QUANT_CONFIG,
                )
            )
        graph.output(*outputs)
    return graph


@dataclass
class Layer:
    gamma: torch.Tensor
    weights: dict[str, torch.Tensor]

    def tensors(self, q: torch.Tensor, kv: torch.Tensor) -> list[torch.Tensor]:
        w = self.weights
        return [q, kv, self.gamma, w["w_uk"], w["w_uk_scale"], w["w_uv"], w["w_uv_scale"]]


def make_layers(cfg: Config, g: torch.Generator) -> list[Layer]:
    layers = []
    for _ in range(cfg.layers):
        weights = pymla.make_mla_weights(cfg.heads, RANK, NOPE, V_HEAD, generator=g)
        gamma = (1 + 0.25 * torch.randn(RANK, generator=g)).to(torch.bfloat16)
        layers.append(
            Layer(gamma, {k: weights[k] for k in ("w_uk", "w_uk_scale", "w_uv", "w_uv_scale")})
        )
    return layers


def buffers(cfg: Config, tensors: list[torch.Tensor]) -> list:
    """MAX buffers over the tensors on the run's device (fp8 typed as the graph's weights)."""
    out = []
    for t in tensors:
        b = bridge.to_max(t.to(cfg.torch_device).contiguous())
        out.append(b.view(cfg.weight_dtype) if t.dtype == torch.float8_e4m3fn else b)
    return out


def new_rows_mask(cache: pymla.PagedLatentCache) -> torch.Tensor:
    """True at every layer's cache row of this step's new tokens."""
    mask = torch.zeros(cache.blocks.shape[:-1], dtype=torch.bool)
    for b in range(cache.num_requests):
        pages = cache.pages_of(b)
        for pos in range(cache.length(b), cache.length(b) + cache.pending(b)):
            mask[pages[pos // cache.page_size], 0, :, pos % cache.page_size, 0] = True
    return mask


def machine(cfg: Config) -> str:
    if cfg.device == "gpu":
        return torch.cuda.get_device_name(0)
    try:
        from pymla.cpu_paths import cpu_model
    except ImportError:
        return platform.processor() or "cpu"
    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def relative_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm())


def builtin_rows(out: torch.Tensor, ref: torch.Tensor, offsets: torch.Tensor) -> str:
    """Where MAX's built-in put what, with several tokens per request (layer 0).

    Its H100/H200 decode kernel (``mla_decoding`` in MAX's ``max/kernels/src/nn/attention/gpu/mla.mojo``) runs
    one query per request: the request's first token, over all of its
    ``cache_length + new_tokens`` keys, written to output row ``b`` (the batch
    index) rather than to the token's row. This compares rows ``0..B-1``
    with each request's first and last token of the reference.
    """
    starts = offsets[:-1].to(torch.int64)
    firsts, lasts = ref[starts], ref[offsets[1:].to(torch.int64) - 1]
    batch = out[: len(starts)]
    return (
        f"built-in layer 0, rows 0..{len(starts) - 1} vs the reference's first token of each "
        f"request: rel L2 {relative_l2(batch, firsts):.4f}, vs its last token: "
        f"{relative_l2(batch, lasts):.4f}; all rows vs their own tokens: {relative_l2(out, ref):.4f}"
    )


def timed(model, args: list, sync) -> float:
    """Seconds for one execution of ``model`` (its device work included)."""
    start = time.perf_counter()
    model.execute(*args)
    sync()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--impl", choices=("pymla", "max"), default="pymla")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=2048, help="cached tokens of request 0 at step 0")
    p.add_argument("--tokens", type=int, default=1, help="new tokens per request and step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compare-with",
        choices=("max", "pymla"),
        help="also run each step with this implementation in the same graph, on the same inputs "
        "and cache (max: MAX's built-in, GPU only; pymla on the CPU checks this comparison itself)",
    )
    p.add_argument("--log", help="also write the printed lines to this file")
    a = p.parse_args(argv)
    cfg = Config(
        a.device, a.impl, a.layers, a.heads, a.batch, a.context, a.tokens, a.steps,
        a.page_size, a.repeats, a.seed,
    )  # fmt: skip
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    dev = cfg.torch_device
    max_dev = Accelerator(0) if cfg.device == "gpu" else CPU()
    session = InferenceSession(devices=[max_dev])
    say(f"# multi_layer_decode: impl={cfg.impl} on {machine(cfg)}")
    say(f"# {cfg}")
    start = time.perf_counter()
    step_model = session.load(build_graph(cfg, list(range(cfg.layers))))
    one_model = session.load(build_graph(cfg, None))
    peer = dataclasses.replace(cfg, impl=a.compare_with) if a.compare_with else None
    peer_model = session.load(build_graph(peer, list(range(cfg.layers)))) if peer else None
    say(
        f"# compiled the {cfg.layers}-layer step graph and the one-op graph in {time.perf_counter() - start:.1f} s"
    )

    g = torch.Generator().manual_seed(cfg.seed)
    layers = make_layers(cfg, g)
    lengths = [cfg.context + 97 * b for b in range(cfg.batch)]  # ragged batch
    most = max(lengths) + cfg.steps * cfg.tokens
    pages = sum(-(-(n + cfg.steps * cfg.tokens) // cfg.page_size) for n in lengths) + 4
    cache = pymla.PagedLatentCache(
        num_blocks=pages, page_size=cfg.page_size, num_layers=cfg.layers,
        dtype=torch.bfloat16, shuffle_pages=True, generator=g,
    )  # fmt: skip
    cache.blocks.copy_(torch.randn(cache.blocks.shape, generator=g).to(torch.bfloat16))
    for n in lengths:
        cache.fill(cache.add_request(), n, generator=g)
    cache.to(dev)
    freqs = rope_freqs_cis(most + 1, ROPE).to(torch.bfloat16)
    T = cfg.batch * cfg.tokens
    offsets = torch.arange(0, T + 1, cfg.tokens, dtype=torch.int64).to(torch.uint32)
    params = kv_params(cfg)
    sync = max_dev.synchronize

    say(
        "step | cached (min..max) | max rel L2 | cache rows | step ms | sum of ops ms | step / sum"
        " | median paired ratio | ops ms (per layer)"
    )
    all_passed, paired = True, []
    best_step, best_ops = float("inf"), [float("inf")] * cfg.layers
    for step in range(cfg.steps):
        qs = [
            (torch.randn(T, cfg.heads, NOPE + ROPE, generator=g) * 1.5).to(torch.bfloat16)
            for _ in layers
        ]
        kvs = [
            (torch.randn(T, RANK + ROPE, generator=g) * 2 + 0.5).to(torch.bfloat16) for _ in layers
        ]
        # pymla's op stores the rows it gets through kv: the step only reserves their pages.
        # MAX's built-in is also given every layer's raw rows in the cache, so that either
        # convention (rows through kv, or rows written beforehand) is met.
        for b in range(cfg.batch):
            if cfg.impl == "max":
                for layer in range(cfg.layers):
                    cache.append(b, layer, kvs[layer][b * cfg.tokens : (b + 1) * cfg.tokens])
            else:
                cache.reserve(b, cfg.tokens)
        before = cache.blocks.to("cpu", copy=True)
        reference = KVCacheTensors(
            before.clone(), cache.cache_lengths.cpu(), cache.lookup_table.cpu()
        )
        expected = [
            mla_decode_branch_fp8_stages(
                qs[i], offsets, freqs, layer.gamma, reference, i,
                layer.weights["w_uk"], layer.weights["w_uk_scale"],
                layer.weights["w_uv"], layer.weights["w_uv_scale"],
                scale=default_scale(), epsilon=EPSILON, scale_granularity="blockwise",
                mask="causal", new_rows=kvs[i],
            ).out
            for i, layer in enumerate(layers)
        ]  # fmt: skip
        kv_inputs, _ = tree.flatten(runtime_kv_inputs(cache, params))
        shared = buffers(cfg, [offsets, freqs])
        per_layer = [buffers(cfg, layer.tensors(qs[i], kvs[i])) for i, layer in enumerate(layers)]
        step_args = [*shared, *(b for layer in per_layer for b in layer), *kv_inputs]
        layer_ids = [bridge.to_max(torch.tensor(i, dtype=torch.uint32)) for i in range(cfg.layers)]

        if cfg.device == "gpu":
            torch.cuda.synchronize()  # torch's writes (cache tables, inputs) before MAX's stream reads
        outs = step_model.execute(*step_args)
        sync()
        outs = [bridge.to_torch(o).cpu() for o in outs]
        reports = [compare_output(o, e) for o, e in zip(outs, expected, strict=True)]
        cache_report = compare_cache(
            before, cache.blocks.cpu(), reference.blocks, new_rows_mask(cache)
        )
        passed = all(r.passed for r in reports) and cache_report.passed
        all_passed &= passed

        # The step and its ops interleaved, --repeats times, so that both see the same load:
        # the best of each, and the median of the paired ratios (robust to a changing load).
        op_args = [[*shared, layer_ids[i], *per_layer[i], *kv_inputs] for i in range(cfg.layers)]
        for args in op_args:  # warm-up (the step graph ran above)
            timed(one_model, args, sync)
        steps, ops = [], []
        for _ in range(cfg.repeats):
            steps.append(timed(step_model, step_args, sync))
            ops.append([timed(one_model, args, sync) for args in op_args])
        step_s, op_s = min(steps), [min(column) for column in zip(*ops, strict=True)]
        ratio = step_s / sum(op_s)
        ratios = [t / sum(o) for t, o in zip(steps, ops, strict=True)]
        paired.extend(ratios)
        best_step = min(best_step, step_s)
        best_ops = [min(x, y) for x, y in zip(best_ops, op_s, strict=True)]
        cached = cache.cache_lengths.cpu().to(torch.int64)
        say(
            f"{step} | {int(cached.min())}..{int(cached.max())} | "
            f"{max(r.relative_l2 for r in reports):.4f}{'' if passed else ' FAIL'} | "
            f"{cache_report.rows_updated} {'ok' if cache_report.passed else 'FAIL'} | "
            f"{step_s * 1e3:.2f} | {sum(op_s) * 1e3:.2f} | {ratio:.3f} | "
            f"{statistics.median(ratios):.3f} | " + " ".join(f"{t * 1e3:.2f}" for t in op_s)
        )
        if not passed:
            for i, r in enumerate(reports):
                say(f"#   layer {i}: {r.describe()}")
            say(f"#   cache: {cache_report.describe()}")
        if cfg.impl == "max" and cfg.tokens > 1:
            say("#   " + builtin_rows(outs[0], expected[0], offsets))
        if peer_model is not None:
            # The same step with the other implementation, from the same cache, then back.
            mine = cache.blocks.clone()
            cache.blocks.copy_(before.to(dev))  # same storage: kv_inputs still point at it
            for b in range(cfg.batch):  # every layer's raw rows, for either convention
                for layer in range(cfg.layers):
                    rows = kvs[layer][b * cfg.tokens : (b + 1) * cfg.tokens]
                    cache.write(b, layer, cache.length(b), rows)
            peer_args = [
                *shared,
                *(
                    x
                    for i, layer in enumerate(layers)
                    for x in buffers(peer, layer.tensors(qs[i], kvs[i]))
                ),
                *kv_inputs,
            ]
            if cfg.device == "gpu":
                torch.cuda.synchronize()
            peer_outs = peer_model.execute(*peer_args)
            sync()
            peer_outs = [bridge.to_torch(o).cpu() for o in peer_outs]
            vs_ref = max(relative_l2(o, e) for o, e in zip(peer_outs, expected, strict=True))
            vs_mine = max(relative_l2(o, m) for o, m in zip(peer_outs, outs, strict=True))
            peer_s = min(timed(peer_model, peer_args, sync) for _ in range(cfg.repeats))
            say(
                f"#   {peer.impl} in the same graph: max rel L2 vs the reference {vs_ref:.4f}, "
                f"vs {cfg.impl} {vs_mine:.4f}; its step {peer_s * 1e3:.2f} ms"
            )
            if peer.impl == "max" and cfg.tokens > 1:
                say("#   " + builtin_rows(peer_outs[0], expected[0], offsets))
            cache.blocks.copy_(mine)
        cache.advance()

    say(f"# parity with the reference: {'ALL PASS' if all_passed else 'FAILED'}")
    say(
        f"# step / sum of its ops (target <= 1.1): best step of the run {best_step * 1e3:.2f} ms"
        f" / sum of each layer's best op {sum(best_ops) * 1e3:.2f} ms = "
        f"{best_step / sum(best_ops):.3f}; median of {len(paired)} paired ratios "
        f"{statistics.median(paired):.3f}"
    )
    if a.log:
        with open(a.log, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
