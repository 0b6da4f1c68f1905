"""Compares two folders of PTX files kernel by kernel, up to symbol names.

    python scripts/ptx_compare.py BEFORE_DIR AFTER_DIR

Each `.ptx` file of `build_devbin.sh` (one per kernel instance) is normalized:
the mangled names of its entry and device functions (which carry the module
path and a hash of it) become placeholders in order of first appearance, and
comments and the file header go. The two folders' normalized kernels are then
matched as multisets: prints how many are identical, and for the others the
files that have no identical partner. Exit 1 when any differ.
"""

from __future__ import annotations

import collections
import hashlib
import pathlib
import re
import sys

SYMBOL = re.compile(r"\b(?:_Z\w+|mojo_kernels\w+|tests_gpu\w+|smoke_\w+)")


def normalize(text: str) -> str:
    names: dict[str, str] = {}

    def placeholder(m: re.Match) -> str:
        return names.setdefault(m.group(0), f"SYM{len(names)}")

    lines = []
    for line in text.splitlines():
        line = line.split("//", 1)[0].rstrip()
        if not line:
            continue
        lines.append(SYMBOL.sub(placeholder, line))
    return "\n".join(lines)


def kernels(folder: pathlib.Path) -> dict[str, list[str]]:
    by_hash: dict[str, list[str]] = collections.defaultdict(list)
    for f in sorted(folder.glob("*.ptx")):
        digest = hashlib.sha256(normalize(f.read_text()).encode()).hexdigest()
        by_hash[digest].append(f.name)
    return by_hash


def family(name: str) -> str:
    return re.sub(r"_[0-9a-f]{16}\.ptx$", "", name)


def unmatched(a: dict[str, list[str]], b: dict[str, list[str]]) -> list[str]:
    """The files of `a` whose normalized kernel has no partner left in `b`."""
    return sorted(n for h, names in a.items() for n in names[len(b.get(h, [])) :])


def main() -> int:
    before, after = (kernels(pathlib.Path(p)) for p in sys.argv[1:3])
    same = sum(min(len(before[h]), len(after[h])) for h in before.keys() & after.keys())
    total = sum(len(v) for v in after.values())
    print(
        f"{same} of {total} kernels identical up to symbol names ({sum(len(v) for v in before.values())} before)"
    )
    lost, new = unmatched(before, after), unmatched(after, before)
    for label, names in (("before only", lost), ("after only", new)):
        for family_name, count in collections.Counter(map(family, names)).items():
            print(f"  {label}: {count} x {family_name}")
    return 0 if not lost and not new else 1


if __name__ == "__main__":
    sys.exit(main())
