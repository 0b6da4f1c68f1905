"""``python -m pymla``: help, one-line errors, and the overhead / step benchmarks run."""

from __future__ import annotations

import json

import pytest

from pymla.__main__ import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["help"]) == 0
    text = capsys.readouterr().out
    for command in COMMANDS:
        assert f"  {command} " in text
    assert "``" not in text


@pytest.mark.parametrize("command", ["demo", "overhead", "step"])
def test_command_help_shows_defaults_without_rst(command, capsys):
    assert main(["help", command]) == 0
    text = capsys.readouterr().out
    assert "(default:" in text and "``" not in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--heads", "0"], "pymla demo: --heads must be >= 1, got 0\n"),
        (["demo", "--device", "cuda:0"], "pymla demo: --device cuda:0: "),
        (["demo", "--device", "tpu"], "pymla demo: --device 'tpu': "),
    ],
)
def test_demo_argument_errors_are_one_line(argv, message, capsys):
    import torch

    if "cuda:0" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_unknown_command(capsys):
    assert main(["benchmark"]) == 2
    assert "unknown command 'benchmark'" in capsys.readouterr().err


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
