"""``python -m pymla overhead`` and ``python -m pymla step``: what the Python layer costs.

overhead: host time per :meth:`pymla.DecodePlan.run` minus the time per
``model.execute`` of the same compiled model on prepared buffers (the floor
any caller of MAX pays), on a tiny problem so the kernel itself is short.
The one-shot public call (plan + run) is timed beside them.

step: one decode step of a 61-layer model (DeepSeek-V3 shapes, 16 heads, one
GPU's share at 8-way tensor parallelism): plan once, run 61 layers; the step's
wall time beside the sum of its 61 kernel times (execute on prepared buffers;
on a GPU also the kernels' device time from torch.profiler, and the step
replayed from a CUDA graph where capture works).

Timings are medians of repeats; on a shared machine repeat and take the best.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import time

import torch

from .. import runtime
from ..__main__ import CommandParser, int_at_least, json_file, torch_device
from ..cpu_paths import cpu_model, cpu_signature
from ..plan import plan
from .scenario import make_case
from .timing import time_call

NUM_LAYERS = 61  # DeepSeek-V3
HEADS = 16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_overhead(device: str, dtype: torch.dtype, repeat: int, inner: int) -> dict:
    """Seconds per run(), per execute on prepared buffers, and per one-shot call, tiny problem."""
    dev = torch.device(device)
    case = make_case(7, dtype=dtype, num_heads=1, cache_lengths=(16,), new_tokens=(1,))
    case.to(dev)
    weights = case.layer_weights()
    # Every timed call runs the same layer again (its new rows are rotated once more each time).
    step = plan(
        case.cache, case.input_row_offsets, case.freqs_cis, case.decode_options(), rerun_layers=True
    )
    out = torch.empty(1, 1, 128, dtype=dtype, device=dev)
    layer = case.layer_idx
    step.run(case.q, layer, weights, out=out)  # compiles or loads the model
    model = step.model
    buffers = step.buffers(case.q, layer, weights, out)
    launch = runtime.launcher(model, dev)  # what run() launches with
    bare = runtime.executor(model)  # the model's execute alone: no stream ordering on a GPU

    def execute() -> None:
        launch(buffers)

    def bare_execute() -> None:
        bare(buffers)

    def run() -> None:
        step.run(case.q, layer, weights, out=out)

    from ..op import mla_decode_branch_fp8

    def one_shot() -> None:
        mla_decode_branch_fp8(*case.args(), **case.options, out=out, rerun_layers=True)

    # Interleaved batch by batch, so a change in the machine's load hits every series alike;
    # the overheads are medians of the differences within a batch group (paired), best of
    # three rounds (the machine is shared).
    fns = {"execute": execute, "run": run, "one_shot": one_shot, "bare_execute": bare_execute}
    streams = {}
    if dev.type == "cuda":  # run() with torch's current stream = the op's stream: no events
        fns["run_on_op_stream"] = run
        streams["run_on_op_stream"] = runtime.op_stream(dev)
    rounds = [_interleaved(fns, dev, repeat, inner, streams) for _ in range(3)]
    best = {k: min(statistics.median(r[k]) for r in rounds) for k in fns}

    def paired(name: str) -> float:
        return min(
            statistics.median(a - b for a, b in zip(r[name], r["execute"], strict=True))
            for r in rounds
        )

    return {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "execute_s": best["execute"],
        "bare_execute_s": best["bare_execute"],
        "run_s": best["run"],
        "one_shot_s": best["one_shot"],
        "run_overhead_s": paired("run"),
        "one_shot_overhead_s": paired("one_shot"),
        "run_on_op_stream_s": best.get("run_on_op_stream"),
    }


def _interleaved(
    fns: dict, device: torch.device, repeat: int, inner: int, streams: dict
) -> dict[str, list]:
    """Seconds per call of each function: ``repeat`` groups of one ``inner``-call batch each.

    A function named in ``streams`` runs its batches with that torch stream current.
    """
    samples: dict[str, list] = {name: [] for name in fns}
    for group in range(repeat + 2):  # the first two groups warm up
        for name, fn in fns.items():
            stream = streams.get(name)
            start = time.perf_counter()
            if stream is None:
                for _ in range(inner):
                    fn()
            else:
                with torch.cuda.stream(stream):
                    for _ in range(inner):
                        fn()
            _sync(device)
            if group >= 2:
                samples[name].append((time.perf_counter() - start) / inner)
    return samples


def _devices(text: str) -> list[str]:
    """The --device type: cpu, cuda[:N], or all (the CPU, and cuda where torch sees a GPU)."""
    if text == "all":
        return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [torch_device(text)]


def _print_table(title: str, header: tuple[str, ...], rows: list[tuple]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    print(title)
    print("  " + "  ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  " + "  ".join(f"{x!s:>{w}}" for x, w in zip(row, widths, strict=True)))


def _machine() -> dict:
    info = {
        "cpu": cpu_model(),
        "cpu_signature": cpu_signature(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _save(path: pathlib.Path | None, payload: dict) -> None:
    if path:
        path.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"saved {path}")


def _parser(prog: str, doc: str) -> CommandParser:
    """The options both commands share: device, dtype, repeats and the JSON file."""
    parser = CommandParser(prog, doc)
    parser.add_argument(
        "--device", type=_devices, default="all", help="cpu, cuda[:N], or all available"
    )
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="op dtype"
    )
    parser.add_argument(
        "--json", metavar="PATH", type=json_file, help="also save the results as JSON here"
    )
    return parser


def run_overhead(argv: list[str], prog: str) -> int:
    parser = _parser(
        prog,
        "Host overhead per run(): time per run() minus time per execute of the same "
        "compiled model on prepared buffers (1 request, 1 new token, 16 cached tokens, 1 head).",
    )
    parser.add_argument(
        "--repeat", type=int_at_least(1), default=15, help="timed batches per measurement"
    )
    parser.add_argument("--inner", type=int_at_least(1), default=100, help="calls per timed batch")
    args = parser.parse_args(argv)
    try:
        results = [
            measure_overhead(d, getattr(torch, args.dtype), args.repeat, args.inner)
            for d in args.device
        ]
    except (RuntimeError, ValueError, TypeError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    machine = _machine()
    us = 1e6
    _print_table(
        f"pymla host overhead per call ({machine['cpu']}, {machine['cpu_signature']}, {machine['threads']} threads"
        + (f", {machine['gpu']}" if "gpu" in machine else "")
        + f", load {machine['load_average_1min']}), microseconds, best of 3 rounds",
        (
            "device",
            "dtype",
            "execute",
            "run()",
            "run() - execute",
            "one-shot",
            "one-shot - execute",
            "bare execute",
            "run() on op stream",
        ),
        [
            (
                r["device"],
                r["dtype"],
                f"{r['execute_s'] * us:.1f}",
                f"{r['run_s'] * us:.1f}",
                f"{r['run_overhead_s'] * us:.1f}",
                f"{r['one_shot_s'] * us:.1f}",
                f"{r['one_shot_overhead_s'] * us:.1f}",
                f"{r['bare_execute_s'] * us:.1f}",
                "-" if r["run_on_op_stream_s"] is None else f"{r['run_on_op_stream_s'] * us:.1f}",
            )
            for r in results
        ],
    )
    print(
        "  execute: the launch run() makes (on a GPU with its two stream-ordering events) on\n"
        "  prepared buffers; bare execute: the model's execute alone; run() on op stream: run()\n"
        "  with torch's current stream = pymla.op_stream (no events). Each column is a median\n"
        "  per call; the '- execute' columns are medians of paired differences (batches\n"
        "  interleaved), so they need not equal the difference of the two columns."
    )
    _save(args.json, {"machine": machine, "results": results})
    return 0


# ---------------------------------------------------------------- decode step


def _gpu_kernel_seconds(fn, device: torch.device) -> float | None:
    """Device time of the CUDA kernels ``fn`` launches (torch.profiler sees MAX's kernels too)."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    # Device-side events only (kernels, memcpys): CPU ops' device totals would count them twice.
    total_us = sum(
        e.time_range.elapsed_us()
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return total_us / 1e6 if total_us else None


def measure_step(device: str, dtype: torch.dtype, batch: int, context: int, repeat: int) -> dict:
    dev = torch.device(device)
    case = make_case(
        11,
        dtype=dtype,
        num_heads=HEADS,
        page_size=64,
        cache_lengths=(context,) * batch,
        new_tokens=(1,) * batch,
        num_layers=NUM_LAYERS,
        layer_idx=0,
        extra_rows=0,
    )
    case.to(dev)
    g = torch.Generator(device="cpu").manual_seed(12)
    qs = [
        torch.randn(case.q.shape, generator=g).to(dtype=dtype, device=dev)
        for _ in range(NUM_LAYERS)
    ]
    weights = [case.layer_weights() for _ in range(NUM_LAYERS)]  # same values, one object per layer
    outs = [torch.empty(batch, HEADS, 128, dtype=dtype, device=dev) for _ in range(NUM_LAYERS)]
    options = case.decode_options()

    def step() -> None:
        s = plan(case.cache, case.input_row_offsets, case.freqs_cis, options, check_values=False,
                 num_tokens=batch)  # fmt: skip
        for layer in range(NUM_LAYERS):
            s.run(qs[layer], layer, weights[layer], out=outs[layer])

    def checked_step() -> None:
        s = plan(case.cache, case.input_row_offsets, case.freqs_cis, options, rerun_layers=True)
        for layer in range(NUM_LAYERS):
            s.run(qs[layer], layer, weights[layer], out=outs[layer])

    step()
    _sync(dev)
    prepared = plan(case.cache, case.input_row_offsets, case.freqs_cis, options, rerun_layers=True)
    prepared.run(qs[0], 0, weights[0], out=outs[0])
    model = prepared.model
    buffers = [
        prepared.buffers(qs[layer], layer, weights[layer], outs[layer])
        for layer in range(NUM_LAYERS)
    ]

    launch = runtime.launcher(model, dev)

    def kernels_only() -> None:
        for b in buffers:
            launch(b)

    def synced(fn):
        def call() -> None:
            fn()
            _sync(dev)

        return call

    result = {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "layers": NUM_LAYERS,
        "heads": HEADS,
        "batch": batch,
        "context": context,
    }
    # Side by side, interleaved, best of three rounds (the machine is shared).
    timed = (("step_s", step), ("checked_step_s", checked_step), ("execute_sum_s", kernels_only))
    rounds = [
        {key: time_call(synced(fn), warmup=1, repeat=repeat) for key, fn in timed} for _ in range(3)
    ]
    result.update({key: min(r[key] for r in rounds) for key, _ in timed})
    if dev.type == "cuda":
        result["gpu_kernel_s"] = _gpu_kernel_seconds(step, dev)
        try:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                step()  # warm on the side stream, as torch.cuda.graph recommends
            torch.cuda.current_stream(dev).wait_stream(stream)
            with torch.cuda.graph(graph):
                step()
            result["replay_s"] = time_call(synced(graph.replay), warmup=1, repeat=repeat)
        except Exception as e:  # reported, not fatal: capture depends on MAX's runtime
            result["replay_s"] = None
            result["replay_error"] = f"{type(e).__name__}: {e}"
    return result


def run_step(argv: list[str], prog: str) -> int:
    parser = _parser(
        prog,
        f"One decode step: plan once, run {NUM_LAYERS} layers (DeepSeek-V3 shapes, {HEADS} heads); "
        "step wall time against the sum of its kernel times.",
    )
    parser.add_argument(
        "--batch", type=int_at_least(1), default=4, help="requests, one new token each"
    )
    parser.add_argument(
        "--context", type=int_at_least(0), default=512, help="cached tokens per request"
    )
    parser.add_argument(
        "--repeat", type=int_at_least(1), default=5, help="timed steps per measurement"
    )
    args = parser.parse_args(argv)
    try:
        results = [
            measure_step(d, getattr(torch, args.dtype), args.batch, args.context, args.repeat)
            for d in args.device
        ]
    except (RuntimeError, ValueError, TypeError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    machine = _machine()
    ms = 1e3

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x * ms:.3f}"

    _print_table(
        f"pymla decode step, {NUM_LAYERS} layers, {HEADS} heads, batch {args.batch}, "
        f"context {args.context} ({machine['cpu']}, {machine['threads']} threads"
        + (f", {machine['gpu']}" if "gpu" in machine else "")
        + "), milliseconds",
        ("device", "step", "step (checked)", "sum of executes", "step / executes",
         "GPU kernels", "replayed"),
        [
            (
                r["device"],
                fmt(r["step_s"]),
                fmt(r["checked_step_s"]),
                fmt(r["execute_sum_s"]),
                f"{r['step_s'] / r['execute_sum_s']:.3f}",
                fmt(r.get("gpu_kernel_s")),
                fmt(r.get("replay_s")),
            )
            for r in results
        ],
    )  # fmt: skip
    for r in results:
        if r.get("replay_error"):
            print(f"  {r['device']}: CUDA graph capture failed: {r['replay_error']}")
    print(
        "  step: plan(check_values=False) + 61 run(); step (checked): plan with every value check;\n"
        "  sum of executes: the 61 model.execute calls on prepared buffers (the floor)."
    )
    _save(args.json, {"machine": machine, "results": results, "time": time.time()})
    return 0
