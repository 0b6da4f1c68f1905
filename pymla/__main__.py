"""``python -m pymla {demo,bench}`` (also installed as the ``pymla`` command)."""

from __future__ import annotations

import sys

USAGE = """usage: python -m pymla {demo,bench} [options]

  demo   run the op on DeepSeek-V3-like shapes against the torch reference
  bench  benchmark table: op vs torch reference vs best plain torch (JSON + PNG)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from .demo import run
    elif command == "bench":
        from .bench import run
    else:
        print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
