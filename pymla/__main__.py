"""``python -m pymla COMMAND`` (also installed as the ``pymla`` command).

Each command lives in :mod:`pymla.tools` (``COMMANDS`` names its module),
imported only when it runs.

Also what every command shares: the program name as invoked, a parser whose
usage errors are one line (exit 2), the option types, and pymla's log
records (compile progress) on stderr while a command runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

COMMANDS = {
    "demo": ("demo", "run the op on DeepSeek-V3-like shapes against the torch reference"),
    "bench": ("bench", "benchmark table: op vs torch reference vs best plain torch"),
    "overhead": ("overhead", "host overhead per run() over MAX's execute on prepared buffers"),
    "step": ("overhead", "one 61-layer decode step: wall time vs the sum of its kernel times"),
    "dcp": ("dcp", "decode over N ranks (gloo or NCCL), DCP and heads split: ms, bytes per layer"),
    "accuracy": (
        "accuracy",
        "fp8_ds_mla cache: relative error vs the float32 reference, per shape",
    ),
}
RUNNERS = {
    "demo": "run",
    "bench": "run",
    "overhead": "run_overhead",
    "step": "run_step",
    "dcp": "run",
    "accuracy": "run",
}


def program() -> str:
    """The program as invoked: ``pymla`` (the console script) or ``python -m pymla``."""
    return "pymla" if Path(sys.argv[0]).stem == "pymla" else "python -m pymla"


def usage(prog: str) -> str:
    return (
        f"usage: {prog} COMMAND [options]\n       {prog} --version\n\n"
        + "\n".join(f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items())
        + "\n  help      this text; 'help COMMAND' shows a command's options\n"
    )


class CommandParser(argparse.ArgumentParser):
    """A command's parser: defaults shown in --help, a usage error as one line and exit 2."""

    def __init__(self, prog: str, description: str) -> None:
        super().__init__(
            prog=prog,
            description=description,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An option type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def json_file(text: str) -> Path:
    """An option type: a file to write in a folder that exists (checked before measuring)."""
    path = Path(text)
    if path.is_dir() or not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file in an existing folder, got {text!r}")
    return path


def torch_device(text: str) -> str:
    """An option type: cpu, or cuda / cuda:N when this torch sees that GPU."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            seen = f"{count} CUDA device{'' if count == 1 else 's'}" if count else "no CUDA device"
            raise argparse.ArgumentTypeError(
                f"{text}: this torch ({torch.__version__}) sees {seen}"
            )
    return text


@contextlib.contextmanager
def progress_on_stderr() -> Iterator[None]:
    """pymla's INFO records (compile progress) on stderr, for the duration of a command."""
    logger = logging.getLogger("pymla")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prog = program()
    if not argv:
        print(usage(prog), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "--version":
        from . import __version__

        print(f"pymla {__version__}")
        return 0
    if command in ("-h", "--help", "help"):
        if rest:
            return main([rest[0], "--help"])
        print(usage(prog))
        return 0
    if command not in COMMANDS:
        print(
            f"{prog}: error: unknown command {command!r} (expected one of {', '.join(COMMANDS)}; "
            f"'{prog} help' describes them)",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(f"pymla.tools.{COMMANDS[command][0]}")
    try:
        with progress_on_stderr():
            return getattr(module, RUNNERS[command])(rest, f"{prog} {command}")
    except SystemExit as e:  # argparse: --help and usage errors
        return e.code if isinstance(e.code, int) else 2


if __name__ == "__main__":
    sys.exit(main())
