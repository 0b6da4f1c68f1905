#!/usr/bin/env bash
# Run HERE (a machine with PyPI access), from anywhere inside the repo.
#
# Downloads the cp312 manylinux x86_64 wheels that MAX 26.7 needs on the GPU
# device machine (Python 3.12, torch 2.11, no registry access) into .whl/,
# packs them into one tar and splits it into parts of 45 MiB (under 48 MB)
# under .whl/parts/partN/, one part per device call (a call carries at most
# 64 MiB). Each part folder holds its chunk and the MANIFEST (sha256 of every
# chunk and of the whole tar), so the device side can check what arrived.
#
# Usage: scripts/fetch_device_wheels.sh            (WITH_SHMEM=1 also adds max-shmem-libs,
#        WITH_FLASHINFER=1 FlashInfer and what it imports: two more parts)
# Then follow scripts/README.md.
set -euo pipefail

ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$ROOT"
PY=${PYTHON:-python3}
WHL=.whl
PART_SIZE=${PART_SIZE:-45M}

# .whl/ must stay out of git (the repo's .gitignore lists /.whl/; make sure).
if ! git check-ignore -q "$WHL/x.whl"; then
    mkdir -p .git/info
    echo "/.whl/" >>.git/info/exclude
fi

# max's Requires-Dist on a py3.12 / torch-2.11 device image: click, numpy,
# psutil, rich, typing-extensions are already there; msgspec, taskgroup and
# exceptiongroup are not. mojo-compiler holds mojo.importer (max.nn compiles
# max/_kv_cache_ops/kv_cache_ops.mojo at import) and libMSupportGlobals.so;
# mojo-compiler-mojo-libs is the Mojo stdlib. The `mojo` wheel (LSP, lldb)
# is not needed. max-core also lists max-shmem-libs (nvshmem, multi-GPU
# only); the recipe that worked on the H200 did without it.
PKGS=(
    max==26.7.0
    max-core==26.7.0
    max-mojo-libs==26.7.0
    mojo-compiler==1.2.0
    mojo-compiler-mojo-libs==1.2.0
    msgspec==0.23.0
    taskgroup==0.2.2
    exceptiongroup==1.3.2
)
if [[ "${WITH_SHMEM:-0}" == 1 ]]; then
    PKGS+=(max-shmem-libs==26.7.0)
fi
# FlashInfer, the second GPU peer (scripts/flashinfer_peer.py): the wheel carries its CUDA
# sources and JIT-compiles them with the device's nvcc. `import flashinfer` needs these beside
# torch (found by importing it with --no-deps, 2026-12-05); ninja drives the JIT build.
if [[ "${WITH_FLASHINFER:-0}" == 1 ]]; then
    PKGS+=(
        flashinfer-python==0.7.2.post1
        apache-tvm-ffi==0.1.15.post2
        einops==0.8.2
        tabulate==0.10.0
        tqdm==4.70.1
        nvidia-ml-py==13.615.71
        ninja==1.13.2
        requests==2.34.2
        urllib3==2.8.0
        idna==3.20
        certifi==2026.10.19.post1
    )
fi

PLATFORMS=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
    manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done

rm -rf "$WHL/w" "$WHL/parts" "$WHL/wheels.tar"
mkdir -p "$WHL/w"
echo "== downloading ${#PKGS[@]} wheels (cp312, manylinux x86_64) into $WHL/w"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$WHL/w" "${PKGS[@]}" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)

# Exactly one wheel per package, each for cp312 or pure Python.
n=$(find "$WHL/w" -name '*.whl' | wc -l)
if [[ "$n" -ne "${#PKGS[@]}" ]]; then
    echo "expected ${#PKGS[@]} wheels, got $n:" >&2
    ls "$WHL/w" >&2
    exit 1
