"""``python -m pymla COMMAND`` (also installed as the ``pymla`` command)."""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": ("demo", "run the op on DeepSeek-V3-like shapes against the torch reference"),
    "bench": ("bench", "benchmark table: op vs torch reference vs best plain torch"),
    "overhead": ("overhead", "host overhead per run() over MAX's execute on prepared buffers"),
    "step": ("overhead", "one 61-layer decode step: wall time vs the sum of its kernel times"),
}
RUNNERS = {"demo": "run", "bench": "run", "overhead": "run_overhead", "step": "run_step"}

USAGE = (
    "usage: python -m pymla COMMAND [options]\n\n"
    + "\n".join(f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items())
    + "\n  help      this text; 'help COMMAND' shows a command's options\n"
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help", "help"):
        if rest and rest[0] in COMMANDS:
            return main([rest[0], "--help"])
        print(USAGE)
        return 0
    if command not in COMMANDS:
        print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(f"pymla.{COMMANDS[command][0]}")
    try:
        return getattr(module, RUNNERS[command])(rest)
    except SystemExit as e:  # argparse: --help and usage errors
        return e.code if isinstance(e.code, int) else 2


if __name__ == "__main__":
    sys.exit(main())
