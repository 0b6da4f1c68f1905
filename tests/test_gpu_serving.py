"""GPU serving path (issue 13): run() never waits on the host, and a step replays from a CUDA graph.

Skipped without CUDA. What each test shows:

- ``test_run_returns_before_queued_torch_work_finishes``: torch's stream is
  kept busy (``torch.cuda._sleep``) and q is rewritten after the sleep; run()
  must return at once (no host synchronization, MAX's or torch's) and its
  output must still come from the rewritten q (MAX waited for torch's stream).
- ``test_no_host_sync_under_sync_debug_mode``: ``torch.cuda.set_sync_debug_mode("error")``
  sees no synchronizing torch call in run() (plan() may copy to the host).
- ``test_run_on_the_op_stream_equals_run_on_another_stream``: a step issued
  under ``torch.cuda.stream(pymla.op_stream(dev))`` (no events) gives the
  bytes of the same step issued on torch's default stream (with events).
- ``test_cuda_graph_replay_of_a_many_layer_step_equals_eager``: a step of
  several layers captured with ``torch.cuda.graph`` and replayed gives the
  eager step's bytes (output and cache). When capture fails, the failure
  message is MAX's reason.

Run: ``python -m pytest tests/test_gpu_serving.py -q`` (under 2 minutes after the compile).
"""

from __future__ import annotations

import time

import pytest
import torch

import pymla
from pymla.tools.scenario import make_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYERS = 8


def _step_inputs(seed: int, layers: int = LAYERS):
    case = make_case(
        seed,
        num_heads=16,
        cache_lengths=(100, 37, 700),
        new_tokens=(1, 2, 1),
        num_layers=layers,
        layer_idx=0,
    )
    case.to("cuda")
    g = torch.Generator().manual_seed(seed + 1)
    qs = [torch.randn(case.q.shape, generator=g).to(case.q) for _ in range(layers)]
    w = case.weights
    weights = [
        pymla.LayerWeights(
            w["w_uk"], w["w_uk_scale"], w["w_uv"], w["w_uv_scale"], case.kv_norm_gamma
        )
        for _ in range(layers)
    ]
    options = pymla.DecodeOptions(
        **{k: v for k, v in case.options.items() if k != "scale_granularity"}
    )
    # Every test runs the same layers again (eager, op-stream, capture, replay): rows are rotated
    # again each time, which these tests compare bytewise, not against the reference.
    step = pymla.plan(
        case.cache, case.input_row_offsets, case.freqs_cis, options, rerun_layers=True
    )
    outs = [torch.empty(case.q.shape[0], 16, 128, dtype=case.q.dtype, device="cuda") for _ in qs]
    return case, step, qs, weights, outs


def _run_step(step, qs, weights, outs) -> None:
    for layer, (q, w, out) in enumerate(zip(qs, weights, outs, strict=True)):
        step.run(q, layer, w, out=out)


def test_run_returns_before_queued_torch_work_finishes():
    case, step, qs, weights, outs = _step_inputs(1, layers=1)
    step.run(qs[0], 0, weights[0], out=outs[0])  # compile, warm
    blocks = case.cache.blocks.clone()
    new_q = torch.randn_like(qs[0])
    torch.cuda.synchronize()

    torch.cuda._sleep(2_000_000_000)  # roughly a second of GPU time on torch's stream
    qs[0].copy_(new_q)  # queued behind the sleep
    start = time.perf_counter()
    step.run(qs[0], 0, weights[0], out=outs[0])
    host_s = time.perf_counter() - start
    got = outs[0].clone()  # torch's stream: must wait for MAX's work
    torch.cuda.synchronize()
    assert host_s < 0.2, f"run() took {host_s:.3f} s of host time: it waited for the GPU"

    case.cache.blocks.copy_(blocks)
    expected = step.run(new_q, 0, weights[0])
    torch.cuda.synchronize()
    assert torch.equal(got, expected), "MAX read q before torch's queued copy_ into it"


def test_no_host_sync_under_sync_debug_mode():
    _, step, qs, weights, outs = _step_inputs(2)
    _run_step(step, qs, weights, outs)  # compile, warm
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run_step(step, qs, weights, outs)
        step.run(qs[0], 0, weights[0])  # out=None: allocated on the device, no sync
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


def test_run_on_the_op_stream_equals_run_on_another_stream():
    case, step, qs, weights, outs = _step_inputs(4)
    pristine = case.cache.blocks.clone()
    _run_step(step, qs, weights, outs)  # default stream: ordered by events
    torch.cuda.synchronize()
    expected = [out.clone() for out in outs]
    expected_blocks = case.cache.blocks.clone()

    op_stream = pymla.op_stream("cuda")
    assert op_stream.cuda_stream != torch.cuda.current_stream().cuda_stream
    op_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(op_stream):
        case.cache.blocks.copy_(pristine)  # torch work on the op's stream, then the op's
        for out in outs:
            out.fill_(float("nan"))
        _run_step(step, qs, weights, outs)
        got = [out.clone() for out in outs]  # on the same stream: after the op
    torch.cuda.current_stream().wait_stream(op_stream)
    torch.cuda.synchronize()
    for layer, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"layer {layer}: op stream != default stream"
    assert torch.equal(case.cache.blocks, expected_blocks), "cache differs on the op stream"


def test_cuda_graph_replay_of_a_many_layer_step_equals_eager():
    case, step, qs, weights, outs = _step_inputs(3)
    pristine = case.cache.blocks.clone()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _run_step(step, qs, weights, outs)  # warm-up on a side stream, as torch recommends
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            _run_step(step, qs, weights, outs)
    except Exception as e:  # the reason is the finding
        pytest.fail(f"torch.cuda.graph could not capture pymla's run(): {type(e).__name__}: {e}")

    # New q values in the captured tensors, the cache reset: replay vs eager.
    g = torch.Generator().manual_seed(30)
    for q in qs:
        q.copy_(torch.randn(q.shape, generator=g).to(q))
    case.cache.blocks.copy_(pristine)
    for out in outs:
        out.fill_(float("nan"))
    graph.replay()
    replayed = [out.clone() for out in outs]
    replayed_blocks = case.cache.blocks.clone()

    case.cache.blocks.copy_(pristine)
    _run_step(step, qs, weights, outs)
    torch.cuda.synchronize()
    for layer, (a, b) in enumerate(zip(replayed, outs, strict=True)):
        assert not torch.isnan(a).any(), f"layer {layer}: replay left outputs unwritten"
        assert torch.equal(a, b), f"layer {layer}: replay != eager"
    assert torch.equal(replayed_blocks, case.cache.blocks), "cache after replay != after eager"
