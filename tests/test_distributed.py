"""Context-parallel decode and tensor-parallel heads over torch.distributed: 2 and 3 ranks.

gloo on the CPU always; NCCL with one GPU per rank where torch sees enough GPUs (the same
cases, ALiBi replaced by no_pos: refused on a GPU shard).

Each world size spawns its ranks once (``distributed_worker.py``, one process
per rank, a gloo group on a file store) and runs every case of ``CASES``;
this process then checks each rank's results against the one-process op and
the reference: the output (equal on every rank, within the derived bound of
:mod:`pymla.parity` of the one-process op's), the merged attention output
and LSE, every shard's cache bytes (its new rows where it holds them, every
other byte unchanged), and a second decode step whose rows come as
``new_rows``, after which every shard holds exactly the whole cache's rows
of its positions, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import pymla
from pymla.parity import CACHE_TOLERANCE, compare_attention, compare_output
from pymla.tools.scenario import make_case, reference_stages

from helpers import lse_report, run_op_poisoned

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from distributed_worker import case_options, second_step  # noqa: E402

HERE = pathlib.Path(__file__).parent


def _dcp(
    name,
    seed,
    dtype,
    mask,
    score_mod="no_pos",
    window=0,
    interleave=1,
    steps=1,
    heads=8,
    exchange="all_gather",
):
    return dict(
        exchange=exchange,
        kind="dcp",
        name=name,
        seed=seed,
        dtype=dtype,
        heads=heads,
        page_size=16,
        cache_lengths=[70, 3, 0, 33],
        new_tokens=[3, 1, 4, 2],
        mask=mask,
        score_mod=score_mod,
        window=window,
        interleave=interleave,
        steps=steps,
    )


CASES = {
    2: [
        _dcp("causal", 4000, "bfloat16", "causal", steps=2),
        _dcp("null-alibi", 4001, "bfloat16", "null", "alibi_pos", interleave=16),
        _dcp("sliding", 4002, "bfloat16", "sliding_window_causal", "alibi_pos", 5, interleave=1),
        _dcp("chunked", 4003, "float32", "chunked_causal", window=8, interleave=64),
        _dcp("all-to-all", 4005, "bfloat16", "causal", exchange="all_to_all"),
        dict(_dcp("tp", 4004, "bfloat16", "causal", heads=128), kind="tp"),
    ],
    3: [
        _dcp("causal", 4010, "bfloat16", "causal", interleave=2, steps=2),
        _dcp("sliding", 4011, "float32", "sliding_window_causal", "alibi_pos", 4),
        _dcp(
            "all-to-all",
            4013,
            "bfloat16",
            "sliding_window_causal",
            "alibi_pos",
            3,
            16,
            heads=6,
            exchange="all_to_all",
        ),  # fmt: skip
        dict(_dcp("tp", 4012, "bfloat16", "chunked_causal", window=8, heads=96), kind="tp"),
    ],
}
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
BACKENDS = ["gloo"] + (["nccl"] if GPUS >= 2 else [])
"""gloo on the CPU always; NCCL, one GPU per rank, where torch sees two GPUs or more."""


def _cases(backend: str, world: int) -> list[dict]:
    """The cases of ``world`` ranks on ``backend``: on GPUs without ALiBi (refused on a shard)."""
    if backend == "gloo":
        return CASES[world]
    return [dict(spec, score_mod="no_pos") for spec in CASES[world]]


IDS = [
    (backend, world, spec["name"])
    for backend in BACKENDS
    for world in CASES
    if backend == "gloo" or world <= GPUS
    for spec in CASES[world]
]
_folders: dict = {}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """``spawned(backend, world)``: runs that world's ranks once; returns their results folder."""

    def run(backend: str, world: int):
        key = (backend, world)
        if key not in _folders:
            _folders[key] = _spawn(tmp_path_factory.mktemp(f"{backend}{world}"), backend, world)
        return _folders[key]

    yield run
    _folders.clear()


def _spawn(folder, backend: str, world: int):
    store = folder / "store"
    env = pymla.distributed.nccl_environment(dict(os.environ, OMP_NUM_THREADS="1"))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "distributed_worker.py"),
                str(rank),
                str(world),
                str(store),
                str(folder),
                json.dumps(_cases(backend, world)),
                backend,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} of {world} ({backend}) failed:\n{log[-4000:]}"
    return folder


