"""Instruction counts of the loops of GPU kernels, read offline from their PTX (no GPU needed).

    python scripts/sass_loops.py FILE [FILE...] [--match REGEX] [--min-span 100] [--max-span 3000]

Each PTX file (one kernel instance, as `scripts/build_devbin.sh` or `mojo build --emit asm` leaves
them) is assembled for sm_90a with `ptxas -v` (registers and spills printed); a `.cubin` (e.g. a
peer's kernel built with `nvcc -cubin`) is taken as it is. Each is disassembled with
`nvdisasm` (from `$NVDISASM`, the PATH, or the CUDA wheels some sessions unpack under /tmp), and each
loop, found by a backward branch spanning between `--min-span` and `--max-span` SASS lines, is
printed with its instruction count and the opcodes that take the most of it. A count is what one
warp issues per trip: the same tensor work in fewer instructions leaves the issue slots to the
softmax and the copies (06m: the 64-row kernel's 802 instructions a key block against FlashMLA's
about 430). Static counts: both sides of a branch inside the loop are counted.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"BRA[^`]*`\((\.L_x_\d+)\)")
INSTR = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def nvdisasm() -> str:
    for path in [os.environ.get("NVDISASM", ""), shutil.which("nvdisasm") or ""] + sorted(
        glob.glob("/tmp/*/nvidia/cu*/bin/nvdisasm")
        + glob.glob("/tmp/*/triton/backends/nvidia/bin/nvdisasm")
    ):
        if path and os.access(path, os.X_OK):
            return path
    sys.exit(
        "sass_loops: no nvdisasm (set NVDISASM, or `pip install nvidia-cuda-nvdisasm` into a folder)"
    )


def loops(sass: list[str], min_span: int, max_span: int) -> list[tuple[int, int]]:
    """(first line, last line) of each loop: a branch back to a label between min_span and max_span lines up."""
    labels: dict[str, int] = {}
    found = []
    for n, line in enumerate(sass):
        m = LABEL.match(line)
        if m:
            labels[m.group(1)] = n
        b = BRANCH.search(line)
        if b and b.group(1) in labels and min_span <= n - labels[b.group(1)] <= max_span:
            found.append((labels[b.group(1)], n))
    return found


def opcode_counts(lines: list[str]) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for line in lines:
        m = INSTR.match(line)
        if m:
            counts[m.group(1)] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ptx", nargs="+")
    ap.add_argument("--match", default="", help="only files whose name matches this regex")
    ap.add_argument("--min-span", type=int, default=100)
    ap.add_argument("--max-span", type=int, default=3000)
    ap.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    args = ap.parse_args()
    disasm = nvdisasm()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        for path in args.ptx:
            if args.match and not re.search(args.match, os.path.basename(path)):
                continue
            binary = path
            if not path.endswith(".cubin"):
                binary = cubin
                ptxas = subprocess.run(
                    ["ptxas", "-arch=sm_90a", "-v", path, "-o", cubin],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                report = " ".join(
                    line.split("ptxas info    : ")[-1].strip()
                    for line in ptxas.stderr.splitlines()
                    if "registers" in line or "spill" in line or "C75" in line
                )
                print(f"{os.path.basename(path)}: {report}")
                if ptxas.returncode != 0:
                    print("  ptxas failed:", ptxas.stderr.strip()[-300:])
                    continue
            else:
                print(f"{os.path.basename(path)}:")
            sass = subprocess.run(
                [disasm, binary], capture_output=True, text=True, check=True
            ).stdout.splitlines()
            for first, last in loops(sass, args.min_span, args.max_span):
                counts = opcode_counts(sass[first : last + 1])
                top = " ".join(f"{op} {n}" for op, n in counts.most_common(args.top))
                print(f"  loop at SASS line {first}: {sum(counts.values())} instructions: {top}")


if __name__ == "__main__":
    main()