fi
for f in "$WHL"/w/*.whl; do
    case "$(basename "$f")" in
    *-cp312-*manylinux*x86_64*.whl | *-py3-none-any.whl | *-py2.py3-none-any.whl | *-py3-none-manylinux*x86_64*.whl) ;;
    *)
        echo "unexpected wheel tag: $f" >&2
        exit 1
        ;;
    esac
done

echo "== Requires-Dist (not 'extra') of each wheel, for the record"
for f in "$WHL"/w/*.whl; do
    deps=$(unzip -p "$f" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' |
        sed 's/^Requires-Dist: //' | tr '\n' ' ' || true)
    printf '  %-60s %s\n' "$(basename "$f")" "${deps:--}"
done

echo "== packing and splitting into $PART_SIZE parts"
tar -C "$WHL" -cf "$WHL/wheels.tar" w
mkdir -p "$WHL/parts/tmp"
split -b "$PART_SIZE" -d -a 2 "$WHL/wheels.tar" "$WHL/parts/tmp/wheels.tar.part"
chunks=("$WHL"/parts/tmp/wheels.tar.part*)
manifest="$WHL/parts/MANIFEST"
{
    echo "chunks ${#chunks[@]}"
    echo "tar $(sha256sum "$WHL/wheels.tar" | cut -d' ' -f1) $(stat -c %s "$WHL/wheels.tar")"
    for c in "${chunks[@]}"; do
        echo "chunk $(basename "$c") $(sha256sum "$c" | cut -d' ' -f1) $(stat -c %s "$c")"
    done
} >"$manifest"
i=0
for c in "${chunks[@]}"; do
    i=$((i + 1))
    mkdir -p "$WHL/parts/part$i"
    mv "$c" "$WHL/parts/part$i/"
    cp "$manifest" "$WHL/parts/part$i/MANIFEST"
done
rmdir "$WHL/parts/tmp"

echo "== verifying: reassemble and list"
cat "$WHL"/parts/part*/wheels.tar.part* | sha256sum -c <(echo "$(sha256sum "$WHL/wheels.tar" | cut -d' ' -f1)  -") >/dev/null
listed=$(cat "$WHL"/parts/part*/wheels.tar.part* | tar -tf - | grep -c '\.whl$')
[[ "$listed" -eq "$n" ]] || {
    echo "reassembled tar lists $listed wheels, expected $n" >&2
    exit 1
}
echo "reassembled tar OK: $listed wheels"

echo "== wheels"
ls -l "$WHL"/w/*.whl | awk '{printf "  %10d  %s\n", $5, $9}'
echo "== parts (carry one per device call)"
for d in "$WHL"/parts/part*/; do
    printf '  %-20s %s\n' "${d%/}" "$(du -b "$d" | cut -f1) bytes"
done
echo "total wheels: $(du -cb "$WHL"/w/*.whl | tail -1 | cut -f1) bytes in $i parts"

# FlashInfer alone, for a peer run without MAX: the 62 MB wheel in two halves (a call carries at
# most 64 MiB with the working tree: a1, a2) and its dependencies (b); scripts/device_stage_flashinfer.sh
# puts the wheel back together on the device.
if [[ "${WITH_FLASHINFER:-0}" == 1 ]]; then
    rm -rf "$WHL/fi" && mkdir -p "$WHL/fi/a1" "$WHL/fi/a2" "$WHL/fi/b"
    fi_whl=$(ls "$WHL"/w/flashinfer_python-*.whl)
    half=$(( ($(stat -c %s "$fi_whl") + 1) / 2 ))
    head -c "$half" "$fi_whl" > "$WHL/fi/a1/fi.part0"
    tail -c +$(( half + 1 )) "$fi_whl" > "$WHL/fi/a2/fi.part1"
    basename "$fi_whl" > "$WHL/fi/a2/NAME"
    sha256sum "$fi_whl" | cut -d' ' -f1 > "$WHL/fi/a2/SHA256"
    for w in apache_tvm_ffi einops tabulate tqdm nvidia_ml_py ninja requests urllib3 idna certifi; do
        cp "$WHL"/w/"$w"-*.whl "$WHL/fi/b/"
    done
    echo "FlashInfer without MAX: $WHL/fi/a1, $WHL/fi/a2 (the wheel in halves), $WHL/fi/b ($(du -sb "$WHL/fi/b" | cut -f1) bytes)"
fi
