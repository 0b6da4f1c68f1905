"""``python -m pymla``: help, one-line usage errors, the program name, logging, the commands run."""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from pymla import cpu_paths
from pymla.__main__ import COMMANDS, main
from pymla.tools import bench

ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_help_lists_every_command(capsys):
    assert main(["help"]) == 0
    text = capsys.readouterr().out
    for command in COMMANDS:
        assert f"  {command} " in text
    assert "``" not in text


@pytest.mark.parametrize("command", list(COMMANDS))
def test_command_help_shows_defaults_without_rst(command, capsys):
    assert main(["help", command]) == 0
    text = capsys.readouterr().out
    assert "(default:" in text and "``" not in text


NO_GPU = "cuda:99"  # a GPU no machine here has
BAD_OPTIONS = {
    "demo": [
        ("--heads", "0", "expected an integer >= 1, got '0'"),
        ("--page-size", "x", "expected an integer >= 1, got 'x'"),
        ("--dtype", "int8", "invalid choice: 'int8'"),
        ("--device", "tpu", "expected cpu, cuda or cuda:N, got 'tpu'"),
        ("--device", NO_GPU, f"{NO_GPU}: this torch ("),
        ("--repeat", "0", "expected an integer >= 1, got '0'"),
    ],
    "bench": [
        ("--heads", "0", "expected an integer >= 1, got '0'"),
        ("--batch", "-1", "expected an integer >= 1, got '-1'"),
        ("--context", "0", "expected an integer >= 1, got '0'"),
        ("--requests", "two-long", "invalid choice: 'two-long'"),
        ("--page-size", "1.5", "expected an integer >= 1, got '1.5'"),
        ("--path", "avx2", "invalid choice: 'avx2'"),
        ("--dtype", "int8", "invalid choice: 'int8'"),
        ("--cache-format", "fp4", "invalid choice: 'fp4'"),
        ("--repeat", "0", "expected an integer >= 1, got '0'"),
        ("--rounds", "0", "expected an integer >= 1, got '0'"),
        ("--layers", "0", "expected an integer >= 1, got '0'"),
        ("--output-dir", __file__, f"expected a folder, got the file {__file__!r}"),
    ],
    "overhead": [
        ("--device", "tpu", "expected cpu, cuda or cuda:N, got 'tpu'"),
        ("--device", NO_GPU, f"{NO_GPU}: this torch ("),
        ("--dtype", "int8", "invalid choice: 'int8'"),
        ("--json", "/no/such/folder/x.json", "expected a file in an existing folder, got"),
        ("--repeat", "0", "expected an integer >= 1, got '0'"),
        ("--inner", "0", "expected an integer >= 1, got '0'"),
    ],
    "step": [
        ("--device", NO_GPU, f"{NO_GPU}: this torch ("),
        ("--dtype", "int8", "invalid choice: 'int8'"),
        ("--json", str(ROOT), "expected a file in an existing folder, got"),
        ("--batch", "0", "expected an integer >= 1, got '0'"),
        ("--context", "-1", "expected an integer >= 0, got '-1'"),
        ("--repeat", "0", "expected an integer >= 1, got '0'"),
    ],
    "dcp": [
        ("--ranks", "1", "expected an integer >= 2, got '1'"),
        ("--device", "tpu", "invalid choice: 'tpu'"),
        ("--heads", "0", "expected an integer >= 1, got '0'"),
        ("--batch", "0", "expected an integer >= 1, got '0'"),
        ("--context", "0", "expected an integer >= 1, got '0'"),
        ("--new-tokens", "0", "expected an integer >= 1, got '0'"),
        ("--page-size", "x", "expected an integer >= 1, got 'x'"),
        ("--interleave", "0", "expected an integer >= 1, got '0'"),
        ("--dtype", "int8", "invalid choice: 'int8'"),
        ("--repeat", "0", "expected an integer >= 1, got '0'"),
        ("--warmup", "-1", "expected an integer >= 0, got '-1'"),
        ("--json", str(ROOT), "expected a file in an existing folder, got"),
    ],
    "accuracy": [
        ("--heads", "0", "expected an integer >= 1, got '0'"),
        ("--contexts", "x", "expected an integer >= 1, got 'x'"),
        ("--batch", "0", "expected an integer >= 1, got '0'"),
        ("--new-tokens", "0", "expected an integer >= 1, got '0'"),
        ("--seed", "x", "invalid int value: 'x'"),
        ("--json", str(ROOT), "expected a file in an existing folder, got"),
    ],
}


