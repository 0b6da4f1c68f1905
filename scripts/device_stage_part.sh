#!/usr/bin/env bash
# Runs ON the device machine, in the repo root: bash scripts/device_stage_part.sh N
#
# Copies wheel part N (carried as .whl/parts/partN) into /tmp/stage and checks
# its sha256 against the MANIFEST. For N > 1 it first checks that the earlier
# chunks are still in /tmp/stage: if not, the machine was given back between
# calls (more than 30 s idle) and staging must restart from part 1 (exit 3).
set -euo pipefail

N=${1:?usage: device_stage_part.sh N}
STAGE=${STAGE:-/tmp/stage}
SRC=.whl/parts/part$N

if [[ ! -d "$SRC" ]]; then
    echo "STAGE ERROR: $SRC is not here; name it in the call's carry list" >&2
    exit 2
fi
mkdir -p "$STAGE"
manifest="$SRC/MANIFEST"
mapfile -t chunks < <(awk '/^chunk /{print $2}' "$manifest")
total=${#chunks[@]}
if ((N < 1 || N > total)); then
    echo "STAGE ERROR: part $N out of range 1..$total" >&2
    exit 2
fi

for ((i = 1; i < N; i++)); do
    if [[ ! -f "$STAGE/${chunks[i - 1]}" ]]; then
        echo "MACHINE NOT WARM: $STAGE lacks ${chunks[i - 1]} (part $i)." >&2
        echo "The machine was given back between calls: restart from part 1." >&2
        exit 3
    fi
done

cp "$SRC"/wheels.tar.part* "$STAGE"/
cp "$manifest" "$STAGE/MANIFEST"
expected=$(awk -v c="${chunks[N - 1]}" '$1 == "chunk" && $2 == c {print $3}' "$manifest")
actual=$(sha256sum "$STAGE/${chunks[N - 1]}" | cut -d' ' -f1)
if [[ "$expected" != "$actual" ]]; then
    echo "STAGE ERROR: ${chunks[N - 1]} sha256 $actual, MANIFEST says $expected" >&2
    exit 4
fi
have=$(find "$STAGE" -maxdepth 1 -name 'wheels.tar.part*' | wc -l)
echo "staged part $N/$total (${chunks[N - 1]}, sha256 OK); $have/$total chunks in $STAGE" \
    "($(du -cb "$STAGE"/wheels.tar.part* | tail -1 | cut -f1) bytes)"
if ((have == total)); then
    echo "all parts staged: next run scripts/device_setup.sh"
fi