def _results(folder, world: int, name: str) -> list[dict]:
    return [torch.load(folder / f"{name}-{rank}.pt") for rank in range(world)]


def _spec(backend: str, world: int, name: str) -> dict:
    return next(s for s in _cases(backend, world) if s["name"] == name)


def _single(spec: dict):
    """The one-process op on the whole cache: (case, out, attention_out, lse, reference stages)."""
    case = make_case(spec["seed"], **case_options(spec))
    stages, _ = reference_stages(case)
    out, att, lse = run_op_poisoned(case, lse=True)
    return case, out, att, lse, stages


@pytest.mark.parametrize(
    ("backend", "world", "name"), IDS, ids=[f"{b}-{w}ranks-{n}" for b, w, n in IDS]
)
def test_ranks_equal_the_one_process_op(spawned, backend, world, name):
    """Every rank's output vs the one-process op and the reference; each shard's cache bytes."""
    spec = _spec(backend, world, name)
    results = _results(spawned(backend, world), world, name)
    case, out, att, lse, stages = _single(spec)
    dtype = case.q.dtype
    for rank, r in enumerate(results[1:], start=1):  # every rank ends with the same output
        assert torch.equal(r["out"].view(torch.uint8), results[0]["out"].view(torch.uint8)), rank
    mine = results[0]["out"]
    if spec["kind"] == "tp":
        assert results[0]["local_heads"] == spec["heads"] // world
        report = compare_output(mine, out, other_op=True)
        assert report.passed, f"tensor parallel vs one process: {report.describe()}"
        if backend == "gloo":  # heads apart are the same sums in the same order here (<= 128 heads)
            assert torch.equal(mine.view(torch.uint8), out.view(torch.uint8))
        return
    pieces = world
    report = compare_output(mine, out, pieces, other_op=True)
    assert report.passed, f"DCP vs the one-process op: {report.describe()}"
    report = compare_output(mine, stages.out, pieces)
    assert report.passed, f"DCP vs the reference: {report.describe()}"
    held = sum(r["held_rows"] for r in results)
    assert held == case.input_row_offsets[-1], "each new row is written by exactly one rank"
    for rank, r in enumerate(results):
        assert r["cache_passed"], f"rank {rank}'s cache: {r['cache_report']}"
    t, h, rank_dim = att.shape
    b = dtype.itemsize
    if spec["exchange"] == "all_to_all":  # partials of H / N heads in, outputs of H / N heads in
        expected = (world - 1) * t * (h // world) * (rank_dim * b + 4 + out.shape[2] * b)
        assert results[0]["bytes_received"] == expected
        gathered = results[0]["gathered"].view(torch.uint8)
        assert torch.equal(mine.view(torch.uint8), gathered), "all_to_all != all_gather"
        return
    assert results[0]["bytes_received"] == (world - 1) * t * h * (rank_dim * b + 4)
    merged = results[0]["attention"]
    att_report = compare_attention(
        merged, stages.attention, stages.attention_magnitude, dtype, stages.score_magnitude
    )
    assert att_report.passed, f"merged attention: {att_report.describe()}"
    lse_check = lse_report(results[0]["lse"], stages, dtype)
    assert lse_check.passed, f"merged LSE: {lse_check.describe()}"


SECOND = sorted({(b, w) for b, w, _ in IDS})


@pytest.mark.parametrize(("backend", "world"), SECOND, ids=[f"{b}-{w}ranks" for b, w in SECOND])
def test_a_second_step_with_new_rows(spawned, backend, world):
    """Step 2 (rows as new_rows): outputs vs the one-process op; each shard holds exactly the
    whole cache's rows of its positions, bit for bit (on GPUs: within one ulp, another kernel
    than the CPU's wrote them)."""
    spec = next(s for s in _cases(backend, world) if s.get("steps", 1) > 1)
    results = _results(spawned(backend, world), world, spec["name"])
    case, *_ = _single(spec)
    case.cache.advance()
    q, offsets, rows = second_step(case, spec["seed"] + 1)
    stages, _ = reference_stages(
        dataclasses.replace(case, q=q, input_row_offsets=offsets), new_rows=rows
    )
    out = pymla.mla_decode_branch_fp8(
        q,
        offsets,
        case.freqs_cis,
        case.kv_norm_gamma,
        case.cache,
        case.layer_idx,
        *(case.weights[k] for k in ("w_uk", "w_uk_scale", "w_uv", "w_uv_scale")),
        **case.options,
        new_rows=rows,
    )
    case.cache.advance()
    report = compare_output(results[0]["out2"], out, world, other_op=True)
    assert report.passed, f"step 2, DCP vs the one-process op: {report.describe()}"
    dtype = q.dtype
    att_report = compare_attention(
        results[0]["attention2"],
        stages.attention,
        stages.attention_magnitude,
        dtype,
        stages.score_magnitude,
    )
    assert att_report.passed, f"step 2, merged attention: {att_report.describe()}"
    lse_check = lse_report(results[0]["lse2"], stages, dtype)
    assert lse_check.passed, f"step 2, merged LSE: {lse_check.describe()}"
    for rank, r in enumerate(results):
        shard = pymla.CacheShard(rank, world, spec["interleave"])
        for b, held in enumerate(r["rows"]):
            whole = case.cache.rows(b, case.layer_idx)
            mine = shard.positions(whole.shape[0])
            if backend == "gloo":
                assert torch.equal(held.view(torch.uint8), whole[mine].view(torch.uint8)), (rank, b)
            else:
                ref = whole[mine].float()
                err = (held.float() - ref).abs().max()
                assert err <= CACHE_TOLERANCE[dtype] * ref.abs().max(), (rank, b, float(err))


# ---------------------------------------------------------------- NVLink multicast off

MULTICAST_OFF = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
"""NCCL's, torch's symmetric memory's and NVSHMEM's switches (the device machines' KINDS.md)."""
CHILD = "import json, os, sys; print(json.dumps({k: os.environ.get(k) for k in sys.argv[1:]}))"


def test_nccl_environment_turns_multicast_off_for_processes_spawned_after_it(monkeypatch):
    names = list(pymla.distributed.NVLINK_MULTICAST_OFF)
    assert names == list(MULTICAST_OFF)
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(names[2], "kept")  # a variable already set keeps its value
    assert pymla.distributed.nccl_environment() is os.environ
    expected = {names[0]: "0", names[1]: "1", names[2]: "kept"}
    assert {name: os.environ.get(name) for name in names} == expected
    # A process started afterwards, with no env= of its own, inherits them.
    child = subprocess.run(
        [sys.executable, "-c", CHILD, *names], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == expected


def test_nccl_environment_of_a_process_to_start_leaves_this_ones_alone(monkeypatch):
    names = list(pymla.distributed.NVLINK_MULTICAST_OFF)
    for name in names:
        monkeypatch.delenv(name, raising=False)
    env = {"PATH": os.environ.get("PATH", ""), names[0]: "2"}
    assert pymla.distributed.nccl_environment(env) is env
    assert env == {"PATH": env["PATH"], names[0]: "2", names[1]: "1", names[2]: "1"}
    assert all(name not in os.environ for name in names)
    child = subprocess.run(
        [sys.executable, "-c", CHILD, *names], env=env, capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == {names[0]: "2", names[1]: "1", names[2]: "1"}


def test_the_multicast_variables_are_named_only_in_pymla_distributed():
    """Every place that starts NCCL or spawns ranks calls nccl_environment: no copies of the list."""
    root = HERE.parent
    owner = root / "pymla" / "distributed.py"
    files = [
        f
        for folder in ("pymla", "tests", "examples", "scripts")
        for f in (root / folder).rglob("*")
        if f.suffix in (".py", ".sh") and f != owner
    ]
    assert len(files) > 20
    here = pathlib.Path(__file__).resolve()
    copies = [
        f"{f.relative_to(root)}: {name}"
        for f in files
        for name in MULTICAST_OFF
        if f.read_text().count(name) > (f.resolve() == here)  # here: MULTICAST_OFF only
    ]
    assert copies == []
    assert all(name in owner.read_text() for name in MULTICAST_OFF)