def assert_one_line_usage_error(capsys, command: str, message: str) -> None:
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"python -m pymla {command}: error: {message}"), captured.err
    assert captured.err.count("\n") == 1, captured.err


@pytest.mark.parametrize(
    "command, option, value, message",
    [(command, *bad) for command, bads in BAD_OPTIONS.items() for bad in bads],
)
def test_a_bad_option_is_a_one_line_error(command, option, value, message, capsys):
    assert main([command, option, value]) == 2
    assert_one_line_usage_error(capsys, command, f"argument {option}: {message}")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_has_a_bad_value_tested(command, capsys):
    assert main([command, "--help"]) == 0
    options = set(re.findall(r"^  (--[a-z-]+)", capsys.readouterr().out, flags=re.M))
    switches = {"--help", "--force"}  # nothing to get wrong
    assert options - switches == {option for option, _, _ in BAD_OPTIONS[command]}


def test_cuda_on_a_torch_without_cuda_is_a_one_line_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("this torch sees a GPU")
    for command in ("demo", "overhead", "step"):
        assert main([command, "--device", "cuda"]) == 2
        assert_one_line_usage_error(
            capsys, command, f"argument --device: cuda: this torch ({torch.__version__}) sees no"
        )


def test_dcp_on_more_gpus_than_this_torch_sees_is_a_one_line_error(capsys):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = max(gpus + 1, 2)  # one more than it sees
    assert main(["dcp", "--device", "cuda", "--ranks", str(ranks)]) == 2
    assert_one_line_usage_error(
        capsys,
        "dcp",
        f"argument --device: cuda with --ranks {ranks} needs {ranks} GPUs, this torch "
        f"({torch.__version__}) sees {gpus}",
    )


@pytest.mark.parametrize("argv", [["benchmark"], ["help", "nosuch"]])
def test_unknown_command_is_a_one_line_error(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    name = argv[-1]
    assert err.startswith(f"python -m pymla: error: unknown command {name!r}"), err
    assert err.count("\n") == 1, err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"pymla {VERSION}\n"


def _env() -> dict[str, str]:
    """This process's environment as Python sees it, for a subprocess.

    Once a test in the session has imported ``max.nn`` (tests/test_max_native.py), the C
    environment holds its ``PYTHONEXECUTABLE`` and ``PYTHONPATH`` (``putenv``, unseen by
    ``os.environ``), and a Python started without ``env=`` runs outside this virtualenv.
    """
    return dict(os.environ)


@pytest.mark.parametrize(
    "invocation, prog",
    [(["-m", "pymla"], "python -m pymla"), ([], "pymla")],
    ids=["python -m pymla", "console script"],
)
def test_usage_names_the_program_as_invoked(invocation, prog):
    executable = (
        [sys.executable, *invocation] if invocation else [Path(sys.executable).with_name("pymla")]
    )
    for argv, usage in (
        (["help"], f"usage: {prog} COMMAND"),
        (["help", "bench"], f"usage: {prog} bench"),
    ):
        result = subprocess.run(
            executable + argv, capture_output=True, text=True, timeout=120, env=_env()
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(usage), result.stdout


def test_commands_show_pymla_info_records_on_stderr(monkeypatch, capsys):
    from pymla.tools import demo

    def logs(argv, prog):
        logging.getLogger("pymla").info("pymla: compiling mla_decode_branch_fp8 (test)")
        return 0

    monkeypatch.setattr(demo, "run", logs)
    handlers = list(logging.getLogger("pymla").handlers)
    assert main(["demo"]) == 0
    assert "pymla: compiling mla_decode_branch_fp8 (test)\n" in capsys.readouterr().err
    assert logging.getLogger("pymla").handlers == handlers  # the command's handler is gone


APPLICATION = """
import logging, sys
import pymla
logging.basicConfig(filename=sys.argv[1], level=logging.INFO, format="%(name)s: %(message)s")
logging.getLogger("pymla").info("a record from pymla")
"""


def test_an_applications_logging_receives_pymla_records(tmp_path):
    log = tmp_path / "app.log"
    result = subprocess.run(
        [sys.executable, "-c", APPLICATION, str(log)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert result.returncode == 0, result.stderr
    assert log.read_text() == "pymla: a record from pymla\n"
    assert "a record from pymla" not in result.stderr  # no handler of pymla's own


def test_overhead_and_step_run_and_save_json(tmp_path, capsys):
    path = tmp_path / "overhead.json"
    assert (
        main(["overhead", "--device", "cpu", "--repeat", "1", "--inner", "2", "--json", str(path)])
        == 0
    )
    saved = json.loads(path.read_text())
    (row,) = saved["results"]
    assert row["execute_s"] > 0 and row["run_s"] > 0 and saved["machine"]["cpu"]
    assert main(["step", "--device", "cpu", "--batch", "1", "--context", "8", "--repeat", "1"]) == 0
    text = capsys.readouterr().out
    assert "61 layers" in text and "saved" not in text.split("61 layers")[1]


def test_dcp_times_both_exchanges_and_heads_split_over_two_gloo_ranks(
    tmp_path, monkeypatch, capsys
):
    from pymla.distributed import NVLINK_MULTICAST_OFF

    for name in NVLINK_MULTICAST_OFF:  # unset here; what the command sets is undone afterwards
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    path = tmp_path / "dcp.json"
    heads, batch, new, ranks = 4, 2, 2, 2
    argv = ["dcp", "--heads", str(heads), "--batch", str(batch), "--context", "40"]
    argv += ["--new-tokens", str(new), "--page-size", "16", "--repeat", "2", "--warmup", "1"]
    assert main([*argv, "--json", str(path)]) == 0
    text = capsys.readouterr().out
    saved = json.loads(path.read_text())
    meta = saved["meta"]
    assert meta["device"] == "cpu" and meta["device_name"] == cpu_paths.cpu_model()
    assert meta["environment"] == dict(NVLINK_MULTICAST_OFF)
    tokens, b = batch * new, 2  # bf16
    for rank, row in enumerate(saved["ranks"]):
        timed = ["local op", "exchange", "merge", "step 6", "run", "run a2a", "run tp", "tp gather"]
        assert all(0 < row[k] < 60e3 for k in timed), (rank, row)
        assert row["tp gather"] < row["run tp"]  # the gather is part of the heads-split layer
        assert row["merge + step 6"] == pytest.approx(row["merge"] + row["step 6"])
        phased = row["local op"] + row["exchange"] + row["merge"] + row["step 6"]
        assert row["merge share"] == pytest.approx(row["merge"] / phased)
        assert row["bytes received"] == (ranks - 1) * tokens * heads * (512 * b + 4)
        per = heads // ranks
        assert row["bytes received a2a"] == (ranks - 1) * tokens * per * (512 * b + 4 + 128 * b)
        assert row["bytes received tp"] == (ranks - 1) * tokens * per * 128 * b
    assert saved["ranks"][0]["one-process op"] > 0 and "one-process op" not in saved["ranks"][1]
    assert sum(row["cache rows held"] for row in saved["ranks"]) == batch * (40 + new)
    header = next(line for line in text.splitlines() if line.startswith("rank "))
    assert "run tp" in header and "bytes in tp" in header
    assert "heads split: " in text and f"= {100 * saved['ranks'][0]['merge share']:.1f}%" in text


# ---------------------------------------------------------------- bench


@pytest.fixture
def fast_rooflines(monkeypatch):
    """Made-up copy bandwidth and matmul rate instead of the second of measuring them."""
    monkeypatch.setattr(bench, "measure_copy_bandwidth", lambda: 30e9)
    monkeypatch.setattr(bench, "matmul_ceiling", lambda: (400e9, "bfloat16"))


def test_last_level_cache_is_the_largest_cache_listed():
    from pymla.tools import timing

    largest = timing.last_level_cache_bytes()
    assert largest >= 2**20  # every CPU here lists at least a MiB of cache
    levels = Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")
    listed = [int(p.read_text().strip().removesuffix("K")) * 1024 for p in levels]
    assert all(size <= largest for size in listed)


@pytest.mark.parametrize(
    ("lengths", "cache_format", "llc", "expected"),
    [
        # 8 x 16k bf16 rows, 151 MB a layer: 5 layers exceed twice 320 MiB, 4 do not.
        ((16383,) * 8, "dtype", 320 * 2**20, 5),
        # the same rows as fp8_ds_mla (656 bytes): 86 MB a layer, 8 layers.
        ((16383,) * 8, "fp8_ds_mla", 320 * 2**20, 8),
        # rows already past twice the cache: one layer
        ((16383,) * 8, "dtype", 32 * 2**20, 1),
        # a tiny case: no more layers than DeepSeek-V3 has
        ((7,), "dtype", 320 * 2**20, 61),
    ],
)
def test_layers_past_cache_exceed_twice_the_last_level_cache(lengths, cache_format, llc, expected):
    layers = bench.layers_past_cache(lengths, torch.bfloat16, cache_format, llc)
    assert layers == expected
    row = 656 if cache_format == "fp8_ds_mla" else 576 * 2
    per_layer = sum(n + 1 for n in lengths) * row
    if 1 < layers < 61:
        assert layers * per_layer > 2 * llc >= (layers - 1) * per_layer


@pytest.mark.parametrize(
    ("rates", "expected"),
    [
        # no bf16 units (AVX2): the probe is slow, the full bf16 product is never timed
        ({"bfloat16": 1e9, "float32": 140e9}, (140e9, "float32")),
        # AVX512-BF16 / AMX: bf16 faster
        ({"bfloat16": 900e9, "float32": 300e9}, (900e9, "bfloat16")),
        # bf16 units but slower than float32 at full size
        ({"bfloat16": 200e9, "float32": 300e9}, (300e9, "float32")),
    ],
)
def test_matmul_ceiling_is_the_faster_dtype(monkeypatch, rates, expected):
    from pymla.tools import timing

    timed = []

    def fake(dtype=torch.bfloat16, n=2048):
        name = str(dtype).removeprefix("torch.")
        timed.append((name, n))
        return rates[name]

    monkeypatch.setattr(timing, "measure_matmul_rate", fake)
    assert timing.matmul_ceiling() == expected
    full_bf16 = ("bfloat16", 2048) in timed
    assert full_bf16 == (rates["bfloat16"] >= rates["float32"] / 4)


@pytest.fixture
def f32_only_kernel(monkeypatch, fast_rooflines):
    """A compiled kernel with only the f32 path, as pymla.cpu_paths would report it."""

    def resolve(requested, dtype):
        if requested in ("auto", "f32"):
            return "f32"
        raise ValueError(
            f"PYMLA_CPU_PATH: expected a path the compiled kernel has (f32), got {requested!r}"
        )

    monkeypatch.setattr(bench, "kernel_cpu_paths", lambda: ("f32",))
    monkeypatch.setattr(bench, "resolve_cpu_path", resolve)


SMALL = ["--heads", "1", "--batch", "1", "--page-size", "4", "--repeat", "1"]


def test_bench_skips_paths_the_kernel_lacks_and_labels_the_path_that_ran(
    f32_only_kernel, tmp_path, capsys
):
    argv = ["bench", *SMALL, "--context", "8", "--path", "avx512bf16", "auto", "f32"]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert (
        "skipping --path avx512bf16: PYMLA_CPU_PATH: expected a path the compiled kernel has" in err
    )
    assert "skipping --path f32: it runs f32, already listed" in err
    (saved,) = tmp_path.glob("cpu-*.json")
    result = json.loads(saved.read_text())
    assert [r["path"] for r in result["rows"]] == ["f32"]
    assert result["meta"]["cpu_paths"] == ["f32"] and result["meta"]["cases"] == 1
    assert result["rows"][0]["op_ms"] > 0 and result["rows"][0]["run_ms"] > 0


def test_bench_with_no_path_the_kernel_has_is_a_one_line_error(f32_only_kernel, tmp_path, capsys):
    assert main(["bench", "--path", "avx512bf16", "--output-dir", str(tmp_path)]) == 2
    skip, error = capsys.readouterr().err.splitlines()
    assert skip.startswith(
        "skipping --path avx512bf16: PYMLA_CPU_PATH: expected a path the compiled kernel has"
    )
    assert error == (
        "python -m pymla bench: error: argument --path: the kernel has none of avx512bf16 "
        "(it has f32)"
    )
    assert list(tmp_path.iterdir()) == []


def test_bench_saves_every_case_before_the_next(fast_rooflines, tmp_path, monkeypatch):
    measured = []

    def crash_on_second(*args):
        if measured:
            raise RuntimeError("the second case crashed")
        measured.append(bench_one(*args))
        return measured[-1]

    bench_one = bench.bench_one
    monkeypatch.setattr(bench, "bench_one", crash_on_second)
    argv = ["bench", *SMALL, "--context", "8", "12", "--output-dir", str(tmp_path)]
    with pytest.raises(RuntimeError, match="second case"):
        main(argv)
    (saved,) = tmp_path.glob("cpu-*.json")
    result = json.loads(saved.read_text())
    (row,) = result["rows"]
    assert {k: row[k] for k in measured[0]} == measured[0] and row["context"] == 8
    assert row["rounds"] == [{k: measured[0][k] for k in bench.ROUND_KEYS}]
    assert result["meta"]["cases"] == 2
    assert measured[0]["path"] == cpu_paths.resolve_cpu_path("auto", torch.bfloat16)


def test_bench_rounds_alternate_the_cases_each_beside_its_own_ceilings(
    fast_rooflines, tmp_path, monkeypatch, capsys
):
    bandwidths = iter([30e9, 10e9, 20e9, 40e9, 25e9, 5e9])
    monkeypatch.setattr(bench, "measure_copy_bandwidth", lambda: next(bandwidths))
    contexts = []
    bench_one = bench.bench_one

    def record(*args):
        contexts.append(args[2])
        return bench_one(*args)

    monkeypatch.setattr(bench, "bench_one", record)
    argv = ["bench", *SMALL, "--context", "8", "12", "--rounds", "3"]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 0
    assert contexts == [8, 12, 8, 12, 8, 12]
    (saved,) = tmp_path.glob("cpu-*.json")
    result = json.loads(saved.read_text())
    assert result["meta"]["rounds"] == 3
    first, second = result["rows"]
    assert [r["copy_bandwidth_bytes_per_s"] for r in first["rounds"]] == [30e9, 20e9, 25e9]
    assert [r["copy_bandwidth_bytes_per_s"] for r in second["rounds"]] == [10e9, 40e9, 5e9]
    for row in (first, second):
        rounds = row["rounds"]
        # Each round against its own roofline: the memory floor follows that round's bandwidth.
        floors = [
            row["cache_and_weight_bytes"] / r["copy_bandwidth_bytes_per_s"] * 1e3 for r in rounds
        ]
        roofs = [max(f, row["compute_floor_ms"]) for f in floors]
        assert [r["roofline_ms"] for r in rounds] == pytest.approx(roofs)
        ratios = [r["run_ms"] / roof for r, roof in zip(rounds, roofs, strict=True)]
        assert row["run_over_roofline"] == pytest.approx(statistics.median(ratios))
        assert row["run_ms"] == statistics.median(r["run_ms"] for r in rounds)
        runs = [r["run_ms"] for r in rounds]
        assert row["run_spread"] == pytest.approx(max(runs) / min(runs))
    assert "medians of 3 round(s)" in capsys.readouterr().out


def test_bench_times_the_fp8_cache_beside_the_dtype_cache(fast_rooflines, tmp_path, capsys):
    argv = ["bench", *SMALL, "--context", "40", "--cache-format", "dtype", "fp8_ds_mla"]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 0
    (saved,) = tmp_path.glob("cpu-*.json")
    dtype_row, fp8_row = json.loads(saved.read_text())["rows"]
    assert (dtype_row["cache_format"], fp8_row["cache_format"]) == ("dtype", "fp8_ds_mla")
    assert dtype_row["op_ms"] > 0 and fp8_row["op_ms"] > 0
    assert dtype_row["run_ms"] > 0 and fp8_row["run_ms"] > 0
    # The roofline reads the rows as stored: 576 bf16 values, or 656 bytes.
    weights = dtype_row["cache_and_weight_bytes"] - 40 * 576 * 2
    assert fp8_row["cache_and_weight_bytes"] == weights + 40 * 656
    assert dtype_row["plain_torch_ms"] > 0 and fp8_row["plain_torch_ms"] is None
    table = capsys.readouterr().out
    assert " fp8_ds_mla |" in table and table.rstrip().count("\n") >= 3


@pytest.mark.parametrize("layers", [None, "3"])
def test_bench_calls_cycle_through_the_cache_layers(fast_rooflines, tmp_path, monkeypatch, layers):
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: 20 * 2**10)
    ran = []
    make_plan = bench.plan

    def recording_plan(*args, **kwargs):
        step = make_plan(*args, **kwargs)
        step_run = step.run

        def record(q, layer, weights):
            ran.append(layer)
            return step_run(q, layer, weights)

        step.run = record
        return step

    monkeypatch.setattr(bench, "plan", recording_plan)
    argv = ["bench", *SMALL, "--context", "8", "--output-dir", str(tmp_path)]
    assert main(argv + (["--layers", layers] if layers else [])) == 0
    (saved,) = tmp_path.glob("cpu-*.json")
    (row,) = json.loads(saved.read_text())["rows"]
    # 8 bf16 rows of 576 values a layer: 9216 bytes; twice 20 KiB takes 5 layers.
    expected = int(layers) if layers else 5
    assert row["layers"] == expected
    assert ran == [i % expected for i in range(len(ran))] and len(ran) > expected


def test_bench_times_a_long_request_beside_short_ones(fast_rooflines, tmp_path, capsys):
    argv = ["bench", *SMALL, "--batch", "3", "--context", "64", "--requests", "equal", "one-long"]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 0
    (saved,) = tmp_path.glob("cpu-*.json")
    equal, one_long = json.loads(saved.read_text())["rows"]
    assert (equal["requests"], one_long["requests"]) == ("equal", "one-long")
    assert equal["cache_lengths"] == [63, 63, 63] and one_long["cache_lengths"] == [63, 3, 3]
    # The roofline counts the keys each request sees: 64 + 4 + 4 rows of 576 bf16 values.
    weights = equal["cache_and_weight_bytes"] - 3 * 64 * 576 * 2
    assert one_long["cache_and_weight_bytes"] == weights + (64 + 4 + 4) * 576 * 2
    assert equal["op_ms"] > 0 and one_long["op_ms"] > 0
    table = capsys.readouterr().out
    assert "    equal " in table and " one-long " in table


def test_bench_refuses_the_fp8_cache_with_another_dtype(tmp_path, capsys):
    argv = ["bench", "--dtype", "float32", "--cache-format", "fp8_ds_mla"]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 2
    assert_one_line_usage_error(
        capsys, "bench", "argument --cache-format: fp8_ds_mla needs --dtype bfloat16, got float32"
    )


def test_bench_keeps_existing_results_without_force(tmp_path, capsys):
    existing = tmp_path / f"{bench.file_stem(cpu_paths.cpu_model())}.json"
    existing.write_text("{}")
    assert main(["bench", "--output-dir", str(tmp_path)]) == 2
    assert_one_line_usage_error(
        capsys, "bench", f"argument --output-dir: {existing} exists: pass --force"
    )
    assert existing.read_text() == "{}"


def test_accuracy_measures_the_fp8_cache_against_both(tmp_path, capsys):
    """The fp8 cache's errors: those of e4m3 (unit roundoff 2^-4), well above bf16's (2^-8)."""
    path = tmp_path / "acc.json"
    argv = ["accuracy", "--heads", "4", "--contexts", "60", "--batch", "1", "--json", str(path)]
    assert main(argv) == 0
    assert "CPU: " in capsys.readouterr().out
    (shape,) = json.loads(path.read_text())["shapes"]
    att = shape["attention"]
    assert 2**-8 < shape["cache_latent_fp8_vs_bf16"] < 2**-4
    assert att["bf16_vs_f32_reference"] < 2**-6 < att["fp8_vs_f32_reference"] < 2**-3
    assert att["fp8_vs_bf16_op"] > 4 * att["bf16_vs_f32_reference"]
